"""Parse cost (``benchmarks/parse_cost.py``): common.ai's AgentOperator, parsed only by the
``.venv-common-ai`` interpreter. Imported from under ``airflow.``, so the dag-processor's parent
pre-imports it (and what it imports) once for every parse."""

from __future__ import annotations

from datetime import datetime

from airflow.providers.common.ai.operators.agent import AgentOperator
from airflow.sdk import DAG

with DAG(dag_id="parse_cost_common_ai_agent", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    AgentOperator(
        task_id="agent", prompt="List the files and summarise them.", llm_conn_id="pydantic_ai_default"
    )
