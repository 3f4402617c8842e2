"""Child process for the real-signal tests: runs one scenario (env ``SCENARIO``) via ``dag.test()``.

``dag.test()`` executes the task with the Task SDK's own ``run()``, which installs the real
SIGTERM handler (``_on_term`` -> ``task.on_kill()``) and the real ``execution_timeout`` SIGALRM
path, so the parent kills this process exactly as Airflow's supervisor would.

Events go to the file descriptor in ``SCENARIO_EVENTS_FD`` as JSON lines (the parent awaits
them instead of sleeping). This folder is the child's DAGs folder: ``dag.test()`` needs the DAG
to be parseable from there. Usage: ``SCENARIO=stream python task_scenarios.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import DAG
from airflow.sdk.bases.operator import BaseOperator

from cancellable_agents import AgentOperator, CancellableAgentMixin, LLMOperator, current_cancellation
from cancellable_agents.cancellation import Phase

_FD = int(os.environ["SCENARIO_EVENTS_FD"])
CONN = "local_model"


def emit(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, "t": time.monotonic(), **data}, default=str) + "\n"
    os.write(_FD, line.encode())


def on_failure(context: Any) -> None:
    exc = context.get("exception")
    emit(
        "task_failed",
        exc_type=type(exc).__name__,
        message=str(exc),
        cause=getattr(getattr(exc, "cause", None), "value", None),
        record=context["task"].cancellation.summary(),
    )


def on_success(context: Any) -> None:
    emit("task_succeeded", record=context["task"].cancellation.summary())


def _wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)  # the SIGTERM handler runs between these sleeps, on this thread
    return False


# -- tools --------------------------------------------------------------------------------


async def wait_async() -> str:
    """An async tool that waits for a long time."""
    emit("tool_started", tool="wait_async")
    try:
        await asyncio.sleep(300)
    except asyncio.CancelledError:
        emit("tool_cancelled", tool="wait_async")
        raise
    return "finished"


def wait_cooperatively() -> str:
    """A sync tool that blocks on the task's cancellation scope."""
    emit("tool_started", tool="wait_cooperatively")
    scope = current_cancellation()
    assert scope is not None, "the tool must see the task's scope"
    noticed = scope.wait(300)
    emit("tool_noticed", tool="wait_cooperatively", noticed=noticed)
    return "stopped"


def ignore_cancellation() -> str:
    """A sync tool that ignores cancellation: loops for 30 s."""
    emit("tool_started", tool="ignore_cancellation")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return "done"


# -- operators ----------------------------------------------------------------------------


class BusyOperator(CancellableAgentMixin, BaseOperator):
    """Holds a registered resource and busy-waits, so SIGALRM (not the run) ends it."""

    def execute(self, context: Any) -> None:
        scope = self.cancellation
        scope.register(lambda: emit("resource_released"), name="busy-resource", phase=Phase.IN_FLIGHT)
        emit("busy_started")
        _wait_until(lambda: False, 60)


def _model(behaviour: str) -> str:
    return f"openai:{behaviour}"


def build_task(scenario: str) -> BaseOperator:
    common: dict[str, Any] = {
        "task_id": "agent",
        "llm_conn_id": CONN,
        "on_failure_callback": on_failure,
        "on_success_callback": on_success,
    }
    if scenario in ("stream", "burst"):
        return LLMOperator(
            prompt="write a lot", model=_model("slow?tokens=600&delay=0.05"), stream=True, **common
        )
    if scenario == "nonstream":
        return LLMOperator(prompt="think hard", model=_model("slow?tokens=3&delay=30"), **common)
    if scenario == "async_tool":
        return AgentOperator(prompt="go", model=_model("tool?name=wait_async"), tools=[wait_async], **common)
    if scenario == "sync_coop":
        return AgentOperator(
            prompt="go", model=_model("tool?name=wait_cooperatively"), tools=[wait_cooperatively], **common
        )
    if scenario == "sync_uncoop":
        return AgentOperator(
            prompt="go", model=_model("tool?name=ignore_cancellation"), tools=[ignore_cancellation], **common
        )
    if scenario == "before_run":
        return LLMOperator(prompt="hello", model=_model("echo"), pre_execute=_block_until_killed, **common)
    if scenario == "after_run":
        return LLMOperator(
            prompt="hello", model=_model("echo"), post_execute=_block_until_kill_ignored, **common
        )
    if scenario == "timeout":
        return LLMOperator(
            prompt="write a lot",
            model=_model("slow?tokens=600&delay=0.05"),
            stream=True,
            execution_timeout=timedelta(seconds=4),
            **common,
        )
    if scenario == "timeout_sigalrm":
        return BusyOperator(
            task_id="agent",
            execution_timeout=timedelta(seconds=2),
            on_failure_callback=on_failure,
            on_success_callback=on_success,
        )
    raise SystemExit(f"unknown scenario {scenario!r}")


def _block_until_killed(context: Any) -> None:
    emit("pre_execute")
    _wait_until(lambda: context["task"].cancellation.cancelled, 20)


def _block_until_kill_ignored(context: Any, result: Any = None) -> None:
    emit("post_execute", result=result)
    scope = context["task"].cancellation
    _wait_until(lambda: any(e.event == "cancel_ignored" for e in scope.timeline), 20)


SCENARIO = os.environ.get("SCENARIO", "stream")

with DAG(f"scenario_{SCENARIO}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    build_task(SCENARIO)

if __name__ == "__main__":
    emit("starting", pid=os.getpid())
    dag.test()
    emit("exited")
