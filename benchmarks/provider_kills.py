"""What a kill does to each provider's request: real SDKs, real SIGTERMs, the per-provider table.

For each provider of ``tests/provider_models.py`` (OpenAI chat and responses, Anthropic, Gemini,
Vertex AI, Bedrock, Mistral, Groq) and each moment (mid-stream; for Bedrock also before the first
byte and a non-streaming request), ``--reps`` real ``dag.test()`` task processes (forked from the
process tests' zygote) stream from the scripted server speaking that provider's wire protocol and
are SIGTERMed (``tests/process/provider_kills.py``, the kill the process test makes)::

    .venv/bin/python -m benchmarks.provider_kills [--reps 5] [--providers bedrock,gemini]

Prints a markdown table, median / max over the repetitions: SIGTERM -> the task raised, -> the
server saw the request closed, -> the task process was gone; and in how many repetitions a
connection to the server was still established once the task failed, or a thread of ours held
the process at its exit. The SDKs are the package's extras; a provider whose SDK is missing is
left out with its name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.airflow_env import airflow_env, migrate
from tests.process.conftest import scenario_env
from tests.process.harness import DAGS_FOLDER, TaskProcess
from tests.process.provider_kills import kill_request
from tests.process.zygote import ScenarioZygote
from tests.provider_models import PROVIDERS, installed
from tests.taskproc import GRACE, with_root_on_path

from cancellable_agents.testing.openai_server import ScriptedModelServer

#: Each provider's moments: mid-stream for all; Bedrock's request blocked in its thread as well.
MOMENTS: dict[str, tuple[str, ...]] = {p: ("stream",) for p in PROVIDERS} | {
    "bedrock": ("stream", "first", "whole")
}
MOMENT_NAMES = {"stream": "streaming", "first": "before the first byte", "whole": "non-streaming"}


def _ms(values: list[float]) -> str:
    if not values:
        return "never"
    return f"{statistics.median(values):.0f} / {max(values):.0f} ms"


def _row(provider: str, moment: str, results: list[dict[str, Any]]) -> str:
    closed = [r["closed_ms"] for r in results if r["closed_ms"] is not None]
    never = len(results) - len(closed)
    left_open = sum(bool(r["connections"]) for r in results)
    holding = sum(bool(r["holding"]) for r in results)
    sigkill = sum(r["exit_ms"] > GRACE * 1000 for r in results)
    closed_cell = _ms(closed) + (f" ({never} never)" if never else "")
    return (
        f"| {provider} | {MOMENT_NAMES[moment]} | {_ms([r['raised_ms'] for r in results])} | {closed_cell} "
        f"| {_ms([r['exit_ms'] for r in results])} | {left_open}/{len(results)} | {holding}/{len(results)} "
        f"| {sigkill}/{len(results)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if installed(p)]
    missing = sorted(set(args.providers.split(",")) - set(providers))
    with tempfile.TemporaryDirectory() as tmp, ScriptedModelServer() as server:
        home = Path(tmp) / "home"
        migrate(airflow_env(home), timeout=None)
        env = scenario_env(home, server.base_url)
        zygote_env = with_root_on_path(env)
        zygote_env["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS_FOLDER)
        zygote = ScenarioZygote(zygote_env, Path(tmp) / "zygote.log")
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        try:
            for rep in range(args.reps):
                for provider in providers:  # interleaved, so load drifts hit every provider alike
                    for moment in MOMENTS[provider]:
                        server.reset()
                        log_dir = Path(tmp) / f"logs-{rep}"
                        log_dir.mkdir(exist_ok=True)
                        started: list[TaskProcess] = []

                        def spawn(
                            scenario: str, log_dir: Path = log_dir, started: list[TaskProcess] = started
                        ) -> Any:
                            task = TaskProcess(scenario, env, log_dir, zygote=zygote)
                            started.append(task)
                            return task

                        try:
                            result = kill_request(spawn, server, provider, moment)
                        finally:
                            for task in started:
                                task.close(timeout=0)
                        results.setdefault((provider, moment), []).append(result)
                        print(
                            f"{rep} {provider:16} {moment:6} raised {result['raised_ms']:.0f} ms, "
                            f"closed {result['closed_ms']} ms, gone {result['exit_ms']:.0f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            zygote.close()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{args.reps} repetitions each, {os.cpu_count()} cores, load average {load} (1, 5, 15 min)")
    print(
        "\n| model | request | task raised | request closed (server saw it) | task process gone "
        "| connection left open | thread held the exit | exit past the 5 s grace |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for provider in providers:
        for moment in MOMENTS[provider]:
            print(_row(provider, moment, results[(provider, moment)]))
    if missing:
        print(f"\nnot measured (SDK not installed; the package's extras): {', '.join(missing)}")


if __name__ == "__main__":
    main()
