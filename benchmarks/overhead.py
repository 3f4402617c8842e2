"""What the cancellation scope costs a normal run, measured in one process, interleaved.

A 50-step agent (pydantic-ai ``FunctionModel``: 49 tool calls, then an answer) runs bare
(``agent.run_sync``) and through the provider (``AgentOperator.run_agent_sync`` of a fresh
operator, i.e. a fresh task scope, tracked tools and ordered teardown), alternating which goes
first in each pair, so drift on a busy machine hits both alike. Reported: median per-run time of
each, their ratio, and the median of the paired differences (the absolute overhead per run).
Done twice: with an async tool and with a sync tool (sync tools run on tracked threads).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

STEPS = 50


def fifty_step_agent(kind: Literal["async", "sync"]) -> Agent[None, str]:
    """An agent whose model calls ``step`` ``STEPS - 1`` times, then answers."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
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


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(kind: Literal["async", "sync"], pairs: int = 200, warmup: int = 10) -> dict[str, Any]:
    """Interleave ``pairs`` bare and scoped runs; return medians (ms), ratio and overhead (ms)."""
    from cancellable_agents import AgentOperator

    agent = fifty_step_agent(kind)

    def bare() -> None:
        assert agent.run_sync("go").output == "done"

    def scoped(op: Any) -> Callable[[], None]:
        def run() -> None:
            assert op.run_agent_sync(agent, "go").output == "done"

        return run

    bare_s: list[float] = []
    ours_s: list[float] = []
    for i in range(warmup + pairs):
        op = AgentOperator(task_id=f"overhead_{i}", agent=agent)  # built outside the timed region
        first, second = (bare, scoped(op)) if i % 2 == 0 else (scoped(op), bare)
        t_first, t_second = _timed(first), _timed(second)
        t_bare, t_ours = (t_first, t_second) if i % 2 == 0 else (t_second, t_first)
        if i >= warmup:
            bare_s.append(t_bare)
            ours_s.append(t_ours)
    diffs = [o - b for o, b in zip(ours_s, bare_s, strict=True)]
    med_bare, med_ours = statistics.median(bare_s), statistics.median(ours_s)
    return {
        "tool": kind,
        "steps": STEPS,
        "pairs": pairs,
        "bare_ms": round(med_bare * 1000, 3),
        "ours_ms": round(med_ours * 1000, 3),
        "ratio": round(med_ours / med_bare, 3),
        "overhead_ms": round(statistics.median(diffs) * 1000, 3),
        "overhead_per_step_us": round(statistics.median(diffs) / STEPS * 1e6, 1),
    }


def measure_task_setup(reps: int = 50) -> dict[str, Any]:
    """Once per task, not per run: ``pre_execute`` (the scope and the descendant reaper)."""
    from cancellable_agents import LLMOperator

    times = []
    for i in range(reps):
        op = LLMOperator(task_id=f"setup_{i}", prompt="x", model="test")
        times.append(_timed(functools.partial(op.pre_execute, {})))
        reaper = op.__dict__.get("_reaper")
        if reaper is not None:
            reaper.close()
    return {"pre_execute_ms": round(statistics.median(times) * 1000, 3), "reps": reps}


def overhead_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| {STEPS}-step agent | bare run_sync (ms) | ours run_agent_sync (ms) | ratio "
        "| overhead per run (ms) | per step (µs) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tool']} tool, {r['pairs']} pairs | {r['bare_ms']:.2f} | {r['ours_ms']:.2f} "
            f"| {r['ratio']:.3f} | {r['overhead_ms']:.3f} | {r['overhead_per_step_us']:.1f} |"
        )
    return "\n".join(lines)
