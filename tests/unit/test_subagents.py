"""Sub-agent delegation under child scopes, without Airflow (FunctionModel, real threads, real HTTP).

What is pinned: the parent's cancel reaches every child (async and thread-driven) with cause
``PARENT`` and the root cause kept; an interrupt that lands while a child is created is not lost;
a child's cancellation never becomes a tool result or a retry; in-flight work stops before any
teardown and nested teardowns overlap; records carry the child's transcript and usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic_ai import Agent, CancellationToken
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import RunCancelled
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import Outcome, TaskCancellation, current_cancellation
from cancellable_agents.hooks.model import build_model
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from cancellable_agents.toolsets.subagent_tools import run_subagent, run_subagent_sync
from cancellable_agents.toolsets.subagent_toolset import Subagent, SubagentToolset
from tests.unit.scopes import cancel_when

#: Each level's toolset teardown in the depth tests (seconds).
TEARDOWN = 0.3


# -- scripted models and toolsets ---------------------------------------------------------


def _tool_results(messages: list[ModelMessage]) -> list[Any]:
    return [
        part
        for message in messages
        for part in getattr(message, "parts", [])
        if isinstance(part, (ToolReturnPart, RetryPromptPart))
    ]


class Delegating:
    """Call ``delegate(agent=target)`` once, then answer with what came back; counts requests."""

    def __init__(self, target: str, task: str = "dig deeper") -> None:
        self.target = target
        self.task = task
        self.requests = 0
        self.tool_defs: list[Any] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        self.tool_defs = list(info.function_tools)
        results = _tool_results(messages)
        if not results:
            return ModelResponse(parts=[ToolCallPart("delegate", {"agent": self.target, "task": self.task})])
        return ModelResponse(parts=[TextPart(f"parent got: {results[-1].content}")])


class Answer:
    """Answer at once with ``text`` (and the task it was given); counts requests."""

    def __init__(self, text: str = "child answer") -> None:
        self.text = text
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        return ModelResponse(parts=[TextPart(self.text)])


class Blocked:
    """An async model request that never answers; notes when it starts and when it is cancelled."""

    def __init__(self, log: list[tuple[float, str]] | None = None) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.log = log if log is not None else []
        self.calls = 0

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.calls += 1
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.log.append((time.monotonic(), "leaf request cancelled"))
            self.cancelled.set()
            raise
        return ModelResponse(parts=[TextPart("too late")])


class CallTool:
    """Call tool ``name`` once, then answer ``done``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not _tool_results(messages):
            return ModelResponse(parts=[ToolCallPart(self.name, {})])
        return ModelResponse(parts=[TextPart("done")])


class SlowTeardown(FunctionToolset[Any]):
    """A toolset whose teardown takes ``TEARDOWN`` seconds even if cancelled again; logs both ends."""

    def __init__(self, level: str, log: list[tuple[float, str]]) -> None:
        super().__init__()
        self.level = level
        self.log = log

    async def __aexit__(self, *args: Any) -> bool | None:
        self.log.append((time.monotonic(), f"teardown start {self.level}"))
        done = asyncio.ensure_future(asyncio.sleep(TEARDOWN))
        while not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(done)
        self.log.append((time.monotonic(), f"teardown end {self.level}"))
        return await super().__aexit__(*args)


def _chain(depth: int, leaf: Blocked, log: list[tuple[float, str]]) -> Agent[Any, Any]:
    """``depth`` agents delegating one to the next; the last is blocked on its model request."""
    agent: Agent[Any, Any] = Agent(FunctionModel(leaf), toolsets=[SlowTeardown(f"level{depth}", log)])
    for level in range(depth - 1, 0, -1):
        below = f"level{level + 1}"
        agent = Agent(
            FunctionModel(Delegating(below)),
            toolsets=[SubagentToolset({below: agent}), SlowTeardown(f"level{level}", log)],
        )
    return agent


def _levels(scope: TaskCancellation) -> list[TaskCancellation]:
    chain = [scope]
    while chain[-1].children:
        chain.extend(chain[-1].children)
    return chain


def _at(scope: TaskCancellation, event: str) -> float:
    return next(e.at for e in scope.timeline if e.event == event)


@pytest.fixture(scope="module")
def model_server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


# -- delegation that completes ------------------------------------------------------------


def test_delegation_returns_the_answer_and_records_the_child() -> None:
    child_model = Answer("42")
    parent_model = Delegating("math")
    parent = Agent(
        FunctionModel(parent_model), toolsets=[SubagentToolset({"math": Agent(FunctionModel(child_model))})]
    )
    scope = TaskCancellation()

    result = run_agent_in_scope(scope, parent, "what is six times seven?")

    assert result.output == "parent got: 42"
    (child,) = scope.children
    assert child.name == "math" and child.outcome is Outcome.COMPLETED and not child.cancelled
    attached = child.attached
    assert attached["messages"] == 2 and attached["usage"]["requests"] == 1
    assert attached["transcript"][0]["parts"][0]["content"] == "dig deeper"
    assert result.usage.requests == 3, "the child's request counts toward the parent's usage"
    assert scope.summary()["children"][0]["attached"]["messages"] == 2


def test_the_tool_offers_the_sub_agents_by_name_with_descriptions() -> None:
    parent_model = Delegating("reviewer")
    toolset = SubagentToolset(
        [
            Subagent("researcher", Agent(FunctionModel(Answer())), description="finds sources"),
            Subagent("reviewer", Agent(FunctionModel(Answer())), description="checks a draft"),
        ],
        tool_name="delegate",
    )
    run_agent_in_scope(TaskCancellation(), Agent(FunctionModel(parent_model), toolsets=[toolset]), "go")
    (tool,) = parent_model.tool_defs
    assert tool.name == "delegate"
    assert tool.parameters_json_schema["properties"]["agent"]["enum"] == ["researcher", "reviewer"]
    assert "researcher: finds sources" in tool.description and "reviewer: checks a draft" in tool.description


def test_structured_child_output_is_returned_as_json() -> None:
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool

    child = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[ToolCallPart(i.output_tools[0].name, {"ok": True})])),
        output_type=Verdict,
    )
    parent = Agent(FunctionModel(Delegating("judge")), toolsets=[SubagentToolset({"judge": child})])
    assert run_agent_in_scope(TaskCancellation(), parent, "go").output == 'parent got: {"ok": true}'


def test_bad_configurations_are_refused_with_the_fix() -> None:
    agent = Agent(FunctionModel(Answer()))
    with pytest.raises(ValueError, match="at least one sub-agent"):
        SubagentToolset({})
    with pytest.raises(ValueError, match="unique"):
        SubagentToolset([Subagent("a", agent), Subagent("a", agent)])
    with pytest.raises(TypeError, match="Subagent"):
        SubagentToolset([agent])  # type: ignore[list-item]


def test_deepcopy_shares_the_agents_and_the_copy_still_delegates() -> None:
    child = Agent(FunctionModel(Answer("from the copy")))
    toolset = SubagentToolset({"helper": child}, tool_name="ask", threaded=True)
    clone = copy.deepcopy(toolset)
    assert clone is not toolset and clone.subagents["helper"].agent is child
    assert (clone.tool_name, clone.threaded) == ("ask", True)

    class AskOnce(Delegating):
        def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            response = super().__call__(messages, info)
            for part in response.parts:
                if isinstance(part, ToolCallPart):
                    part.tool_name = "ask"
            return response

    parent = Agent(FunctionModel(AskOnce("helper")), toolsets=[clone])
    assert run_agent_in_scope(TaskCancellation(), parent, "go").output == "parent got: from the copy"


def test_agent_operator_with_the_toolset_survives_airflow_deepcopy() -> None:
    from cancellable_agents import AgentOperator

    child = Agent(FunctionModel(Answer()))
    operator = AgentOperator(
        task_id="lead", prompt="go", model="test", toolsets=[SubagentToolset({"helper": child})]
    )
    clone = copy.deepcopy(operator)
    (toolset,) = clone.toolsets
    assert isinstance(toolset, SubagentToolset) and toolset is not operator.toolsets[0]
    assert toolset.subagents["helper"].agent is child


# -- the parent's cancel reaches every child ----------------------------------------------


def test_parent_cancel_reaches_every_level_with_parent_cause_and_root_cause() -> None:
    log: list[tuple[float, str]] = []
    leaf = Blocked(log)
    scope = TaskCancellation("task")
    cancel_when(leaf.started, scope, CancelCause.EVICTION)

    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, _chain(3, leaf, log), "go")

    assert info.value.cause is CancelCause.EVICTION
    assert leaf.cancelled.is_set()
    task, child, grandchild = _levels(scope)
    assert [s.name for s in (child, grandchild)] == ["level2", "level3"]
    for kid in (child, grandchild):
        assert kid.cause is CancelCause.PARENT and kid.root_cause is CancelCause.EVICTION
        assert kid.outcome is Outcome.CANCELLED
        assert kid.attached["messages"] >= 1, "the partial transcript is on the child's record"
        # Children are cancelled before the task's own token: in-flight work goes first.
        assert _at(kid, "kill_received") <= _at(task, "token_cancelled")
    record = scope.summary()
    assert record["children"][0]["children"][0]["root_cause"] == "eviction"
    # The run raises without waiting for the scope's unwind thread (the mixin waits for it before
    # writing the record): wait for it, then every level must be released with it.
    assert scope.wait_released(5)
    assert child.wait_released(0) and grandchild.wait_released(0), "released covers the whole tree"


def test_in_flight_work_stops_before_any_teardown_and_teardowns_overlap() -> None:
    log: list[tuple[float, str]] = []
    leaf = Blocked(log)
    scope = TaskCancellation()
    cancel_when(leaf.started, scope)
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, _chain(3, leaf, log), "go")
    cancelled_at = next(t for t, what in log if what == "leaf request cancelled")
    starts = [t for t, what in log if what.startswith("teardown start")]
    ends = [t for t, what in log if what.startswith("teardown end")]
    assert len(starts) == len(ends) == 3
    assert cancelled_at <= min(starts), "the deepest request is stopped before any toolset tears down"
    assert max(starts) < min(ends), "every level starts tearing down before any level finishes"


def test_unwind_time_does_not_grow_with_depth() -> None:
    timings: dict[int, float] = {}
    for depth in (1, 2, 3):
        log: list[tuple[float, str]] = []
        leaf = Blocked(log)
        scope = TaskCancellation()
        cancel_when(leaf.started, scope)
        with pytest.raises(TaskCancelled):
            run_agent_in_scope(scope, _chain(depth, leaf, log), "go")
        timings[depth] = time.monotonic() - _at(scope, "kill_received")
    print(
        "\n[latency] unit sub-agent unwind: "
        + ", ".join(f"depth {d}: {t * 1000:.0f} ms" for d, t in timings.items())
    )
    # Adding up would cost one more teardown per level; allow less than one for noise.
    assert timings[3] < timings[1] + TEARDOWN, timings
    assert timings[3] < TaskCancellation().budget


def test_streaming_child_request_is_closed_on_the_server(model_server: ScriptedModelServer) -> None:
    model_server.reset()
    streaming = Agent(build_model("openai:slow?tokens=600&delay=0.05", base_url=model_server.base_url))
    parent = Agent(
        FunctionModel(Delegating("writer")),
        toolsets=[SubagentToolset([Subagent("writer", streaming, stream=True)])],
    )
    scope = TaskCancellation()

    def kill_mid_stream() -> None:
        if model_server.wait_for_tokens(5, timeout=20):
            scope.cancel(CancelCause.USER)

    threading.Thread(target=kill_mid_stream, daemon=True).start()
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, parent, "go")
    closed = model_server.wait_for_disconnect(timeout=2)
    assert closed is not None and closed.stream, "the server must see the child's stream closed"
    (child,) = scope.children
    assert child.cause is CancelCause.PARENT
    # The partial answer streamed so far is in the child's transcript.
    transcript = child.attached["transcript"]
    assert any(
        p.get("part_kind") == "text" and "tok0" in p.get("content", "")
        for m in transcript
        for p in m["parts"]
    )


# -- no lost interrupt --------------------------------------------------------------------


def test_interrupt_landing_while_the_child_is_created_makes_it_refuse_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child_model = Answer()
    parent_model = Delegating("helper")
    create_child = TaskCancellation.child

    def child_then_interrupt(self: TaskCancellation, name: str) -> TaskCancellation:
        kid = create_child(self, name)
        assert not kid.cancelled
        self.cancel(CancelCause.USER)  # lands after "created", before the child's run registers
        assert kid.wait_cause(2) is CancelCause.PARENT
        return kid

    monkeypatch.setattr(TaskCancellation, "child", child_then_interrupt)
    parent = Agent(
        FunctionModel(parent_model), toolsets=[SubagentToolset({"helper": Agent(FunctionModel(child_model))})]
    )
    scope = TaskCancellation()
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, parent, "go")

    assert info.value.cause is CancelCause.USER
    assert child_model.requests == 0, "a child cancelled before it started must make no model request"
    assert parent_model.requests == 1
    (kid,) = scope.children
    assert "run_refused" in [e.event for e in kid.timeline]


@pytest.mark.parametrize("attempt", range(24))
def test_interrupt_racing_the_child_start_never_lets_a_cancelled_child_answer(
    monkeypatch: pytest.MonkeyPatch, attempt: int
) -> None:
    """The interrupt lands 0-6 ms after the child scope exists: before, during or after its run.

    Whatever the interleaving, a child that ends cancelled never gets an answer to the parent's
    model, and a child that completed did so before the interrupt was accepted.
    """
    parent_model = Delegating("helper")
    create_child = TaskCancellation.child

    def child_with_racing_interrupt(self: TaskCancellation, name: str) -> TaskCancellation:
        kid = create_child(self, name)
        # Jitter samples interleavings; it is not used to order anything.
        interrupt = threading.Timer(attempt * 0.00025, self.cancel, args=(CancelCause.USER,))
        interrupt.daemon = True
        interrupt.start()
        return kid

    monkeypatch.setattr(TaskCancellation, "child", child_with_racing_interrupt)
    parent = Agent(
        FunctionModel(parent_model), toolsets=[SubagentToolset({"helper": Agent(FunctionModel(Answer()))})]
    )
    scope = TaskCancellation()
    try:
        run_agent_in_scope(scope, parent, "go")
    except TaskCancelled:
        pass
    else:  # the interrupt came after the whole run
        (kid,) = scope.children
        assert kid.outcome is Outcome.COMPLETED and parent_model.requests == 2
        return
    (kid,) = scope.children
    assert scope.wait_released(2) and scope.cause is CancelCause.USER
    if kid.outcome is Outcome.CANCELLED:
        assert kid.cause is CancelCause.PARENT
        assert parent_model.requests == 1, "a cancelled child's answer must never reach the parent"
    else:
        assert kid.outcome is Outcome.COMPLETED and kid.cause is None
        assert "cancel_ignored" in [e.event for e in kid.timeline]


# -- a child's cancellation is never a result or a retry ----------------------------------


class ErrorsBecomeResults(AbstractCapability[Any]):
    """A capability that turns any tool error into a normal tool result (as some harnesses do)."""

    def __init__(self) -> None:
        self.converted: list[str] = []

    async def on_tool_execute_error(
        self, ctx: Any, *, call: Any, tool_def: Any, args: Any, error: Exception
    ) -> Any:
        self.converted.append(repr(error))
        return f"tool failed: {error}"


def test_child_cancelled_on_its_own_stops_the_parent_not_a_retry_or_result() -> None:
    parent_model = Delegating("helper")
    child_calls: list[str] = []

    async def cancel_only_the_child(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        child_calls.append("request")
        own = current_cancellation()
        assert own is not None and own.name == "helper"
        own.cancel(CancelCause.USER, detail="someone stopped only the sub-agent")
        await asyncio.sleep(60)
        return ModelResponse(parts=[TextPart("never")])

    converter = ErrorsBecomeResults()
    parent = Agent(
        FunctionModel(parent_model),
        toolsets=[SubagentToolset({"helper": Agent(FunctionModel(cancel_only_the_child))})],
        capabilities=[converter],
        retries=3,
    )
    scope = TaskCancellation()
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, parent, "go")

    assert info.value.cause is CancelCause.USER
    assert child_calls == ["request"], "the delegation must not be retried"
    assert parent_model.requests == 1, "no tool result or retry prompt may reach the parent's model"
    assert converter.converted == []
    assert "sub-agent 'helper' was cancelled" in scope.cause_detail
    (kid,) = scope.children
    assert kid.cause is CancelCause.USER and kid.outcome is Outcome.CANCELLED


def test_child_deadline_ends_the_task_as_timeout() -> None:
    leaf = Blocked()
    parent_model = Delegating("slow")
    parent = Agent(
        FunctionModel(parent_model),
        toolsets=[
            SubagentToolset([Subagent("slow", Agent(FunctionModel(leaf)), run_kwargs={"timeout": 0.2})])
        ],
    )
    scope = TaskCancellation()
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, parent, "go")
    assert info.value.cause is CancelCause.TIMEOUT
    assert parent_model.requests == 1
    (kid,) = scope.children
    assert kid.cause is CancelCause.TIMEOUT


def test_child_inherits_the_parent_runs_deadline() -> None:
    leaf = Blocked()
    parent = Agent(
        FunctionModel(Delegating("slow")), toolsets=[SubagentToolset({"slow": Agent(FunctionModel(leaf))})]
    )
    scope = TaskCancellation()
    with pytest.raises(TaskCancelled) as info:  # the leaf blocks until cancelled: only the deadline ends it
        run_agent_in_scope(scope, parent, "go", timeout=0.3)
    assert info.value.cause is CancelCause.TIMEOUT and leaf.cancelled.is_set()
    (kid,) = scope.children
    # Both deadlines are the same instant: whichever fires first, the root cause is TIMEOUT.
    assert kid.cause in (CancelCause.TIMEOUT, CancelCause.PARENT) and kid.root_cause is CancelCause.TIMEOUT


# -- sync tools and children driven from threads ------------------------------------------


def _polling_child(log: list[tuple[float, str]], started: threading.Event) -> Agent[Any, Any]:
    child = Agent(FunctionModel(CallTool("work")))

    @child.tool_plain
    def work() -> str:
        scope = current_cancellation()
        assert scope is not None
        log.append((time.monotonic(), f"work sees {scope.name}"))
        started.set()
        while not scope.wait(0.02):
            log.append((time.monotonic(), "tick"))
        scope.raise_if_cancelled()
        return "unreachable"

    return child


@pytest.mark.parametrize("threaded", [True, False], ids=["thread-driven child", "loop-driven child"])
def test_sync_tool_of_a_child_sees_its_scope_and_stops_with_the_parent(threaded: bool) -> None:
    log: list[tuple[float, str]] = []
    started = threading.Event()
    parent = Agent(
        FunctionModel(Delegating("worker")),
        toolsets=[SubagentToolset({"worker": _polling_child(log, started)}, threaded=threaded)],
    )
    scope = TaskCancellation()
    cancel_when(started, scope, CancelCause.USER)
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, parent, "go")
    raised = time.monotonic()

    assert (log[0][1]) == "work sees worker", "a sync tool of a sub-agent sees the sub-agent's scope"
    (kid,) = scope.children
    assert kid.cause is CancelCause.PARENT and kid.root_cause is CancelCause.USER
    assert scope.stragglers == [] and kid.stragglers == []
    working = [t.name for t in threading.enumerate() if t.name.startswith("tool-")]
    assert working == [], f"threads still working after the task raised: {working}"
    assert all(t < raised for t, _ in log)


def test_run_subagent_sync_and_async_from_your_own_tools() -> None:
    helper = Agent(FunctionModel(Answer("helped")))
    parent = Agent(FunctionModel(CallTool("sync_tool")))
    outputs: list[str] = []

    @parent.tool_plain
    def sync_tool() -> str:
        outputs.append(run_subagent_sync(helper, "help", name="from-thread").output)
        return "ok"

    scope = TaskCancellation()
    run_agent_in_scope(scope, parent, "go")

    parent_async = Agent(FunctionModel(CallTool("async_tool")))

    @parent_async.tool_plain
    async def async_tool() -> str:
        outputs.append((await run_subagent(helper, "help", name="from-loop")).output)
        return "ok"

    run_agent_in_scope(scope2 := TaskCancellation(), parent_async, "go")
    assert outputs == ["helped", "helped"]
    assert [k.name for k in scope.children] == ["from-thread"]
    assert [k.name for k in scope2.children] == ["from-loop"]


def test_works_with_a_plain_pydantic_ai_run_and_token() -> None:
    leaf = Blocked()
    parent = Agent(
        FunctionModel(Delegating("helper")),
        toolsets=[SubagentToolset({"helper": Agent(FunctionModel(leaf))})],
    )
    token = CancellationToken()

    def fire() -> None:
        if leaf.started.wait(10):
            token.cancel()

    threading.Thread(target=fire, daemon=True).start()
    with pytest.raises(RunCancelled):
        parent.run_sync("go", cancellation_token=token)
    assert leaf.cancelled.wait(2), "without a task scope, the child is still cancelled with its parent"


def test_a_sub_agent_without_a_model_runs_on_its_parents() -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.run.runner import run_agent_in_scope
    from cancellable_agents.toolsets.subagent_toolset import SubagentToolset

    seen: list[str] = []

    def parent_model(messages: Any, info: Any) -> ModelResponse:
        prompt = messages[0].parts[-1].content
        seen.append(prompt)
        if prompt == "do the task":  # the child's request, on the same model
            return ModelResponse(parts=[TextPart("child done")])
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("delegate", {"agent": "helper", "task": "do the task"})])
        return ModelResponse(parts=[TextPart("parent done")])

    parent = Agent(FunctionModel(parent_model), toolsets=[SubagentToolset({"helper": Agent(None)})])
    result = run_agent_in_scope(TaskCancellation(), parent, "start")
    assert result.output == "parent done"
    assert "do the task" in seen


def test_a_described_sub_agent_is_made_when_first_asked_and_runs_on_its_parents_model() -> None:
    """``Subagent(name, instructions=..., tools=...)`` costs a DAG file nothing; the task makes
    the ``Agent`` when the child is first asked, with its parent's model where it names none."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import FunctionModel

    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.run.runner import run_agent_in_scope

    counted: list[int] = []

    def count(n: int) -> str:
        """Count to n."""
        counted.append(n)
        return "counted"

    def model(messages: Any, info: Any) -> ModelResponse:
        first = messages[0].parts[-1].content
        if first == "count to 3":  # the child's run, on the parent's model
            if len(messages) == 1:
                assert info.instructions == "You count.", info.instructions
                return ModelResponse(parts=[ToolCallPart("count", {"n": 3})])
            return ModelResponse(parts=[TextPart("child counted")])
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("delegate", {"agent": "counter", "task": "count to 3"})])
        return ModelResponse(parts=[TextPart("parent done")])

    counter = Subagent("counter", instructions="You count.", tools=[count])
    toolset = SubagentToolset([counter])
    result = run_agent_in_scope(TaskCancellation(), Agent(FunctionModel(model), toolsets=[toolset]), "start")
    assert (result.output, counted) == ("parent done", [3])
    assert counter.the_agent() is counter.the_agent(), "made once"
