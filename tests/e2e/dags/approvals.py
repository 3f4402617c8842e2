"""DAG for the approval e2e tests: an agent whose tool requires approval, ``durable=True``.

The local model server's ``steps`` behaviour asks for ``send_line(n)`` for n = 1, 2, one per
response, then answers: 3 model requests for a run approved twice. Each call that runs appends a
JSON line (``n``, try, whether it is a re-run) to ``<dag_id>.<run_id>.lines`` in ``E2E_STATE_DIR``.
``max_active_tasks=1``: ``other`` can run only in a slot the waiting agent does not hold.
``e2e_approval_timeout``: one such call, and nobody answers: after ``approval_timeout`` Airflow
answers the default (Reject) and the model is told so.
``e2e_approval_hold`` and ``e2e_approval_exec_timeout``: one such call, ``hold_line``, which on
try 1 says it started (``<dag_id>.<run_id>.held.json``: the task's pid and its supervisor's) and
waits, cooperatively, until the task is killed; the test kills it there (mark failed, eviction,
or ``execution_timeout``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, get_current_context, task
from pydantic_ai import RunContext, Tool

from cancellable_agents import AgentOperator, current_cancellation
from cancellable_agents.durable import current_resume

STATE_DIR = Path(os.environ.get("E2E_STATE_DIR", "/tmp/cancellable-agents-e2e"))
#: ``e2e_approval_exec_timeout``'s ``execution_timeout``: the test waits longer than this for the answer.
#: The resumed execution must reach the approved call inside it (less the 2 s margin): a task
#: process's start, DAG parse and imports took over 8 s on a loaded CI machine.
EXECUTION_TIMEOUT_S = 18


def send_line(ctx: RunContext[None], n: int) -> str:
    """Append line ``n`` to this run's file (the side effect that needs a person's consent)."""
    ti = get_current_context()["ti"]
    resume = current_resume()
    line = {"n": n, "try": ti.try_number, "rerun": bool(resume and resume.is_rerun(ctx.tool_call_id))}
    with (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.lines").open("a") as out:
        out.write(json.dumps(line) + "\n")
    return f"line {n} sent"


def hold_line(ctx: RunContext[None], n: int) -> str:
    """``send_line``, then on try 1 hold until the task is killed (an approved call in flight)."""
    sent = send_line(ctx, n)
    ti = get_current_context()["ti"]
    if ti.try_number == 1:
        base = f"{ti.dag_id}.{ti.run_id}"
        info = json.dumps({"pid": os.getpid(), "ppid": os.getppid()})
        (STATE_DIR / f"{base}.held.tmp").write_text(info)
        (STATE_DIR / f"{base}.held.tmp").replace(STATE_DIR / f"{base}.held.json")
        scope = current_cancellation()
        if scope is not None:
            scope.wait(120)  # until the kill lands
    return sent


def _dag(dag_id: str, doc: str, **kwargs: Any) -> DAG:
    return DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        is_paused_upon_creation=False,
        default_args={"retries": 1, "retry_delay": timedelta(seconds=2)},
        doc_md=doc,
        tags=["e2e"],
        **kwargs,
    )


def _agent(tool: Any, count: int, then: str, reason: str = "", **kwargs: Any) -> AgentOperator:
    """The agent asks for ``tool`` ``count`` times, one call per response (saying ``reason``)."""
    model = f"openai:steps?name={tool.__name__}&count={count}&then={then}"
    return AgentOperator(
        task_id="agent",
        prompt="[{{ dag.dag_id }}/{{ run_id }}] send the lines",
        model=f"{model}&reason={reason}" if reason else model,
        llm_conn_id="local_model",
        tools=[Tool(tool, requires_approval=True)],
        durable=True,
        **kwargs,
    )


with _dag(
    "e2e_approval",
    "An agent whose tool requires approval: the task waits without a worker slot.",
    max_active_tasks=1,
):
    _agent(send_line, 2, "both+lines+sent", reason="The+customer+asked+for+it.", priority_weight=100)

    @task(priority_weight=1)
    def other() -> float:
        """Runs only once a slot is free; says when."""
        ti = get_current_context()["ti"]
        (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.other").write_text(str(time.time()))
        return time.time()

    other()

with _dag("e2e_approval_timeout", "An approval nobody answers: rejected by default after approval_timeout."):
    _agent(send_line, 1, "gave+up", approval_timeout=timedelta(seconds=1), approval_timeout_default="reject")

with _dag("e2e_approval_hold", "An approved call that holds until the task is killed."):
    _agent(hold_line, 1, "line+sent")

with _dag(
    "e2e_approval_exec_timeout",
    "execution_timeout: the wait for the answer does not count; the resumed execution's does.",
):
    _agent(hold_line, 1, "line+sent", execution_timeout=timedelta(seconds=EXECUTION_TIMEOUT_S))
