"""Parse cost (``benchmarks/parse_cost.py``): this provider's ``@task.agent`` and ``@task.llm``.

Those names are this provider's where common.ai is not installed (the main venv, where this file
is parsed); with common.ai installed they are common.ai's (``get_provider_info``)."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, task

from cancellable_agents import SandboxToolset

with DAG(dag_id="parse_cost_decorators", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):

    @task.agent(model="test", toolsets=[SandboxToolset()])
    def investigate() -> str:
        return "List the files and summarise them."

    @task.llm(model="test")
    def haiku() -> str:
        return "Write a haiku."

    investigate()
    haiku()
