"""Parse cost (``benchmarks/parse_cost.py``): this provider's LLMOperator."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from cancellable_agents import LLMOperator

with DAG(dag_id="parse_cost_llm", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    LLMOperator(task_id="llm", prompt="Write a haiku about {{ ds }}.", model="test")
