"""Parse cost (``benchmarks/parse_cost.py``): this provider's AgentOperator with a sandbox toolset."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from cancellable_agents import AgentOperator, SandboxToolset

with DAG(dag_id="parse_cost_agent", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    AgentOperator(
        task_id="agent",
        prompt="List the files and summarise them.",
        model="test",
        toolsets=[SandboxToolset()],
    )
