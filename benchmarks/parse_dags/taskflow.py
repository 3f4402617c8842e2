"""Parse cost (``benchmarks/parse_cost.py``): two plain TaskFlow tasks, the baseline of the decorator rows.

``@task`` loads the standard provider's Python decorator and operator in the parse child (they are
not ``airflow.*`` imports of the file, so the parent does not pre-import them): any TaskFlow DAG
pays that, ours included.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

with DAG(dag_id="parse_cost_taskflow", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):

    @task
    def investigate() -> str:
        return "List the files and summarise them."

    @task
    def haiku() -> str:
        return "Write a haiku."

    investigate()
    haiku()
