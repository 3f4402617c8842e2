"""An agent with sub-agents: a lead delegates to a researcher (with a sandbox) and a writer.

``SubagentToolset`` gives the lead one tool, ``delegate(agent, task)``. Each delegation runs
under a *child* of the task's cancellation scope: killing the task cancels the sub-agents
(recorded with cause ``parent``; ``root_cause`` says why the task stopped), their sandbox
commands are killed, and the task log's record lists each sub-agent under ``children``.

Runs with no API key (the keyless ``test`` model delegates once with dummy arguments); set
``CANCELLABLE_AGENTS_CONN`` to a connection id and the lead and both sub-agents use it.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG

from cancellable_agents import AgentOperator, SandboxToolset, Subagent, SubagentToolset

LLM_CONN_ID = os.environ.get("CANCELLABLE_AGENTS_CONN")
MODEL = None if LLM_CONN_ID else "test"

# Described, not built: the task makes each sub-agent when it is first asked (a parse of this file
# imports no pydantic-ai), on the lead's model, the task's connection, as they name none.
team = SubagentToolset(
    [
        Subagent(
            "researcher",
            instructions="Find facts by running commands in your sandbox. Report only what you saw.",
            toolsets=[SandboxToolset(command_timeout=60)],
            description="runs shell commands to find facts",
        ),
        Subagent(
            "writer",
            instructions="Turn notes into a five-line report for engineers.",
            description="writes the final report from notes",
        ),
    ]
)

with DAG(
    dag_id="example_cancellable_subagents",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["cancellable-agents", "example"],
):
    AgentOperator(
        task_id="disk_usage_report",
        prompt="Which directories under /tmp use the most space? Have it checked, then written up.",
        system_prompt="You lead a small team. Delegate the checking and the writing; do neither yourself.",
        toolsets=[team],
        execution_timeout=timedelta(minutes=15),
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
    )
