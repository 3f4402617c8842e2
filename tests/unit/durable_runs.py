"""Durable runs for the unit tests of :mod:`cancellable_agents.durable`, without Airflow:
pydantic-ai ``FunctionModel`` runs journaled into a :class:`MemoryStore`, and snapshots of the
store after every write (each one a SIGKILL at that step boundary)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from cancellable_agents.core.causes import CauseVerdict
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.durable import Journal, MemoryStore, current_resume
from cancellable_agents.durable._record_format import KEY_PREFIX
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.run.tool_calls import ToolCall, current_tool_call

STEPS = 6
#: Steps of ``operator_agent``'s run.
OPERATOR_STEPS = 4


@dataclass
class Script:
    """A model that calls ``step(n)`` for n = 1..STEPS, one per response, then answers."""

    requests: int = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < STEPS:
            return ModelResponse(parts=[ToolCallPart("step", {"n": done + 1})])
        return ModelResponse(parts=[TextPart("all done")])

    async def stream(self, messages: list[ModelMessage], info: AgentInfo) -> Any:
        self.requests += 1
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < STEPS:
            yield {0: DeltaToolCall(name="step", json_args=f'{{"n": {done + 1}}}')}
        else:
            yield "all done"


@dataclass
class Snapshots(MemoryStore):
    """A MemoryStore that keeps a copy of itself after every write (each step boundary)."""

    taken: list[dict[str, str]] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        super().set(key, value)
        self.taken.append(dict(self.data))


@dataclass
class Task:
    """One agent whose tool records each call (and whether it was a re-run), and the
    :class:`ToolCall` each saw (``seen``)."""

    script: Script = field(default_factory=Script)
    calls: list[tuple[int, bool]] = field(default_factory=list)
    seen: list[ToolCall | None] = field(default_factory=list)
    on_call: Callable[[int], None] | None = None
    prompt: str = "do six steps"

    def agent(self) -> Agent[None, str]:
        agent: Agent[None, str] = Agent(
            FunctionModel(self.script, stream_function=self.script.stream), system_prompt="be brief"
        )

        @agent.tool
        def step(ctx: RunContext[None], n: int) -> str:
            resume = current_resume()
            self.calls.append((n, bool(resume and resume.is_rerun(ctx.tool_call_id))))
            self.seen.append(current_tool_call())
            if self.on_call is not None:
                self.on_call(n)
            return f"step {n} ok"

        return agent

    def run(self, store: Any, try_number: int, **kwargs: Any) -> tuple[Any, Journal, TaskCancellation]:
        """One try: the run's result, or the :class:`TaskCancelled` it raised (the runner ended
        the journal either way)."""
        scope = TaskCancellation(f"try{try_number}")
        names = (
            "resume_after_clear",
            "usage_spans_tries",
            "clear_count",
            "returns_flush_s",
            "owner_check_s",
            "write_ahead",
            "max_unconfirmed",
            "batch_window_s",
        )
        options = {k: kwargs.pop(k) for k in names if k in kwargs}
        journal = Journal(store, try_number=try_number, scope=scope, **options)
        with scope.activate():
            try:
                result = run_agent_in_scope(scope, self.agent(), self.prompt, journal=journal, **kwargs)
            except TaskCancelled as exc:
                return exc, journal, scope
        return result, journal, scope


#: The record of a task's first durable run (``run_key`` "0").
RECORD = f"{KEY_PREFIX}.0"


def entries(data: dict[str, str]) -> int:
    """How many entries the stored ``data`` holds (a key of the record holds one, or a list)."""
    values = [json.loads(v) for k, v in data.items() if k.startswith(f"{RECORD}.")]
    return sum(len(v) if isinstance(v, list) else 1 for v in values)


@dataclass
class Counting:
    """A store that counts its calls, each a round trip through Airflow's task state store, and
    like that store cannot list its keys (so a completed run leaves them)."""

    store: MemoryStore = field(default_factory=MemoryStore)
    calls: dict[str, int] = field(default_factory=lambda: {"get": 0, "set": 0, "delete": 0})

    def get(self, key: str) -> Any:
        self.calls["get"] += 1
        return self.store.get(key)

    def set(self, key: str, value: Any) -> None:
        self.calls["set"] += 1
        self.store.set(key, value)

    def delete(self, key: str) -> None:
        self.calls["delete"] += 1
        self.store.delete(key)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def first_run_snapshots(**kwargs: Any) -> tuple[Task, list[dict[str, str]]]:
    """A completed first try, and the store as it was after each of its writes (one entry per
    write: ``max_unconfirmed=1`` unless given, so each snapshot is one step boundary)."""
    task = Task()
    store = Snapshots()
    result, _, _ = task.run(store, 1, **{"max_unconfirmed": 1, **kwargs})
    assert result.output == "all done"
    return task, store.taken


def killed_at(count: int) -> dict[str, str]:
    """The store of a first try SIGKILLed right after its ``count``-th entry: while tool
    ``count`` ran (one entry per step, holding the response that calls it)."""
    _, snapshots = first_run_snapshots()
    return dict(next(s for s in snapshots if entries(s) == count))


def cancel_on(n: int, verdict: CauseVerdict) -> Callable[[int], None]:
    """A tool hook that cancels the running try, with ``verdict``, in step ``n``."""

    def hook(called: int) -> None:
        scope = current_cancellation()
        if called == n and scope is not None:
            scope.cancel(verdict.cause, classify=lambda: verdict)
            # A cooperative tool returns once the run was told to stop, so the kill lands in
            # this step however slow the unwind thread is to start (a busy machine).
            scope.wait(5)

    return hook


def cancelled_try(verdict: CauseVerdict, store: MemoryStore) -> TaskCancelled:
    """A first try into ``store``, cancelled with ``verdict`` in step 4."""
    task = Task(on_call=cancel_on(4, verdict))
    exc, _, _ = task.run(store, 1)
    assert isinstance(exc, TaskCancelled)
    return exc


def operator_agent(
    kill_at: int | None, op_box: list[Any], requests: list[int] | None = None
) -> Agent[None, str]:
    """Four steps, one ``step`` tool call each, then the answer, for an operator test: while tool
    ``kill_at`` runs, the operator in ``op_box[0]`` gets its SIGTERM (``on_kill``); each model
    request is counted in ``requests``."""

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if requests is not None:
            requests.append(1)
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < OPERATOR_STEPS:
            return ModelResponse(parts=[ToolCallPart("step", {"n": done + 1})])
        return ModelResponse(parts=[TextPart("done")])

    agent: Agent[None, str] = Agent(FunctionModel(script))

    @agent.tool_plain
    def step(n: int) -> str:
        if n == kill_at:
            op_box[0].on_kill()  # the SIGTERM lands while this tool runs (cause: unknown here)
            # As a cooperative tool does: return only once the run was told to stop, so the
            # kill lands in this step however slow the unwind thread is to start.
            op_box[0].cancellation.wait(5)
        return f"step {n} ok"

    return agent


@dataclass
class TI:
    """The task instance facts the operators read from the context (as the Task SDK's ti has them)."""

    try_number: int = 1
    id: str = "0192f0e0-0000-7000-8000-000000000001"
    dag_id: str = "d"
    run_id: str = "manual__1"
    task_id: str = "agent"
    map_index: int = -1
