"""The journal (``durable=True``) without Airflow: runs journaled into a :class:`MemoryStore` and
resumed from every step boundary in turn; when a try continues an earlier one, and when not."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits

from cancellable_agents.core.causes import CancelCause, CauseVerdict, UserAction
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.durable import FreshStart, Journal, MemoryStore, current_resume
from cancellable_agents.durable._capability import JournalCapability
from cancellable_agents.run._tracker import CancellationCapability, RunTracker, run_capabilities
from cancellable_agents.run.runner import run_agent_in_scope
from tests.unit.durable_runs import (
    STEPS,
    Counting,
    Script,
    Snapshots,
    Task,
    cancel_on,
    cancelled_try,
    entries,
    first_run_snapshots,
    killed_at,
)


def test_written_ahead_every_step_is_in_the_store_before_its_tools_run() -> None:
    store = MemoryStore()
    seen: list[int] = []
    task = Task(on_call=lambda n: seen.append(entries(store.data)))
    task.run(store, 1, write_ahead=True)
    # Before tool n runs: n entries, the n-th ending with the response that calls it.
    assert seen == list(range(1, STEPS + 1))
    assert task.script.requests == STEPS + 1


class SeesSteps(AbstractCapability[Any]):
    """A capability of the caller's: counts the graph steps it sees end, names the tool calls it
    sees execute."""

    def __init__(self) -> None:
        self.steps = 0
        self.tools: list[str] = []

    async def after_node_run(self, ctx: Any, *, node: Any, result: Any) -> Any:
        self.steps += 1
        return result

    async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any) -> Any:
        self.tools.append(call.tool_name)
        return await handler(args)


def test_the_journal_rides_in_the_runs_own_capability_beside_the_callers() -> None:
    """pydantic-ai copies the ``RunContext`` for every capability at every hook, so the journal
    adds none: its hooks are folded into the run's own, and a caller's capability still runs."""
    tracker = RunTracker(TaskCancellation("t"))
    journal, theirs = JournalCapability(cast(Any, "steps")), SeesSteps()
    (ours, *rest) = run_capabilities(tracker, [theirs, journal])
    assert isinstance(ours, CancellationCapability) and isinstance(ours, JournalCapability)
    assert (ours.steps, rest) == ("steps", [theirs])
    assert [type(c) for c in run_capabilities(tracker, [theirs])] == [CancellationCapability, SeesSteps]
    store = Counting()  # cannot list its keys: the completed record stays to be counted
    result, _, _ = Task().run(store, 1, capabilities=[theirs])
    assert result.output == "all done"
    assert entries(store.store.data) == STEPS + 1 and theirs.steps > STEPS


def test_a_step_costs_at_most_one_store_call() -> None:
    """Through a store that cannot list its keys (as Airflow's task state store): a first try
    reads nothing, writes one entry per model response that calls tools and one end, in at most
    as many calls (entries that queued while a call was in flight share the next); a resumed
    try reads the record once and then costs the same per step."""
    store = Counting()
    Task().run(store, 1)
    requests = STEPS + 1
    assert store.calls["get"] == store.calls["delete"] == 0, store.calls
    assert 1 <= store.calls["set"] <= STEPS + 1, store.calls
    assert entries(store.store.data) == STEPS + 1
    assert store.total / requests <= 1.1
    killed = Counting(MemoryStore(killed_at(3)))
    task = Task()
    task.run(killed, 2, max_unconfirmed=1)
    # Try 1's three entries, the key after them and the one after that (no entry past a gap);
    # then steps 4..6 and the end.
    assert killed.calls == {"get": 3 + 2, "set": STEPS - 3 + 1, "delete": 0}, killed.calls
    assert task.script.requests == STEPS + 1 - 3


@pytest.mark.parametrize("model_waits", [False, True])
def test_tool_returns_ride_with_the_next_response_unless_it_is_slow(model_waits: bool) -> None:
    """The request carrying tool returns is appended with the response to it; if that response
    takes longer than ``returns_flush_s``, the returns are appended alone while the model works."""
    flushed = asyncio.Event()

    @dataclass
    class Watched(MemoryStore):
        kept: list[Any] = field(default_factory=list)

        def set(self, key: str, value: Any) -> None:
            self.kept.append(value)
            if [m["kind"] for m in value.get("messages", [])] == ["request"]:
                flushed.set()  # on the run's loop: the flush timer fires there
            super().set(key, value)

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("step", {"n": 1})])
        if model_waits:
            await asyncio.wait_for(flushed.wait(), 10)
        return ModelResponse(parts=[TextPart("all done")])

    agent: Agent[None, str] = Agent(FunctionModel(model))

    @agent.tool_plain
    def step(n: int) -> str:
        return f"step {n} ok"

    store = Watched()
    scope = TaskCancellation("try1")
    journal = Journal(store, try_number=1, scope=scope, returns_flush_s=0.05)
    with scope.activate():
        assert run_agent_in_scope(scope, agent, "one step", journal=journal).output == "all done"
    kinds = [(v["kind"], [m["kind"] for m in v.get("messages", [])]) for v in store.kept]
    returns_alone = [("step", ["request"])] if model_waits else []
    assert kinds == [("step", ["request", "response"]), *returns_alone, ("end", [])], kinds


def test_a_cancelled_try_writes_the_pending_tool_returns_with_its_end() -> None:
    """Stopped while the model works on the returns of tool 2: the end entry carries them, so
    the next try does not run tool 2 again and asks the model from request 3 on."""
    ran: list[tuple[int, int]] = []
    requests: list[int] = []

    def run(try_number: int) -> tuple[Any, Journal]:
        script = Script()

        async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            requests.append(try_number)
            if try_number == 1 and sum(isinstance(m, ModelResponse) for m in messages) == 2:
                scope = current_cancellation()
                assert scope is not None
                scope.cancel(
                    CancelCause.EVICTION, classify=lambda: CauseVerdict(CancelCause.EVICTION, "drain")
                )
                await asyncio.sleep(30)  # the cancel lands here, while request 3 is unanswered
            return script(messages, info)

        agent: Agent[None, str] = Agent(FunctionModel(model), system_prompt="be brief")

        @agent.tool_plain
        def step(n: int) -> str:
            ran.append((n, try_number))
            return f"step {n} ok"

        scope = TaskCancellation(f"try{try_number}")
        journal = Journal(store, try_number=try_number, scope=scope)
        with scope.activate():
            try:
                return run_agent_in_scope(scope, agent, "do six steps", journal=journal), journal
            except TaskCancelled as exc:
                return exc, journal

    store = MemoryStore()
    assert isinstance(run(1)[0], TaskCancelled)
    result, journal = run(2)
    assert result.output == "all done"
    assert journal.resume is not None and journal.resume.messages == 5  # request 3: the returns of 2
    assert ran == [(1, 1), (2, 1), *((n, 2) for n in range(3, STEPS + 1))]
    assert requests.count(2) == STEPS + 1 - 2


def test_the_record_is_deleted_when_the_run_completes() -> None:
    store = MemoryStore()
    Task().run(store, 1)
    assert store.data == {}


def test_a_completed_record_left_in_a_store_that_cannot_list_is_not_resumed() -> None:
    """Where the keys stay (Airflow's task state store), the completed run's end says so: the
    next try starts fresh."""
    store = Counting()
    Task().run(store, 1)
    assert entries(store.store.data) == STEPS + 1
    task = Task()
    _, journal, _ = task.run(store, 2)
    assert journal.resume is None and journal.fresh_start is FreshStart.NO_RECORD
    assert task.script.requests == STEPS + 1


def test_resume_from_every_step_boundary_redoes_no_completed_step() -> None:
    # Tool returns appended at once: a boundary after each response and after each tool's return.
    first, snapshots = first_run_snapshots(returns_flush_s=0)
    # Every snapshot but the last (the completed run's end) is a SIGKILL right after that many appends.
    boundaries = snapshots[:-1]
    assert len(boundaries) == 2 * STEPS  # 6 x (the response calling tool n, tool n's return)
    for taken in boundaries:
        count = entries(taken)
        store = MemoryStore(dict(taken))
        task = Task()
        result, journal, _ = task.run(store, 2)
        assert result.output == "all done"
        responses = (count + 1) // 2  # model responses already in the record
        assert task.script.requests == STEPS + 1 - responses, f"after {count} entries"
        # The record ends with a response whose tool call has no return, or with that return.
        in_flight = count % 2 == 1
        assert journal.resume is not None and journal.resume.messages == count + 1  # + the prompt
        if in_flight:
            # Exactly the in-flight call runs again, once, and knows it is a re-run.
            assert task.calls[0] == (responses, True)
            assert [n for n, _ in task.calls] == list(range(responses, STEPS + 1))
        else:
            assert [n for n, _ in task.calls] == list(range(responses + 1, STEPS + 1))
        assert sum(rerun for _, rerun in task.calls) == (1 if in_flight else 0)
        assert store.data == {}
    assert first.script.requests == STEPS + 1


def test_a_streaming_run_is_journaled_and_resumed_too() -> None:
    _first, snapshots = first_run_snapshots(event_stream_handler=_drain)
    taken = next(s for s in snapshots if entries(s) == 3)  # killed while tool 3 ran
    task = Task()
    result, _journal, _ = task.run(MemoryStore(dict(taken)), 2, event_stream_handler=_drain)
    assert result.output == "all done"
    assert task.script.requests == STEPS + 1 - 3
    assert task.calls[0] == (3, True)


async def _drain(ctx: Any, events: Any) -> None:
    async for _ in events:
        pass


def test_an_evicted_try_is_resumed_and_usage_is_summed() -> None:
    store = MemoryStore()
    cancelled_try(CauseVerdict(CancelCause.EVICTION, "worker shutdown"), store)
    task = Task()
    _result, journal, scope = task.run(store, 2)
    assert journal.resume is not None and journal.resume.from_try == 1
    assert task.script.requests == 3  # responses 5, 6 and the answer
    facts = scope.attached["durable"]
    # Try 1 made 4 requests, and a 5th if the cancel landed after tool 4 returned (counted: it was sent).
    earlier = facts["usage_earlier_tries"][0]["requests"]
    assert earlier in (4, 5)
    assert facts["usage_this_try"]["requests"] == 3
    assert facts["usage_total"]["requests"] == earlier + 3


def test_a_cancelled_try_writes_its_end_after_the_caller_was_told() -> None:
    """The runner ends the journal: ``on_cancelled`` (where an operator logs its kill record) runs
    before the end entry is written, because that write may wait seconds on the store."""
    told: list[int] = []

    @dataclass
    class Watched(MemoryStore):
        ends: list[bool] = field(default_factory=list)  # for each end written: was the caller told?

        def set(self, key: str, value: Any) -> None:
            if isinstance(value, dict) and value.get("kind") == "end":
                self.ends.append(bool(told))
            super().set(key, value)

    store = Watched()
    evicted = CauseVerdict(CancelCause.EVICTION, "worker shutdown")
    scope = TaskCancellation("try1")
    journal = Journal(store, try_number=1, scope=scope)
    with scope.activate(), pytest.raises(TaskCancelled):
        run_agent_in_scope(
            scope,
            Task(on_call=cancel_on(4, evicted)).agent(),
            "do six steps",
            journal=journal,
            on_cancelled=lambda exc: told.append(len(store.ends)),
        )
    assert told == [0], "told once, before any end was written"
    assert store.ends == [True]


def test_a_cleared_try_starts_fresh_unless_resume_after_clear() -> None:
    cleared = CauseVerdict.of_user(UserAction.CLEARED)
    store = MemoryStore()
    cancelled_try(cleared, store)
    task = Task()
    _task_result, journal, _ = task.run(copy.deepcopy(store), 2)
    assert journal.resume is None and task.script.requests == STEPS + 1
    again = Task()
    _, journal, _ = again.run(store, 2, resume_after_clear=True)
    assert journal.resume is not None and again.script.requests == 3


def test_a_try_cleared_away_without_an_end_is_known_by_the_clear_count() -> None:
    """After a Clear the old try can no longer write (its task instance is gone): the next try
    sees the DAG run's clear count grew since the old try began."""
    first = Snapshots()
    Task().run(first, 1, clear_count=0, max_unconfirmed=1)
    killed = next(s for s in first.taken if entries(s) == 3)
    task = Task()
    _, journal, _ = task.run(MemoryStore(dict(killed)), 2, clear_count=1)
    assert journal.resume is None and task.script.requests == STEPS + 1
    again = Task()
    _, journal, _ = again.run(MemoryStore(dict(killed)), 2, clear_count=0)
    assert journal.resume is not None and again.script.requests == STEPS + 1 - 3
    _, journal, _ = Task().run(MemoryStore(dict(killed)), 2, clear_count=1, resume_after_clear=True)
    assert journal.resume is not None


def test_usage_limits_can_span_tries() -> None:
    store = MemoryStore()
    cancelled_try(CauseVerdict(CancelCause.EVICTION, "worker shutdown"), store)
    with pytest.raises(UsageLimitExceeded):
        Task().run(copy.deepcopy(store), 2, usage_spans_tries=True, usage_limits=UsageLimits(request_limit=5))
    result, _, _scope = Task().run(store, 2, usage_limits=UsageLimits(request_limit=5))
    assert result.output == "all done", "without the option, the limit counts this try only"


@pytest.mark.parametrize("write_ahead", [True, False])
def test_an_older_try_may_not_append_once_a_newer_try_took_over(
    caplog: pytest.LogCaptureFixture, write_ahead: bool
) -> None:
    store = MemoryStore()
    newer: list[Any] = []
    evicted = CauseVerdict(CancelCause.EVICTION, "worker shutdown")

    def start_try_2(n: int) -> None:
        if n == 2 and not newer:  # try 1 is still alive when try 2 starts (an orphan); try 2 is evicted
            try_2 = Task(on_call=cancel_on(4, evicted))
            thread = threading.Thread(target=lambda: newer.append(try_2.run(store, 2)))
            thread.start()
            thread.join(30)

    old = Task(on_call=start_try_2)
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.durable"):
        outcome, _journal, scope = old.run(store, 1, owner_check_s=0, write_ahead=write_ahead)
    assert isinstance(outcome, TaskCancelled), "the superseded try cancels itself"
    assert scope.cause is CancelCause.EVICTION and "superseded by try 2" in scope.cause_detail
    # It looks before each append: written ahead, before the step's tool starts, so it goes no
    # further; otherwise on the writer's thread beside the tool, and the cancel reaches the run
    # a moment later (a step or two, under load: ci6). Either way it stores nothing more (below).
    assert old.calls[:2] == [(1, False), (2, False)], old.calls
    if write_ahead:
        assert len(old.calls) == 2, "try 1 went no further"
    exc, journal2, _ = newer[0]
    assert isinstance(exc, TaskCancelled) and journal2.resume is not None
    messages = [r.getMessage() for r in caplog.records]
    assert any("may still be running" in m for m in messages), messages
    assert any("is not the newest" in m for m in messages), messages
    stored = [MemoryStore(store.data).get(k) for k in store.data if k.count(".") >= 4]
    tries = [e["try"] for value in stored for e in (value if isinstance(value, list) else [value])]
    assert tries.count(1) == 2, "try 1 appended nothing after try 2 took over (responses 1 and 2)"


def test_a_stale_try_cannot_change_what_the_newest_try_resumes_from() -> None:
    """Try 1 runs on after try 2 took over (it does not look: its owner check is not due) and
    appends its steps and even its completion; try 2 dies without a word in tool 4. Try 3 resumes
    from exactly what try 2 recorded: try 1's later entries are under its own keys, past the
    count try 2 froze in its head, and its completion does not drop try 2's record."""
    store = MemoryStore()
    died: list[BaseException] = []

    def try_2_dies_in_4(n: int) -> None:
        if n == 4:
            raise RuntimeError("SIGKILL")  # no end, no completion: the record stays as it is

    def start_try_2(n: int) -> None:
        if n == 2 and not died:

            def run() -> None:
                try:
                    Task(on_call=try_2_dies_in_4).run(store, 2)
                except RuntimeError as exc:
                    died.append(exc)

            thread = threading.Thread(target=run)
            thread.start()
            thread.join(30)

    stale = Task(on_call=start_try_2)
    result, _journal, _ = stale.run(store, 1)
    assert result.output == "all done" and died, "try 1 ran to the end beside try 2"
    stored = [json.loads(v) for k, v in store.data.items() if ".try1." in k]
    try_1 = [e for v in stored for e in (v if isinstance(v, list) else [v])]  # a key: one entry, or a batch
    late_entries = len([e for e in try_1 if e["i"] >= 2])  # try 1's record starts at 0: i is its own index
    assert late_entries == STEPS - 2 + 1, "try 1 appended steps 3..6 and its end after try 2 took over"
    task = Task()
    result, journal, _ = task.run(store, 3)
    assert result.output == "all done"
    assert journal.resume is not None and journal.resume.from_try == 2
    assert journal.resume.messages == 8, "requests and responses 1..4: what try 2 had recorded"
    assert task.calls[0] == (4, True) and task.script.requests == STEPS + 1 - 4


def test_a_resumed_run_with_a_sandbox_is_told_its_workspace_is_gone() -> None:
    from cancellable_agents.toolsets.sandbox import SandboxToolset

    instructions: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        instructions.append(info.instructions or "")
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("step", {"n": 1})])
        return ModelResponse(parts=[TextPart("ok")])

    def run(store: Any, try_number: int, sandbox: bool) -> Journal:
        agent: Agent[None, str] = Agent(FunctionModel(model), toolsets=[SandboxToolset()] if sandbox else [])

        @agent.tool_plain
        def step(n: int) -> str:
            return "ok"

        scope = TaskCancellation(f"try{try_number}")
        journal = Journal(store, try_number=try_number, scope=scope)
        with scope.activate():
            run_agent_in_scope(scope, agent, "work", journal=journal)
        return journal

    for sandbox in (False, True):
        first = Snapshots()
        run(first, 1, sandbox)
        killed = next(s for s in first.taken if entries(s) == 1)  # while the tool call ran
        instructions.clear()
        assert run(MemoryStore(dict(killed)), 2, sandbox).resume is not None
        told = ["sandbox workspace of the previous try is gone" in i for i in instructions]
        assert told == [sandbox], (sandbox, instructions)


@dataclass
class ParallelTask:
    """One model response with two tool calls, ``fetch`` (returns at once) and ``slow`` (cancels the
    try once ``fetch``'s result is in the store, and is cancelled itself), then the answer."""

    store: MemoryStore
    calls: list[tuple[str, int, bool]] = field(default_factory=list)
    requests: int = 0
    capabilities: list[Any] = field(default_factory=list)  # the caller's own

    def model(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(
                parts=[ToolCallPart("fetch", {}, "call-f"), ToolCallPart("slow", {}, "call-s")]
            )
        return ModelResponse(parts=[TextPart("all done")])

    def run(self, try_number: int, cancel_in_slow: bool) -> tuple[Any, Journal]:
        agent: Agent[None, str] = Agent(FunctionModel(self.model))

        @agent.tool
        async def fetch(ctx: RunContext[None]) -> dict[str, int]:
            self.calls.append(("fetch", try_number, _rerun(ctx)))
            return {"orders": 42}

        @agent.tool
        async def slow(ctx: RunContext[None]) -> str:
            self.calls.append(("slow", try_number, _rerun(ctx)))
            scope = current_cancellation()
            if cancel_in_slow and scope is not None:
                async with asyncio.timeout(5):
                    while _tool_results(self.store) < 1:  # fetch runs beside this call, on this loop
                        await asyncio.sleep(0.005)
                scope.cancel(
                    CancelCause.EVICTION, classify=lambda: CauseVerdict(CancelCause.EVICTION, "drain")
                )
                await asyncio.sleep(30)  # the cancel lands here: this call never returns in try 1
            return "slow ok"

        scope = TaskCancellation(f"try{try_number}")
        journal = Journal(self.store, try_number=try_number, scope=scope)
        with scope.activate():
            try:
                result = run_agent_in_scope(
                    scope, agent, "fetch and be slow", journal=journal, capabilities=self.capabilities
                )
            except TaskCancelled as exc:
                return exc, journal
        return result, journal


def _rerun(ctx: RunContext[None]) -> bool:
    resume = current_resume()
    return bool(resume and resume.is_rerun(ctx.tool_call_id))


def _tool_results(store: MemoryStore) -> int:
    return sum(1 for k in list(store.data) if k.count(".") >= 4 and '"tool_result"' in store.data[k])


def test_a_parallel_call_that_returned_is_not_run_again_when_its_sibling_was_in_flight() -> None:
    task = ParallelTask(MemoryStore())
    exc, _ = task.run(1, cancel_in_slow=True)
    assert isinstance(exc, TaskCancelled)
    assert _tool_results(task.store) == 1, "fetch's result was appended while slow still ran"
    theirs = SeesSteps()
    task.capabilities = [theirs]
    result, journal = task.run(2, cancel_in_slow=False)
    # The caller's tool-execution hooks see the call that runs again, not the one answered from
    # the record (it does not run).
    assert theirs.tools == ["slow"]
    assert result.output == "all done"
    assert journal.resume is not None
    assert journal.resume.replayed_tool_calls == {"call-f"} and journal.resume.rerun_tool_calls == {"call-s"}
    assert sorted(task.calls) == [("fetch", 1, False), ("slow", 1, False), ("slow", 2, True)]
    assert task.requests == 2, "try 2 asked only for the answer"
    returns = [m for m in result.all_messages() if not isinstance(m, ModelResponse)][-1]
    assert [getattr(p, "content", None) for p in returns.parts] == [{"orders": 42}, "slow ok"]
    assert task.store.data == {}


def test_a_lone_tool_call_adds_no_entry_of_its_own() -> None:
    store = Snapshots()
    Task().run(store, 1)
    assert not any('"tool_result"' in value for snapshot in store.taken for value in snapshot.values())


def test_a_step_is_stored_while_its_tool_runs() -> None:
    """By default a step's store call is off the step's path: this store's call for step n
    waits until tool n has started, which only a journal that writes beside the tools lets
    happen (one that writes first would wait 2 s per step here, and fail)."""
    started = {n: threading.Event() for n in range(1, STEPS + 1)}
    overlapped: list[bool] = []

    @dataclass
    class WaitsForTheTool(MemoryStore):
        steps: int = 0

        def set(self, key: str, value: Any) -> None:
            for entry in value if isinstance(value, list) else [value]:  # entries queued meanwhile
                if entry["kind"] == "step":
                    self.steps += 1
                    overlapped.append(started[self.steps].wait(2))
            super().set(key, value)

    store = WaitsForTheTool()
    task = Task(on_call=lambda n: started[n].set())
    result, _, _ = task.run(store, 1)
    assert result.output == "all done" and [n for n, _ in task.calls] == list(range(1, STEPS + 1))
    assert overlapped == [True] * STEPS, "each step's store call was still going when its tool started"
    assert store.steps == STEPS and store.writes <= STEPS + 1, "every step and the end stored"
