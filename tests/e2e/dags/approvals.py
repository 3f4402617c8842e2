"""DAG for the approval e2e tests: an agent whose tool requires approval, ``durable=True``.

The local model server's ``steps`` behaviour asks for ``send_line(n)`` for n = 1, 2, one per
response, then answers: 3 model requests for a run approved twice. Each call that runs appends a
JSON line (``n``, try, whether it is a re-run) to ``<dag_id>.<run_id>.lines`` in ``E2E_STATE_DIR``.
``max_active_tasks=1``: ``other`` can run only in a slot the waiting agent does not hold.
``e2e_approval_timeout``: one such call, and nobody answers: after ``approval_timeout`` Airflow
answers the default (Reject) and the model is told so.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.sdk import DAG, get_current_context, task
from pydantic_ai import RunContext, Tool

from cancellable_agents import AgentOperator
from cancellable_agents.durable import current_resume

STATE_DIR = Path(os.environ.get("E2E_STATE_DIR", "/tmp/cancellable-agents-e2e"))


def send_line(ctx: RunContext[None], n: int) -> str:
    """Append line ``n`` to this run's file (the side effect that needs a person's consent)."""
    ti = get_current_context()["ti"]
    resume = current_resume()
    line = {"n": n, "try": ti.try_number, "rerun": bool(resume and resume.is_rerun(ctx.tool_call_id))}
    with (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.lines").open("a") as out:
        out.write(json.dumps(line) + "\n")
    return f"line {n} sent"


with DAG(
    "e2e_approval",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    is_paused_upon_creation=False,
    max_active_tasks=1,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=2)},
    doc_md="An agent whose tool requires approval: the task waits without a worker slot.",
    tags=["e2e"],
):
    AgentOperator(
        task_id="agent",
        prompt="[{{ dag.dag_id }}/{{ run_id }}] send two lines",
        model="openai:steps?name=send_line&count=2&then=both+lines+sent",
        llm_conn_id="local_model",
        tools=[Tool(send_line, requires_approval=True)],
        durable=True,
        priority_weight=100,
    )

    @task(priority_weight=1)
    def other() -> float:
        """Runs only once a slot is free; says when."""
        ti = get_current_context()["ti"]
        (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.other").write_text(str(time.time()))
        return time.time()

    other()


with DAG(
    "e2e_approval_timeout",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    is_paused_upon_creation=False,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=2)},
    doc_md="An approval nobody answers: rejected by default after approval_timeout.",
    tags=["e2e"],
):
    AgentOperator(
        task_id="agent",
        prompt="[{{ dag.dag_id }}/{{ run_id }}] send one line",
        model="openai:steps?name=send_line&count=1&then=gave+up",
        llm_conn_id="local_model",
        tools=[Tool(send_line, requires_approval=True)],
        durable=True,
        approval_timeout=timedelta(seconds=1),
        approval_timeout_default="reject",
    )
