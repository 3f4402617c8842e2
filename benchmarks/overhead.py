"""What the cancellation scope costs a normal run, measured in one process, interleaved.

A 50-step agent (pydantic-ai ``FunctionModel`` with an async model function, as a real HTTP model
is async: 49 tool calls, then an answer) runs bare (``agent.run_sync``) and through the provider
(``AgentOperator.run_agent_sync`` of a fresh operator, i.e. a fresh task scope, tracked tools and
ordered teardown), alternating which goes first in each pair, so drift on a busy machine hits
both alike. Reported: median per-run time of each, their ratio, and the median of the paired
differences (the absolute overhead per run). Done with an async tool and with a sync tool (sync
tools run on one tracked thread per call), plus a control row: bare with an *empty* per-run
pydantic-ai capability, i.e. what pydantic-ai itself charges for any per-run capability.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any, Literal

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from benchmarks.paired import interleaved, markdown_table, median_difference, timed

STEPS = 50
Variant = Literal["async", "sync", "empty-capability"]
VARIANTS: tuple[Variant, ...] = ("async", "sync", "empty-capability")


def fifty_step_agent(kind: Literal["async", "sync"]) -> Agent[None, str]:
    """An agent whose model calls ``step`` ``STEPS - 1`` times, then answers."""

    async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", []))
        if done >= STEPS - 1:
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("step", {"i": done})])

    agent: Agent[None, str] = Agent(FunctionModel(model))
    if kind == "async":

        @agent.tool_plain(name="step")
        async def step_async(i: int) -> int:
            return i + 1

    else:

        @agent.tool_plain(name="step")
        def step_sync(i: int) -> int:
            return i + 1

    return agent


class _EmptyCapability(AbstractCapability[Any]):
    """Does nothing: measures pydantic-ai's own cost of a per-run capability."""


def _check(result: Any) -> None:
    assert result.output == "done"


def _candidate(variant: Variant, agent: Agent[None, str], index: int) -> Callable[[], None]:
    """The run compared with the bare one; per-task setup (a fresh operator) happens here, untimed."""
    if variant == "empty-capability":
        return lambda: _check(agent.run_sync("go", capabilities=[_EmptyCapability()]))
    from cancellable_agents import AgentOperator

    op = AgentOperator(task_id=f"overhead_{index}", agent=agent)
    return lambda: _check(op.run_agent_sync(agent, "go"))


def measure(variant: Variant, pairs: int = 200, warmup: int = 10) -> dict[str, Any]:
    """Interleave ``pairs`` bare and compared runs; return medians (ms), ratio and overhead (ms)."""
    agent = fifty_step_agent("sync" if variant == "sync" else "async")

    def bare() -> None:
        _check(agent.run_sync("go"))

    bare_s, other_s = interleaved(bare, lambda i: _candidate(variant, agent, i), pairs, warmup)
    diff = median_difference(other_s, bare_s)
    med_bare, med_other = statistics.median(bare_s), statistics.median(other_s)
    return {
        "variant": variant,
        "steps": STEPS,
        "pairs": pairs,
        "bare_ms": round(med_bare * 1000, 3),
        "other_ms": round(med_other * 1000, 3),
        "ratio": round(med_other / med_bare, 4),
        "overhead_ms": round(diff * 1000, 3),
        "overhead_per_step_us": round(diff / STEPS * 1e6, 1),
    }


def measure_task_setup(reps: int = 50) -> dict[str, Any]:
    """Once per task, not per run: ``pre_execute`` (the scope and the descendant reaper)."""
    from cancellable_agents import LLMOperator

    times = []
    for i in range(reps):
        op = LLMOperator(task_id=f"setup_{i}", prompt="x", model="test")
        times.append(timed(functools.partial(op.pre_execute, {})))
        op.task_try().close_reaper()
    return {"pre_execute_ms": round(statistics.median(times) * 1000, 3), "reps": reps}


_LABELS = {
    "async": "ours, async tool",
    "sync": "ours, sync tool",
    "empty-capability": "control: bare + empty capability",
}


def overhead_table(rows: list[dict[str, Any]]) -> str:
    header = [
        f"{STEPS}-step agent (pairs)",
        "bare run_sync (ms)",
        "compared run (ms)",
        "ratio",
        "overhead per run (ms)",
        "per step (µs)",
    ]
    return markdown_table(
        header,
        (
            [
                f"{_LABELS[r['variant']]} ({r['pairs']})",
                f"{r['bare_ms']:.2f}",
                f"{r['other_ms']:.2f}",
                f"{r['ratio']:.3f}",
                f"{r['overhead_ms']:.3f}",
                f"{r['overhead_per_step_us']:.1f}",
            ]
            for r in rows
        ),
    )
