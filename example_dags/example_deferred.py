"""A tool that waits for outside work without holding a worker: it starts the job, then defers.

The agent's tool starts a batch job somewhere else and calls ``defer_to`` with a trigger that
polls the job's status. The run stops at that step (kept in its continuity record), the task
defers (no worker slot, no process while the job runs), and when the job is done the task
resumes: the job's result is the tool's result and the model goes on from the record, not asked
again for what it already decided. *Mark failed* or *Clear* while the task waits runs the
trigger's ``cancel`` (Airflow 3.3+). See docs/content/deferred.md.

The "job" here is :mod:`cancellable_agents.testing.jobs`, a stand-in that finishes after a few
seconds; put your platform's start / status / cancel calls in its place (they must be importable
by the triggerer: a module of yours, not this DAG file). Runs with no API key: the keyless
``TestModel`` calls the tool once; ``CANCELLABLE_AGENTS_CONN`` switches to a real model.
Needs Airflow 3.3+ (``durable=True`` keeps the record in the task state store).
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG

from cancellable_agents import AgentOperator, PollTrigger, current_tool_call, defer_to
from cancellable_agents.testing import jobs

LLM_CONN_ID = os.environ.get("CANCELLABLE_AGENTS_CONN")
MODEL = None if LLM_CONN_ID else "test"
JOBS_DIR = os.environ.get("CANCELLABLE_AGENTS_JOBS_DIR", os.path.join(tempfile.gettempdir(), "example_jobs"))


def run_batch_job(table: str) -> Any:
    """Recompute the statistics of ``table`` on the batch cluster; returns its row counts."""
    call = current_tool_call()
    # One job per logical call: a retry that resumes this call derives the same key.
    job = f"stats-{call.idempotency_key if call else table}"
    jobs.start(JOBS_DIR, job, seconds=3, result={"table": table, "rows": 1234})
    defer_to(
        PollTrigger(
            "cancellable_agents.testing.jobs.status",
            {"root": JOBS_DIR, "job": job},
            interval=1.0,
            cancel="cancellable_agents.testing.jobs.cancel",
        ),
        timeout=timedelta(hours=2),
    )


with DAG(
    dag_id="example_cancellable_deferred",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["cancellable-agents", "example"],
):
    AgentOperator(
        task_id="table_stats",
        prompt="Recompute the statistics of the orders table and summarise them.",
        tools=[run_batch_job],
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
        durable=True,  # required: the run continues from its record when the job is done
    )
