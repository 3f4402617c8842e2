"""Child process for the common.ai kill tests: common.ai's own operators under ``dag.test()``.

``IMPL=shipped`` runs ``airflow.providers.common.ai``'s ``AgentOperator``/``LLMOperator`` as
released; ``IMPL=ours`` the same classes through :mod:`cancellable_agents.common_ai`. Everything
else (DAG, connection, model server, tools) is identical, so the two can be compared side by
side. Events go to ``SCENARIO_EVENTS_FD`` as JSON lines, as in ``task_scenarios.py``. Scenario in
``SCENARIO``; a per-run marker for process names in ``MARKER``; the common.ai connection
``local_model`` (and ``local_model_b`` for the fallback) points at the parent's model server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

from airflow.sdk import DAG, chain
from pydantic_ai.capabilities import ProcessEventStream
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents.airflow.task_try import cancellation_of

IMPL = os.environ.get("IMPL", "ours")
#: One task per scenario, run one after the other in one ``dag.test()`` (one process start).
SCENARIOS = os.environ.get("SCENARIO", "stream").split(",")
#: A number no other process uses; ``sleep MARKER<i>`` names the processes scenario ``i`` starts.
MARKER = os.environ.get("MARKER", "4242.4242")
if IMPL == "ours":
    from cancellable_agents.common_ai import AgentOperator as _Agent
    from cancellable_agents.common_ai import LLMOperator as _LLM
else:
    from airflow.providers.common.ai.operators.agent import AgentOperator as _Agent
    from airflow.providers.common.ai.operators.llm import LLMOperator as _LLM

_FD = int(os.environ["SCENARIO_EVENTS_FD"])
CONN = "local_model"
#: Set by ``on_kill`` (both implementations), per task: hooks that wait "until killed" wait on it.
KILLED: dict[str, threading.Event] = {name: threading.Event() for name in SCENARIOS}


def emit(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, "t": time.monotonic(), **data}, default=str) + "\n"
    os.write(_FD, line.encode())


def _try_number(context: Any) -> int:
    return int(getattr(context["ti"], "try_number", 1) or 1)


#: Scenario -> the thread its tool is running on now (dict set/pop are atomic); the failure
#: callback waits for the entry to go.
RUNNING_TOOLS: dict[str, threading.Thread] = {}


def _tools_left_running(scenario: str, grace: float = 1.0) -> list[str]:
    """This scenario's tool, if still running ``grace`` s after the task failed (polled: foreign code)."""
    deadline = time.monotonic() + grace
    while scenario in RUNNING_TOOLS and time.monotonic() < deadline:
        time.sleep(0.02)
    thread = RUNNING_TOOLS.get(scenario)
    return [] if thread is None else [f"{thread.name} (daemon={thread.daemon})"]


def on_failure(context: Any) -> None:
    raised = time.monotonic()
    exc = context.get("exception")
    task = context["task"]
    scope = cancellation_of(task)
    emit(
        "task_failed",
        scenario=task.task_id,
        saved_usage=_saved_usage(context),
        exc_type=type(exc).__name__,
        exc_mro=[c.__name__ for c in type(exc).__mro__],
        message=str(exc)[:500],
        cause=getattr(getattr(exc, "cause", None), "value", None),
        usage_requests=getattr(getattr(exc, "usage", None), "requests", None),
        record=scope.summary() if scope is not None else None,
        try_number=_try_number(context),
        raised_t=raised,
        tools_running=_tools_left_running(task.task_id),
    )


def on_retry(context: Any) -> None:
    on_failure(context)


def on_success(context: Any) -> None:
    emit("task_succeeded", scenario=context["task"].task_id, try_number=_try_number(context))


def _saved_usage(context: Any) -> Any:
    """What common.ai's usage budget persisted for this task instance (3.3+, with usage_limits)."""
    if context["task"].usage_limits is None:
        return None
    record = context["task_state_store"].get("__commonai_usage__")
    return record.get("usage") if isinstance(record, dict) else record


def _wait_until_killed(scenario: str, timeout: float = 20.0) -> None:
    # Short sleeps on the main thread: the SIGTERM handler runs between them.
    deadline = time.monotonic() + timeout
    while not KILLED[scenario].is_set() and time.monotonic() < deadline:
        time.sleep(0.01)


class _Probe:
    """Reports when the Task SDK's handler reached ``on_kill``; nothing else changes."""

    def on_kill(self) -> None:
        emit("on_kill", scenario=self.task_id)  # type: ignore[attr-defined]
        KILLED[self.task_id].set()  # type: ignore[attr-defined]
        super().on_kill()  # type: ignore[misc]


class AgentOperator(_Probe, _Agent):  # type: ignore[misc,valid-type]
    def _complete_run(self, context: Any, result: Any, **kwargs: Any) -> Any:
        emit("result_arrived", scenario=self.task_id, output=str(result.output)[:100])
        if self.task_id == "after_result":
            _wait_until_killed(self.task_id)
        return super()._complete_run(context, result, **kwargs)

    def _poll_loop(self, *, ti: Any, **kwargs: Any) -> Any:
        return super()._poll_loop(ti=_ReportPolls(ti, self.task_id), **kwargs)


class _ReportPolls:
    """The task instance, reporting each finished HITL poll (the review wait is then in its sleep)."""

    def __init__(self, ti: Any, scenario: str) -> None:
        self._ti = ti
        self._scenario = scenario

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ti, name)

    def xcom_pull(self, *args: Any, **kwargs: Any) -> Any:
        value = self._ti.xcom_pull(*args, **kwargs)
        emit("hitl_polled", scenario=self._scenario)
        return value


class LLMOperator(_Probe, _LLM):  # type: ignore[misc,valid-type]
    pass


# -- tools --------------------------------------------------------------------------------


def slow_sync_tool() -> str:
    """A sync tool that knows nothing about cancellation: 30 s of work."""
    emit("tool_started", scenario="sync_tool", thread=threading.current_thread().name)
    RUNNING_TOOLS["sync_tool"] = threading.current_thread()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        RUNNING_TOOLS.pop("sync_tool", None)
    emit("tool_finished", tool="slow_sync_tool")
    return "done"


def run_script() -> str:
    """A sync tool running a shell whose child leaves the process group (``setsid``)."""
    emit("tool_started", scenario="subprocess")
    marker = _marker("subprocess")
    script = f"setsid sleep {marker} & sleep {marker}; wait"
    RUNNING_TOOLS["subprocess"] = threading.current_thread()
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, check=False)
    finally:
        RUNNING_TOOLS.pop("subprocess", None)
    emit("tool_finished", tool="run_script", returncode=proc.returncode)
    return f"exit {proc.returncode}"


def fetch_orders() -> str:
    """A completed step: the durable retry must replay it, not run it again."""
    emit("tool_ran", tool="fetch_orders")
    time.sleep(0.3)  # still on its thread when summarize_orders starts: the kill must wait for its record
    return "42 orders"


async def summarize_orders() -> str:
    """In flight when try 1 is killed (announced once ``fetch_orders``' result is journaled); finishes
    at once on the retry."""
    if not os.environ.get("SUMMARIZE_RETRIED"):
        os.environ["SUMMARIZE_RETRIED"] = "1"  # the retry runs in this same process (dag.test)
        await _until_tool_steps_recorded(1)
        emit("tool_started", scenario="durable", tool="summarize_orders")
        await asyncio.sleep(300)
    emit("tool_started", scenario="durable", tool="summarize_orders")
    emit("tool_ran", tool="summarize_orders")
    return "summary"


async def _until_tool_steps_recorded(count: int, timeout: float = 30.0) -> None:
    """Until common.ai's journal holds ``count`` tool results of this run (or ``timeout`` passed).

    ``fetch_orders`` runs on a thread beside this tool; its result is journaled only when the
    event loop takes it back. A kill before that makes it an in-flight step (run again on the
    retry, by design), so the test's "completed tool call" is only completed once recorded.
    """
    from airflow.providers.common.ai.durable.capability import _ACTIVE_RUN  # no public view of it

    active = _ACTIVE_RUN.get()
    assert active is not None, "not inside a durable run"
    deadline = time.monotonic() + timeout
    while active.durable_run.journal.stats.recorded["tool"] < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # polled: common.ai's journal has no event to await


def _marker(scenario: str) -> str:
    return f"{MARKER}{SCENARIOS.index(scenario)}"


def _toolset(*functions: Any) -> FunctionToolset[Any]:
    return FunctionToolset(list(functions), id="scenario_tools")


async def _stream_events(ctx: Any, events: Any) -> None:
    """Makes the run stream its model requests (pydantic-ai streams when this capability is set)."""
    async for _ in events:
        pass


def _model(behaviour: str) -> str:
    return f"openai-chat:{behaviour}"


_STREAM = "slow?tokens=600&delay=0.05"


def build_task(scenario: str) -> Any:
    common: dict[str, Any] = {
        "task_id": scenario,
        "trigger_rule": "all_done",
        "llm_conn_id": CONN,
        "on_failure_callback": on_failure,
        "on_success_callback": on_success,
        "on_retry_callback": on_retry,
        "prompt": f"scenario {scenario}",  # tells the parent which scenario a request is from
    }
    if scenario == "before_run":
        return AgentOperator(model_id=_model("echo"), pre_execute=_before_run, **common)
    if scenario == "stream":
        return AgentOperator(
            model_id=_model(_STREAM), capabilities=[ProcessEventStream(_stream_events)], **common
        )
    if scenario == "llm_nonstream":
        return LLMOperator(model_id=_model("slow?tokens=3&delay=30"), **common)
    if scenario == "sync_tool":
        return AgentOperator(
            model_id=_model("tool?name=slow_sync_tool"), toolsets=[_toolset(slow_sync_tool)], **common
        )
    if scenario == "subprocess":
        return AgentOperator(
            model_id=_model("tool?name=run_script"), toolsets=[_toolset(run_script)], **common
        )
    if scenario == "after_result":
        return AgentOperator(model_id=_model("echo"), **common)
    if scenario == "hitl_wait":
        return AgentOperator(
            model_id=_model("echo"), enable_hitl_review=True, hitl_poll_interval=10, **common
        )
    if scenario == "durable":
        return AgentOperator(
            model_id=_model("tools?names=fetch_orders,summarize_orders&then=final"),
            toolsets=[_toolset(fetch_orders, summarize_orders)],
            durable=True,
            retries=1,
            retry_delay=timedelta(0),
            **common,
        )
    if scenario == "fallback":
        from airflow.providers.common.ai.policies.retry import LLMRetryPolicy

        return AgentOperator(
            model_id=_model(_STREAM),
            fallback_conn_ids=["local_model_b"],
            capabilities=[ProcessEventStream(_stream_events)],
            usage_limits={"request_limit": 10},
            retry_policy=LLMRetryPolicy(llm_conn_id=CONN, model_id=_model("echo"), timeout=10),
            **common,
        )
    if scenario == "sandbox":
        from airflow.providers.common.ai.toolsets.sandbox import SandboxToolset
        from tests.process.dags_common_ai._local_sandbox_backend import LocalProcessSandboxBackend

        marker = _marker(scenario)
        args = quote(json.dumps({"command": f"sleep {marker} & sleep {marker}; wait"}), safe="")
        return AgentOperator(
            model_id=_model(f"tool?name=run_command&args={args}"),
            toolsets=[SandboxToolset(LocalProcessSandboxBackend(emit), spec=None)],
            **common,
        )
    raise SystemExit(f"unknown scenario {scenario!r}")


def _before_run(context: Any) -> None:
    emit("pre_execute", scenario=context["task"].task_id)
    _wait_until_killed(context["task"].task_id)


with DAG(
    "common_ai_" + "__".join(SCENARIOS), schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)
) as dag:
    chain(*(build_task(name) for name in SCENARIOS))


if __name__ == "__main__":
    from tests.dag_test_compat import exit_as_the_task_sdk_does, prepare_dag_test

    emit("starting", pid=os.getpid())
    prepare_dag_test()
    dag.test()
    emit("exited")
    exit_as_the_task_sdk_does()
