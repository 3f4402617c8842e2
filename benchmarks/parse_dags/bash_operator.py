"""Parse-cost baseline (``benchmarks/parse_cost.py``): one BashOperator, imported from under
``airflow.``, so the dag-processor's parent pre-imports it once for every parse."""

from __future__ import annotations

from datetime import datetime

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

with DAG(dag_id="parse_cost_bash", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    BashOperator(task_id="hello", bash_command="echo hello")
