"""Idempotency keys of tool calls, without Airflow: the same logical call carries the same key in
every try (a call re-run after a kill included), any other call another one, and the key reaches
sync and async tools, HTTP headers and (``tests/process``) sandbox commands."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents import ToolCall, current_tool_call, idempotency_headers
from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.durable import FreshStart, Journal, MemoryStore
from cancellable_agents.run.runner import run_agent_in_scope, run_agent_in_scope_async
from cancellable_agents.run.tool_calls import IDEMPOTENCY_KEY_ENV, RunIdentity, derive_key
from tests.unit.durable_runs import STEPS, Task, cancel_on, entries, first_run_snapshots

TI = ("dag", "charge", "manual__2026-12-04", 0)


def _keys(task: Task) -> list[str]:
    return [call.idempotency_key for call in task.seen if call is not None]


def test_a_call_cut_by_a_kill_carries_the_same_key_on_the_next_try_and_knows_it_is_a_rerun() -> None:
    first, snapshots = first_run_snapshots()
    assert len(set(_keys(first))) == STEPS, "every call of the run has a key of its own"
    for cut in range(1, STEPS + 1):  # SIGKILLed while tool `cut` ran (its step is in the record)
        task = Task()
        task.run(MemoryStore(dict(next(s for s in snapshots if entries(s) == cut))), 2)
        rerun = task.seen[0]
        assert rerun is not None and rerun.is_rerun and rerun.tool_name == "step"
        assert rerun.idempotency_key == _keys(first)[cut - 1], f"the call cut in step {cut}"
        # The steps after it were never answered in try 1: new responses, new calls, new keys.
        assert len(set(_keys(task))) == STEPS - cut + 1
        assert not any(call is not None and call.is_rerun for call in task.seen[1:])


def test_a_cancelled_try_and_its_resumed_try_give_the_cut_call_one_key() -> None:
    store = MemoryStore()
    first = Task(on_call=cancel_on(3, CauseVerdict(CancelCause.EVICTION, "drain")))
    exc, _, _ = first.run(store, 1, identity=RunIdentity(TI))
    assert isinstance(exc, TaskCancelled)
    second = Task()
    result, journal, _ = second.run(store, 2, identity=RunIdentity(TI))
    assert result.output == "all done" and journal.origin_try == 1
    cut = first.seen[2]
    assert cut is not None and not cut.is_rerun
    assert second.seen[0] == ToolCall("step", cut.tool_call_id, cut.step, cut.idempotency_key, True)


def test_a_fresh_start_is_a_new_transcript_with_new_keys_even_for_repeated_call_ids() -> None:
    """Providers that number their calls (``call_0`` in every response) repeat ids across tries: a
    try that starts fresh (here: a user's Clear) must not reuse the keys of the cut transcript."""
    store = MemoryStore()
    first = Pair()
    first.run(store, 1, cancel=True)
    second = Pair()
    _, journal = second.run(store, 2, clear_count=1)
    assert journal.fresh_start is FreshStart.USER_STOP
    # The two tools run side by side, so the order they were seen in is not the call order.
    assert first.seen and {c.tool_call_id for c in first.seen} <= {c.tool_call_id for c in second.seen}
    assert not {c.idempotency_key for c in second.seen} & {c.idempotency_key for c in first.seen}


def test_two_calls_of_one_response_have_different_keys() -> None:
    pair = Pair()
    pair.run(MemoryStore(), 1)
    assert sorted(c.tool_name for c in pair.seen) == ["fetch", "send"]
    assert len({c.idempotency_key for c in pair.seen}) == 2
    assert {c.step for c in pair.seen} == {1}, "both made by the first model response"


def test_keys_differ_by_task_instance_map_index_run_key_and_try() -> None:
    base = RunIdentity(TI, "0", 1, durable=True)
    others = [
        RunIdentity(("dag", "charge", "manual__2026-12-04", 1), "0", 1, durable=True),  # map index
        RunIdentity(("dag", "refund", "manual__2026-12-04", 0), "0", 1, durable=True),  # task
        RunIdentity(("dag", "charge", "scheduled__2026-12-04", 0), "0", 1, durable=True),  # DAG run
        RunIdentity(TI, "1", 1, durable=True),  # the task's second durable run
        RunIdentity(TI, "0", 2, durable=True),  # a transcript begun in another try
        RunIdentity(TI, "0", 1),  # a run that keeps no record
        RunIdentity(parent="k"),  # a sub-agent's
    ]
    keys = {derive_key(identity, 1, "call_0") for identity in [base, *others]}
    assert len(keys) == len(others) + 1
    assert derive_key(base, 1, "call_0") != derive_key(base, 3, "call_0"), "another step"
    assert derive_key(base, 1, "call_0") == derive_key(RunIdentity(TI, "0", 1, durable=True), 1, "call_0")
    assert len(derive_key(base, 1, "call_0")) == 32


def test_a_run_without_a_record_has_keys_stable_within_its_try_and_new_on_a_retry() -> None:
    """Derived, not drawn: the same run (same ids, same identity) in the same try gets the same
    keys; a retry (another try number) is a fresh run whose calls are new calls."""
    once, twice, retry = Pair(), Pair(), Pair()
    once.run(None, 1, identity=RunIdentity(TI, "0", 1))
    twice.run(None, 1, identity=RunIdentity(TI, "0", 1))
    retry.run(None, 2, identity=RunIdentity(TI, "0", 2))
    assert [c.idempotency_key for c in once.seen] == [c.idempotency_key for c in twice.seen]
    assert not {c.idempotency_key for c in once.seen} & {c.idempotency_key for c in retry.seen}
    assert not any(c.is_rerun for c in once.seen)


def test_sync_and_async_tools_and_http_headers_see_their_own_call() -> None:
    pair = Pair()
    pair.run(None, 1)
    by_name = {c.tool_name: c for c in pair.seen}
    assert pair.headers == {
        "send": {"Idempotency-Key": by_name["send"].idempotency_key},
        "fetch": {"Idempotency-Key": by_name["fetch"].idempotency_key},
    }
    assert by_name["send"].env() == {IDEMPOTENCY_KEY_ENV: by_name["send"].idempotency_key}
    assert current_tool_call() is None and idempotency_headers() == {}, "outside a tool call"


def _calls_once(tool: str) -> FunctionModel:
    """A model that calls ``tool`` (id ``call_0``) in its first response, then answers."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart(tool, {}, "call_0")])
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


def test_a_sub_agents_calls_have_keys_of_their_own_under_the_parent_call() -> None:
    seen: dict[str, ToolCall | None] = {}
    child: Agent[None, str] = Agent(_calls_once("inner"))

    @child.tool_plain
    def inner() -> str:
        seen["inner"] = current_tool_call()
        return "ok"

    parent: Agent[None, str] = Agent(_calls_once("delegate"))

    @parent.tool_plain
    async def delegate() -> str:
        seen["delegate"] = current_tool_call()
        scope = TaskCancellation("child")
        return (await run_agent_in_scope_async(scope, child, "go")).output  # type: ignore[no-any-return]

    run_agent_in_scope(TaskCancellation("t"), parent, "go", identity=RunIdentity(TI))
    outer, inner_call = seen["delegate"], seen["inner"]
    assert outer is not None and inner_call is not None
    assert (outer.tool_call_id, outer.step) == (inner_call.tool_call_id, inner_call.step)
    assert inner_call.idempotency_key == derive_key(RunIdentity(parent=outer.idempotency_key), 1, "call_0")
    assert inner_call.idempotency_key != outer.idempotency_key


@dataclass
class Pair:
    """Response 1 calls ``send`` (sync) and ``fetch`` (async) with fixed ids, as providers that
    number their calls do; response 2 answers. ``cancel``: try 1 is evicted inside ``fetch``."""

    seen: list[ToolCall] = field(default_factory=list)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)

    def model(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(
                parts=[ToolCallPart("send", {}, "call_0"), ToolCallPart("fetch", {}, "call_1")]
            )
        return ModelResponse(parts=[TextPart("all done")])

    def agent(self, cancel: bool) -> Agent[None, str]:
        agent: Agent[None, str] = Agent(FunctionModel(self.model))

        def saw(name: str) -> None:
            call = current_tool_call()
            assert call is not None and call.tool_name == name
            self.seen.append(call)
            self.headers[name] = idempotency_headers()

        @agent.tool
        def send(ctx: RunContext[None]) -> str:
            saw("send")
            return "sent"

        @agent.tool
        async def fetch(ctx: RunContext[None]) -> str:
            saw("fetch")
            if cancel:
                verdict = CauseVerdict(CancelCause.USER)
                running = current_cancellation()
                assert running is not None
                running.cancel(verdict.cause, classify=lambda: verdict)
                await asyncio.sleep(30)  # the cancel lands here
            return "fetched"

        return agent

    def run(self, store: MemoryStore | None, try_number: int, *, cancel: bool = False, **kwargs: Any) -> Any:
        scope = TaskCancellation(f"try{try_number}")
        clear_count = kwargs.pop("clear_count", 0)
        journal = None
        if store is not None:
            journal = Journal(store, try_number=try_number, scope=scope, clear_count=clear_count)
        with scope.activate():
            try:
                result = run_agent_in_scope(scope, self.agent(cancel), "go", journal=journal, **kwargs)
            except TaskCancelled as exc:
                return exc, journal
        return result, journal
