"""DAG for the durable e2e tests: an agent with six sequential tool calls, ``durable=True``.

The local model server's ``steps`` behaviour asks for ``append_line(n)`` for n = 1..6, one per
response, then answers: 7 model requests for an uninterrupted run. Each call appends a JSON line
(``n``, try, whether it is a re-run of an in-flight call) to ``<dag_id>.<run_id>.lines`` in
``E2E_STATE_DIR``. On try 1, call 4 then says so in ``<dag_id>.<run_id>.tool4.json`` (the task's
pid and its supervisor's) and waits, cooperatively, until the task is killed: the test kills it
there (SIGTERM to the supervisor, SIGKILL to the task, Clear, or an edited record first).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.sdk import DAG, get_current_context
from pydantic_ai import RunContext

from cancellable_agents import AgentOperator, current_cancellation
from cancellable_agents.durable import current_resume

STATE_DIR = Path(os.environ.get("E2E_STATE_DIR", "/tmp/cancellable-agents-e2e"))
STEPS = 6
BLOCKING_STEP = 4


def append_line(ctx: RunContext[None], n: int) -> str:
    """Append line ``n`` to this run's file."""
    ti = get_current_context()["ti"]
    resume = current_resume()
    line = {"n": n, "try": ti.try_number, "rerun": bool(resume and resume.is_rerun(ctx.tool_call_id))}
    base = f"{ti.dag_id}.{ti.run_id}"
    with (STATE_DIR / f"{base}.lines").open("a") as out:
        out.write(json.dumps(line) + "\n")
    if n == BLOCKING_STEP and ti.try_number == 1:
        info = json.dumps({"pid": os.getpid(), "ppid": os.getppid()})
        (STATE_DIR / f"{base}.tmp").write_text(info)
        (STATE_DIR / f"{base}.tmp").replace(STATE_DIR / f"{base}.tool4.json")
        scope = current_cancellation()
        if scope is not None:
            scope.wait(120)  # until the kill lands (a SIGKILL never returns from here)
    return f"line {n} written"


with DAG(
    "e2e_durable",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    is_paused_upon_creation=False,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=2)},
    doc_md="Six sequential tool calls, durable: a killed try's retry resumes where it stopped.",
    tags=["e2e"],
):
    AgentOperator(
        task_id="agent",
        prompt="[{{ dag.dag_id }}/{{ run_id }}] append six lines",
        model=f"openai:steps?name=append_line&count={STEPS}&then=all+lines+written",
        llm_conn_id="local_model",
        tools=[append_line],
        durable=True,
    )
