"""What wind-down buys on a workload that overruns its deadline: the share of runs that end with an
answer with and without it, and the time from the wind-down's start to the final answer.

The workload, scaled down ten times from a real one (a 30 s run with a 12 s window is a 3 s run
with a 1.2 s window here): ``--runs`` agents against the scripted model server over real HTTP
(``loop``: it calls its tool while it is offered and answers once it is not, or on its own after
``count`` steps). Each run needs 5 to 40 steps of 0.1 s (drawn, seeded), so some finish before the
deadline and the rest would overrun it; each final answer takes a drawn time (log-normal, median
0.3 s, a long tail past the window: a model that is sometimes too slow). The same runs, in the same
order, go once without ``wind_down`` and once with it, one after the other in this process
(``run_agent_in_scope`` with ``timeout=``, the deadline a task's ``execution_timeout`` gives).

Reported per variant: runs that ended with an answer, that wound down, that were killed at the
deadline; and for wound-down runs the time from the wind-down's start (``wind_down_started`` on
the scope's timeline) to the answer (``run_wound_down``): p50 and p99. The window must cover that
time's tail: the step in flight plus the final answer.

``python -m benchmarks.wind_down [--runs N]``; ``make bench`` runs it (``--wind-down-runs``).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from pydantic_ai import Agent

from benchmarks.report import percentile
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.core.wind_down import WindDown
from cancellable_agents.hooks.model import build_model
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer

#: The run's deadline (its ``timeout=``) and the window, in seconds (a real 30 s and 12 s, / 10).
DEADLINE = 3.0
WINDOW = 1.2
#: Seconds each step's tool takes.
STEP = 0.1


@dataclass(frozen=True)
class Job:
    """One run of the workload: how many steps it needs, how long its final answer takes."""

    steps: int
    final_delay: float

    def model(self) -> str:
        return f"openai:loop?name=work&count={self.steps}&final_delay={self.final_delay:.3f}"


def workload(runs: int, seed: int = 41) -> list[Job]:
    rng = random.Random(seed)
    return [Job(rng.randint(5, 40), min(5.0, rng.lognormvariate(-1.2, 0.8))) for _ in range(runs)]


def work(n: int) -> str:
    """One step (a sync tool)."""
    time.sleep(STEP)
    return f"result {n}"


def run_one(server: ScriptedModelServer, job: Job, wind_down: WindDown | None) -> dict[str, Any]:
    """One run; how it ended, and (wound down) the ms from the wind-down's start to the answer."""
    agent = Agent(build_model(job.model(), base_url=server.base_url), tools=[work])
    scope = TaskCancellation("bench")
    try:
        run_agent_in_scope(scope, agent, "go", wind_down=wind_down, timeout=DEADLINE)
    except TaskCancelled as exc:
        return {"end": "killed", "cause": exc.cause.value, "to_answer_ms": None}
    at = {e.event: e.at for e in scope.timeline}
    if "run_wound_down" in at:
        return {"end": "wound_down", "to_answer_ms": (at["run_wound_down"] - at["wind_down_started"]) * 1000}
    return {"end": "completed", "to_answer_ms": None}


def measure(runs: int) -> list[dict[str, Any]]:
    """Both variants over the same workload: one row each."""
    jobs = workload(runs)
    rows = []
    baseline: list[dict[str, Any]] = []
    with ScriptedModelServer() as server:
        for name, wind_down in (("without wind_down", None), (f"wind_down={WINDOW:g}s", WindDown(WINDOW))):
            ended = [run_one(server, job, wind_down) for job in jobs]
            # Wound down, though it would have completed before the deadline: the window's cost.
            early = sum(
                r["end"] == "wound_down" and b["end"] == "completed"
                for r, b in zip(ended, baseline, strict=False)
            )
            baseline = baseline or ended
            to_answer = sorted(r["to_answer_ms"] for r in ended if r["to_answer_ms"] is not None)
            rows.append(
                {
                    "variant": name,
                    "runs": len(ended),
                    "answered": sum(r["end"] != "killed" for r in ended),
                    "wound_down": sum(r["end"] == "wound_down" for r in ended),
                    "wound_down_early": early,
                    "killed": sum(r["end"] == "killed" for r in ended),
                    "to_answer_p50_ms": percentile(to_answer, 50) if to_answer else None,
                    "to_answer_p99_ms": percentile(to_answer, 99) if to_answer else None,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown."""
    lines = [
        f"| variant (deadline {DEADLINE:g} s) | runs | ended with an answer | wound down "
        "| (of which would have completed) | killed at the deadline | wind-down start → answer p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        share = f"{row['answered']} ({100 * row['answered'] / row['runs']:.0f} %)"
        took = (
            f"{row['to_answer_p50_ms']:.0f} / {row['to_answer_p99_ms']:.0f} ms"
            if row["to_answer_p50_ms"] is not None
            else "-"
        )
        lines.append(
            f"| {row['variant']} | {row['runs']} | {share} | {row['wound_down']} | {row['wound_down_early']} "
            f"| {row['killed']} | {took} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.wind_down", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args(argv)
    print(table(measure(args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
