"""DAG for the deferred tool call e2e tests: a tool starts an outside job and defers to it.

The job is :mod:`cancellable_agents.testing.jobs` under ``E2E_STATE_DIR/jobs`` (a file: the test
finishes it, the trigger's ``on_kill`` cancels it and stamps ``cancelled_at``); the triggerer polls
it with ``PollTrigger`` every 0.2 s. Each start of a job appends a line (try, job) to
``<dag_id>.<run_id>.starts``: the tool's runs over the whole task. ``max_active_tasks=1``:
``other`` can run only in a slot the deferred agent does not hold.
``e2e_deferred_timeout``: the call's wait times out after 12 s: the job is stopped, the model told.
``e2e_deferred_timeout_fail``: the same with ``on_timeout="fail"``: the job is stopped, the task
ends as ``timeout`` (no retry: ``retries=0``).
``e2e_deferred_evict``: step 1 defers to the job; after it fired, step 2 runs a quick tool (writing
the task's pid and its supervisor's, for the test's eviction) and the model takes 20 s to answer
it: the test evicts the task there, and try 2 resumes from the record.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, get_current_context, task

from cancellable_agents import AgentOperator, PollTrigger, defer_to
from cancellable_agents.testing import jobs

STATE_DIR = Path(os.environ.get("E2E_STATE_DIR", "/tmp/cancellable-agents-e2e"))
JOBS = STATE_DIR / "jobs"


def _start_and_defer(timeout: float | None, on_timeout: str = "tell") -> Any:
    ti = get_current_context()["ti"]
    job = f"{ti.dag_id}.{ti.run_id}.try{ti.try_number}"
    jobs.start(str(JOBS), job)
    with (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.starts").open("a") as out:
        out.write(json.dumps({"try": ti.try_number, "job": job, "at": time.time()}) + "\n")
    defer_to(
        PollTrigger(
            "cancellable_agents.testing.jobs.status",
            {"root": str(JOBS), "job": job},
            interval=0.2,
            cancel="cancellable_agents.testing.jobs.cancel",
        ),
        timeout=timeout,
        on_timeout=on_timeout,
    )


def run_job(n: int) -> Any:
    """Start the outside job and wait for it without a worker slot."""
    return _start_and_defer(None)


def run_short_job(n: int) -> Any:
    """Start the outside job; give up waiting after 12 s (past the ~5 s in which Airflow 3.3.2
    loses a trigger that fires too soon: tests/e2e/test_deferred.py, ``_deferrals_seen``)."""
    return _start_and_defer(12.0)


def run_job_or_fail(n: int) -> Any:
    """Start the outside job; after 12 s of waiting the task ends as timeout."""
    return _start_and_defer(12.0, on_timeout="fail")


def step(n: int) -> Any:
    """Step 1 starts the job and defers; step 2 says which processes run the resumed part; every
    run of a step appends (try, n) to ``<dag_id>.<run_id>.steps``."""
    ti = get_current_context()["ti"]
    with (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.steps").open("a") as out:
        out.write(json.dumps({"try": ti.try_number, "n": n}) + "\n")
    if n == 1:
        return _start_and_defer(None)
    if n == 2:
        pids = {"try": ti.try_number, "pid": os.getpid(), "ppid": os.getppid()}
        (STATE_DIR / f"{ti.dag_id}.{ti.run_id}.resumed.json").write_text(json.dumps(pids))
    return f"step {n} done"


def _dag(dag_id: str, doc: str, retries: int = 1, **kwargs: Any) -> DAG:
    return DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        is_paused_upon_creation=False,
        default_args={"retries": retries, "retry_delay": timedelta(seconds=2)},
        doc_md=doc,
        tags=["e2e"],
        **kwargs,
    )


def _agent(tool: Any, then: str, steps: str = "count=1", **kwargs: Any) -> AgentOperator:
    return AgentOperator(
        task_id="agent",
        prompt="[{{ dag.dag_id }}/{{ run_id }}] run the job",
        model=f"openai:steps?name={tool.__name__}&{steps}&then={then}",
        llm_conn_id="local_model",
        tools=[tool],
        durable=True,
        **kwargs,
    )


with _dag(
    "e2e_deferred", "A tool defers to its outside job: no worker slot while it runs.", max_active_tasks=1
):
    _agent(run_job, "job+done", priority_weight=100)

    @task(priority_weight=1)
    def other() -> float:
        """Runs only once a slot is free."""
        return time.time()

    other()

with _dag("e2e_deferred_timeout", "The wait for the job times out: the job is stopped, the model told."):
    _agent(run_short_job, "gave+up")

with _dag(
    "e2e_deferred_timeout_fail",
    "The wait for the job times out: the job is stopped, the task ends.",
    retries=0,
):
    _agent(run_job_or_fail, "never+asked")

with _dag("e2e_deferred_evict", "Evicted in the part that runs after the job's result came back."):
    # The model answers step 2 after 400 tokens 50 ms apart (20 s), the first time only.
    _agent(step, "all+done", steps="count=3&stall_at=2&tokens=400&delay=0.05")
