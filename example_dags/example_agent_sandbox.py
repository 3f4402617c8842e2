"""An agent with a sandbox: shell and Python commands that really stop when the task is killed.

``SandboxToolset`` gives the agent ``run_shell``, ``run_python``, ``read_file``, ``write_file``
and ``list_files`` in a temporary working directory. Every command is a process tree: a kill,
a clear, an eviction or a timeout terminates the whole tree (SIGTERM, then SIGKILL) inside
Airflow's grace window and records each killed pid in the task log. It is containment for
cleanup, not a security boundary: see docs/content/sandbox.md.

Runs with no API key (the keyless ``test`` model calls every tool once with dummy arguments);
set ``CANCELLABLE_AGENTS_CONN`` to a connection id for a real model.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, task
from pydantic_ai.usage import UsageLimits

from cancellable_agents import AgentOperator, SandboxToolset, WindDown

LLM_CONN_ID = os.environ.get("CANCELLABLE_AGENTS_CONN")
MODEL = None if LLM_CONN_ID else "test"

with DAG(
    dag_id="example_cancellable_agent_sandbox",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["cancellable-agents", "example"],
):
    # The classic operator. The sandbox is created on first use, attached to this task's
    # cancellation scope, and destroyed (working directory included) when the run ends.
    profile = AgentOperator(
        task_id="profile_python",
        prompt="Write a Python script that prints the 20 first primes, run it, and report its output.",
        system_prompt="You are a careful engineer. Use the sandbox tools; never guess an output.",
        toolsets=[SandboxToolset(command_timeout=60)],  # no single command runs longer than 60 s
        usage_limits=UsageLimits(request_limit=15),  # at most 15 model requests per run
        execution_timeout=timedelta(minutes=10),  # the run gets its own deadline 2 s earlier
        # 60 s before that deadline, or at the 15th request, the model is offered no more tools and
        # answers with what it has: the task succeeds with that answer instead of being killed.
        wind_down=WindDown(60, budget=True),
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
    )

    # The TaskFlow way: the function returns the prompt; the toolsets are decorator arguments.
    @task.agent(llm_conn_id=LLM_CONN_ID, model=MODEL, toolsets=[SandboxToolset(command_timeout=30)])
    def disk_report(path: str) -> str:
        return f"Use `du -sh` and `ls` to tell which folders take the most space under {path}."

    profile >> disk_report("/tmp")
