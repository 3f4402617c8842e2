"""Kill scenarios x (common.ai's operators as shipped, through ``cancellable_agents.common_ai``).

Real SIGTERMs to real ``dag.test()`` task processes (``tests/process/common_ai_kills.py``), the
local HTTP model server, both implementations in one run. Needs the common-ai venv::

    make .venv-common-ai/.installed
    .venv-common-ai/bin/python -m benchmarks.common_ai_kills [--reps N]

Prints a markdown table: pass/fail and SIGTERM -> raised latency (median of the repetitions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tests.airflow_env import airflow_env, migrate
from tests.process.common_ai_kills import KILL_SCENARIOS, KillResult, run_kills

from cancellable_agents.testing.openai_server import ScriptedModelServer

IMPLS = ("shipped", "ours")


def _cell(results: list[KillResult]) -> str:
    passed = sum(r.passed for r in results)
    times = [r.raised_ms for r in results if r.raised_ms is not None and r.outcome != "succeeded"]
    latency = f"{statistics.median(times):.0f} ms" if times else "never"
    verdict = "pass" if passed == len(results) else f"FAIL ({passed}/{len(results)})"
    outcomes = ", ".join(sorted({r.outcome for r in results}))
    problems = "; ".join(sorted({p for r in results for p in r.problems}))
    return f"{verdict} · {latency} · {outcomes}" + (f" · {problems}" if problems else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(KILL_SCENARIOS))
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    with tempfile.TemporaryDirectory() as tmp, ScriptedModelServer() as server:
        env = airflow_env(Path(tmp) / "home")
        migrate(env, timeout=None)
        results: dict[tuple[str, str], list[KillResult]] = {}
        for rep in range(args.reps):
            for impl in IMPLS:  # interleaved, so load drifts hit both alike
                log_dir = Path(tmp) / f"logs-{rep}"
                for result in run_kills(impl, scenarios, server=server, airflow_env=env, log_dir=log_dir):
                    results.setdefault((result.scenario, impl), []).append(result)
                    print(f"{impl:8} {result.scenario:14} {_cell([result])}", file=sys.stderr, flush=True)
    print("\n| kill scenario | common.ai as shipped | through cancellable_agents.common_ai |")
    print("|---|---|---|")
    for scenario in scenarios:
        cells = [_cell(results.get((scenario, impl), [])) for impl in IMPLS]
        print(f"| {scenario} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
