"""Kill me: long-running agent tasks for trying Airflow's buttons and watching them stop.

Trigger the DAG and wait until a task is mid-work: its log shows ``watch_the_queue: still
watching``, ``rebuild_the_index: batch`` or the sandbox's first output. Then press *Mark as
failed* on it (cause ``user``: fails at once, no retry), *Clear* (cause ``user``: the next try
starts at once), or stop the worker with SIGTERM (cause ``eviction``: retried). ``times_out``
ends by itself through ``execution_timeout`` (cause ``timeout``). Each killed try's log ends
with a ``cancelled: ...`` line (cause, unwind time, processes killed, retry), the record
(``cancellable_agents.record``, cause first, one timeline event per line) and a short
``TaskCancelled``. See docs/content/kill-paths.md for what happens, step by step.

The keyless ``test`` model calls each task's tool straight away, and the tools take ten
minutes, so there is time to press buttons. Set ``CANCELLABLE_AGENTS_CONN`` for a real model
(the prompts ask it to call the tool; ``long_answer`` then streams for a while too).
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG

from cancellable_agents import AgentOperator, LLMOperator, LocalSandbox, current_cancellation

LLM_CONN_ID = os.environ.get("CANCELLABLE_AGENTS_CONN")
MODEL = None if LLM_CONN_ID else "test"
# Not __name__: Airflow imports DAG files as `unusual_prefix_<sha>_<file>`, unreadable in the log.
log = logging.getLogger("cancellable_agents.examples.kill_me")


async def watch_the_queue() -> str:
    """Watch the work queue until it drains (takes about ten minutes)."""
    for second in range(600):
        if second % 10 == 0:
            log.info("watch_the_queue: still watching after %d s", second)
        await asyncio.sleep(1)  # a kill cancels the run: CancelledError is raised right here
    return "the queue drained"


def rebuild_the_index() -> str:
    """Rebuild the search index batch by batch (takes about ten minutes)."""
    scope = current_cancellation()  # this task's cancellation scope (sync tools run on threads)
    for batch in range(120):
        log.info("rebuild_the_index: batch %d", batch)
        # Wait on the scope instead of time.sleep(5): it wakes the moment the task is killed.
        if scope is not None and scope.wait(5):
            return f"stopped after {batch} batches"
    return "index rebuilt"


async def run_the_nightly_build() -> str:
    """Run the nightly build in a sandbox (takes about ten minutes)."""
    sandbox = LocalSandbox()  # attaches to this task's cancellation scope
    try:
        # A build that leaves a helper running in the background: a kill takes the whole tree.
        result = await sandbox.arun("sleep 600 & for i in $(seq 600); do echo step $i; sleep 1; done")
    finally:
        await asyncio.to_thread(sandbox.destroy)
    return result.stdout[-1000:]


def report_cause(context: Any) -> None:
    """``on_failure_callback``: a cancelled task fails with ``TaskCancelled``, which names the cause."""
    exc = context.get("exception")
    cause = getattr(exc, "cause", None)
    log.warning("stopped: cause=%s (%s)", getattr(cause, "value", cause), getattr(exc, "detail", ""))


def agent(task_id: str, tool: Any, **kwargs: Any) -> AgentOperator:
    return AgentOperator(
        task_id=task_id,
        prompt=f"Call the {tool.__name__} tool once, then report what it returned.",
        tools=[tool],
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
        **kwargs,
    )


with DAG(
    dag_id="example_cancellable_kill_me",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    # One retry, so the retry decision by cause is visible: eviction retries, Mark as failed doesn't.
    default_args={"retries": 1, "retry_delay": timedelta(seconds=10), "on_failure_callback": report_cause},
    tags=["cancellable-agents", "example"],
):
    agent("async_tool", watch_the_queue)
    agent("sync_tool", rebuild_the_index)
    agent("sandbox_command", run_the_nightly_build)
    # The run gets its own deadline 2 s before execution_timeout, so it ends as cause ``timeout``
    # with everything unwound, instead of being torn apart by Airflow's SIGALRM.
    agent("times_out", watch_the_queue, execution_timeout=timedelta(seconds=30))
    LLMOperator(
        task_id="long_answer",
        prompt="Write a detailed, 3000-word history of the printing press.",
        stream=True,  # a kill closes the live HTTP stream: the provider sees the disconnect
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
    )
