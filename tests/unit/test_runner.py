"""Running a pydantic-ai agent under a scope, without Airflow (FunctionModel, real threads)."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.run._tracker import (
    RunTracker,
    ToolThreadExecutor,
    current_run_tracker,
    report_stragglers,
)
from cancellable_agents.run.runner import run_agent_in_scope
from tests.unit.scopes import cancel_when


class CallOnce:
    """A FunctionModel script: call the first tool once, then answer; counts model requests."""

    def __init__(self) -> None:
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests == 1 and info.function_tools:
            return ModelResponse(parts=[ToolCallPart(info.function_tools[0].name, {})])
        return ModelResponse(parts=[TextPart("done")])


def test_completed_run_returns_the_result() -> None:
    scope = TaskCancellation()
    result = run_agent_in_scope(scope, Agent(FunctionModel(CallOnce())), "hi")
    assert result.output == "done"
    assert not scope.cancelled


def test_kill_before_the_run_makes_no_model_request() -> None:
    script = CallOnce()
    scope = TaskCancellation()
    scope.cancel(CancelCause.USER)
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, Agent(FunctionModel(script)), "hi")
    assert script.requests == 0
    assert info.value.cause is CancelCause.USER
    assert "no model request" in str(info.value)


class RecordingToolset(FunctionToolset[Any]):
    """A toolset whose teardown appends to ``order``."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    async def __aexit__(self, *args: Any) -> bool | None:
        self.order.append("toolset teardown")
        return await super().__aexit__(*args)


def test_async_tool_is_cancelled_before_toolset_teardown() -> None:
    order: list[str] = []
    started = threading.Event()
    toolset = RecordingToolset(order)

    @toolset.tool_plain
    async def wait_forever() -> str:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # cleanup that takes a moment must still finish first
            order.append("tool cancelled")
            raise
        return "never"

    scope = TaskCancellation()
    cancel_when(started, scope)
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, Agent(FunctionModel(CallOnce()), toolsets=[toolset]), "go")
    assert order == ["tool cancelled", "toolset teardown"]
    assert info.value.messages, "the partial transcript is kept"


def test_non_streaming_model_request_is_stopped_before_toolset_teardown() -> None:
    order: list[str] = []
    started = threading.Event()

    async def slow_request(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # closing the request takes a moment and must still finish first
            order.append("request stopped")
            raise
        return ModelResponse(parts=[TextPart("never")])

    agent = Agent(FunctionModel(slow_request), toolsets=[RecordingToolset(order)])
    scope = TaskCancellation()
    cancel_when(started, scope)
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, agent, "go")
    assert order == ["request stopped", "toolset teardown"]


class SeesToolCalls(AbstractCapability[Any]):
    """A user capability passed in the run's ``capabilities=``: records the tools it sees."""

    def __init__(self) -> None:
        self.tools: list[str] = []

    async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any) -> Any:
        self.tools.append(tool_def.name)
        return await handler(args)


def test_tools_see_their_run_and_name_and_run_capabilities_still_apply() -> None:
    seen: dict[str, Any] = {}
    agent = Agent(FunctionModel(CallOnce()))

    @agent.tool_plain
    def sync_probe() -> str:
        seen["thread"] = threading.current_thread().name
        seen["tracker"] = current_run_tracker()
        seen["scope"] = current_cancellation()
        return "ok"

    user_capability = SeesToolCalls()
    scope = TaskCancellation()
    result = run_agent_in_scope(scope, agent, "go", capabilities=[user_capability])
    assert result.output == "done"
    assert seen["thread"] == "tool-sync_probe", "sync tools run on a tracked thread named after the tool"
    assert seen["tracker"] is not None and seen["tracker"].scope is scope
    assert seen["scope"] is scope
    assert current_run_tracker() is None, "outside a tool there is no run tracker"
    assert user_capability.tools == ["sync_probe"]


def test_cooperative_sync_tool_sees_the_scope_and_stops() -> None:
    started = threading.Event()
    agent = Agent(FunctionModel(CallOnce()))
    noticed: list[bool] = []

    @agent.tool_plain
    def wait_for_cancel() -> str:
        scope = current_cancellation()
        assert scope is not None
        started.set()
        noticed.append(scope.wait(10))
        scope.raise_if_cancelled()
        return "unreachable"

    scope = TaskCancellation()
    cancel_when(started, scope)
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, agent, "go")
    assert noticed == [True], "the tool's wait ended on the cancel, not on its own 10 s"
    assert scope.stragglers == []


TOOL_WAIT = 5.0


def test_a_signal_caught_on_a_tool_thread_still_reaches_the_idle_run() -> None:
    """CPython runs a signal handler only when the main thread executes bytecode. A SIGTERM the
    kernel hands to a sync tool's thread must not wait for the idle event loop to wake by chance
    (here nothing else would wake it, and the kill would be lost until SIGKILL)."""
    agent = Agent(FunctionModel(CallOnce()))
    scope = TaskCancellation()
    handled = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:  # what the Task SDK's handler does: on_kill
        handled.set()
        scope.cancel(CancelCause.EVICTION)

    noticed: list[bool] = []

    @agent.tool_plain
    def wait_for_cancel() -> str:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # delivered to this thread
        noticed.append(current_cancellation().wait(TOOL_WAIT))  # type: ignore[union-attr]
        return "the kill never arrived"

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(TaskCancelled):
            run_agent_in_scope(scope, agent, "go")
        assert handled.is_set()
        assert noticed == [True], "the kill reached the run only after the tool gave up waiting"
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_uncooperative_sync_tool_is_named_and_left_behind(caplog: pytest.LogCaptureFixture) -> None:
    started = threading.Event()
    release = threading.Event()
    agent = Agent(FunctionModel(CallOnce()))
    tool_thread: list[threading.Thread] = []

    @agent.tool_plain
    def stubborn() -> str:
        tool_thread.append(threading.current_thread())
        started.set()
        release.wait(20)
        return "late"

    scope = TaskCancellation(budget=4.0)
    cancel_when(started, scope)
    with caplog.at_level("WARNING"), pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, agent, "go")
    assert not release.is_set() and tool_thread[0].is_alive(), "the run waited for the stubborn tool"
    assert scope.stragglers == ["sync tool 'stubborn'"]
    assert "stubborn" in caplog.text and "left behind" in caplog.text
    release.set()
    tool_thread[0].join(2)
    assert not tool_thread[0].is_alive(), "a straggler's thread ends once its call returns"


class CallTimes:
    """A FunctionModel script: call the first tool ``times`` times, one call per step, then answer."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests <= self.times:
            return ModelResponse(parts=[ToolCallPart(info.function_tools[0].name, {})])
        return ModelResponse(parts=[TextPart("done")])


def test_sync_tool_threads_are_reused_within_a_run_and_gone_after_it() -> None:
    threads: list[threading.Thread] = []
    agent = Agent(FunctionModel(CallTimes(3)))

    @agent.tool_plain
    def where() -> str:
        threads.append(threading.current_thread())
        return threading.current_thread().name

    assert run_agent_in_scope(TaskCancellation(), agent, "go").output == "done"
    assert len(threads) == 3
    assert len(set(threads)) == 1, "one thread serves the run's sequential sync calls"
    assert threads[0].daemon, "a tool thread can never keep the task process alive"
    assert not threads[0].is_alive(), "the run's tool threads end with the run"


def test_a_cancelled_runs_tool_threads_are_stopped_at_its_end_and_joined_after_it_unwound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scope = TaskCancellation()
    tracker = RunTracker(scope)
    executor = ToolThreadExecutor(tracker)
    assert executor.submit(lambda: "done").result(5) == "done"
    joined: list[str] = []
    join = threading.Thread.join

    def recorded_join(thread: threading.Thread, timeout: float | None = None) -> None:
        joined.append(thread.name)
        join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", recorded_join)
    scope.cancel(CancelCause.EVICTION)
    executor.close()
    assert [n for n in joined if n.startswith("tool-")] == [], "the unwind waits for no thread"
    report_stragglers(scope, tracker)
    assert [n for n in joined if n.startswith("tool-")] == ["tool-sync tool"]
    assert tracker.live_threads() == [] and scope.stragglers == []


def test_result_that_arrives_after_the_cancel_is_discarded() -> None:
    scope = TaskCancellation()

    def answer_then_get_killed(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        scope.cancel(CancelCause.EVICTION)
        scope.wait_released(2)
        return ModelResponse(parts=[TextPart("too late")])

    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, Agent(FunctionModel(answer_then_get_killed)), "hi")
    assert info.value.cause is CancelCause.EVICTION


def test_run_deadline_ends_as_timeout_and_releases_resources() -> None:
    released = threading.Event()
    agent = Agent(FunctionModel(CallOnce()))

    @agent.tool_plain
    async def slow() -> str:
        current_cancellation().register(released.set, name="sandbox")  # type: ignore[union-attr]
        await asyncio.sleep(30)
        return "never"

    scope = TaskCancellation()
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, agent, "go", timeout=0.3)
    assert info.value.cause is CancelCause.TIMEOUT
    assert released.wait(2)


def test_ordinary_errors_propagate_unchanged() -> None:
    agent = Agent(FunctionModel(CallOnce()))

    @agent.tool_plain
    def broken() -> str:
        raise KeyError("missing")

    with pytest.raises(KeyError):
        run_agent_in_scope(TaskCancellation(), agent, "go")


def test_cancelled_error_carries_usage_and_timeline() -> None:
    started = threading.Event()
    agent = Agent(FunctionModel(CallOnce()))

    @agent.tool_plain
    async def wait_forever() -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    scope = TaskCancellation()
    cancel_when(started, scope)
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, agent, "go")
    assert info.value.usage is not None and info.value.usage.requests == 1
    events = [e.event for e in info.value.timeline]
    assert events.index("kill_received") < events.index("token_cancelled") < events.index("run_unwound")


class TornDown(FunctionToolset[Any]):
    """A toolset that says when it is torn down."""

    def __init__(self) -> None:
        super().__init__()
        self.torn_down = threading.Event()

    async def __aexit__(self, *args: Any) -> bool | None:
        self.torn_down.set()
        return await super().__aexit__(*args)


def test_the_token_cancel_is_in_the_timeline_before_what_the_run_did_about_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run reacts to its token on its own loop at once; the unwind thread that cancelled the
    token may get the CPU back only after the run tore its toolsets down (seen under load on the
    3.1 floor). The timeline must still show the cause first."""
    toolset = TornDown()
    started = threading.Event()

    @toolset.tool_plain
    async def wait_forever() -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    cancel = type(TaskCancellation().token).cancel

    def cancel_then_lose_the_cpu(token: Any) -> None:
        cancel(token)
        assert toolset.torn_down.wait(5)  # the unwind thread runs again only once the run reacted

    monkeypatch.setattr(type(TaskCancellation().token), "cancel", cancel_then_lose_the_cpu)
    scope = TaskCancellation()
    cancel_when(started, scope)
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, Agent(FunctionModel(CallOnce()), toolsets=[toolset]), "go")
    assert scope.wait_released(5)
    events = [e.event for e in scope.timeline]
    assert events.index("token_cancelled") < events.index("toolset_teardown"), events
