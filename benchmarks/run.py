"""``python -m benchmarks.run`` (``make bench``): kill latency per scenario, and the scope's overhead.

Prints markdown tables and writes ``benchmarks/results/results.json`` and
``benchmarks/results/kill_latency.png``. Options::

    --reps N              repetitions per scenario and implementation (default 20;
                          stream-dagtest uses min(N, 5): each one is a real dag.test())
    --scenarios a,b       only these scenarios (names: see --list)
    --impl ours,common-ai which implementations (default: both when common.ai is importable)
    --overhead-pairs N    interleaved pairs for the overhead measurement (default 200; 0 skips it)
    --durable-pairs N     interleaved pairs for the journal's cost, bare vs durable=True (default 50; 0 skips)
    --wind-down-runs N    runs of the overrunning workload, without and with wind_down (default 40; 0 skips)
    --out DIR             output folder (default benchmarks/results)

Timing numbers depend on the machine and on what else runs on it; the JSON records the load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from tests.airflow_env import airflow_env
from tests.kill_scenarios import BY_NAME, CONN_ENV, SCENARIOS, WARMUP_ENV, Impl, Scenario
from tests.taskproc import ROOT

from benchmarks import durable_cost, overhead, report, wind_down
from benchmarks.kill_latency import RepResult, measure_scenario
from cancellable_agents.testing.openai_server import ScriptedModelServer

DEFAULT_OUT = ROOT / "benchmarks" / "results"


def common_ai_status() -> tuple[bool, str]:
    """Whether common.ai's ``CancellableAgentRunMixin`` is importable, and if not why."""
    try:
        from airflow.providers.common.ai.mixins.cancellable_run import CancellableAgentRunMixin  # noqa: F401
    except ImportError as exc:
        return False, (
            f"apache-airflow-providers-common-ai is not importable ({exc}); install the `common-ai` extra "
            "(`uv pip install -e '.[common-ai]'`) to compare"
        )
    return (
        True,
        f"apache-airflow-providers-common-ai {metadata.version('apache-airflow-providers-common-ai')}",
    )


def skip_reason(scenario: Scenario) -> str | None:
    """Why ``scenario`` cannot run on this machine (``None``: it can)."""
    if scenario.name == "sandbox-namespace":
        from cancellable_agents.toolsets.sandbox import bwrap_support

        support = bwrap_support()
        if not support.usable:
            return f"n/a (bubblewrap cannot create PID namespaces here: {support.reason})"
    if scenario.name.startswith("subagent-"):
        try:
            import cancellable_agents.toolsets.subagent_tools  # noqa: F401
        except ImportError:
            return "n/a (module missing: cancellable_agents.toolsets.subagent_tools)"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    parser.add_argument("--impl", default="", help="ours,common-ai (default: both when available)")
    parser.add_argument("--overhead-pairs", type=int, default=200)
    parser.add_argument("--durable-pairs", type=int, default=50)
    parser.add_argument("--wind-down-runs", type=int, default=40)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    unknown = [s for s in _split(args.scenarios) if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {[s.name for s in SCENARIOS]}")
    return args


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:<18} {s.title}")
        return 0
    out: Path = args.out
    logs = out / "logs"
    shutil.rmtree(logs, ignore_errors=True)  # one run's child logs, never mixed with an older run's
    logs.mkdir(parents=True, exist_ok=True)
    impls, common_ai_note = _choose_impls(args.impl)
    chosen = [BY_NAME[name] for name in _split(args.scenarios)] or list(SCENARIOS)
    load_before = os.getloadavg()
    results, skipped = _kill_latency(chosen, impls, args.reps, out, logs)

    overhead_rows: list[dict[str, Any]] = []
    setup: dict[str, Any] = {}
    if args.overhead_pairs > 0:
        print(f"overhead: {args.overhead_pairs} interleaved pairs per variant ...")
        overhead_rows = [overhead.measure(variant, args.overhead_pairs) for variant in overhead.VARIANTS]
        setup = overhead.measure_task_setup()
    durable_rows: list[dict[str, Any]] = []
    if args.durable_pairs > 0:
        print(f"durable: {args.durable_pairs} interleaved pairs per store ...")
        durable_rows = [durable_cost.measure(kind, args.durable_pairs) for kind in durable_cost.STORES]
    wind_down_rows: list[dict[str, Any]] = []
    if args.wind_down_runs > 0:
        print(f"wind-down: {args.wind_down_runs} overrunning runs, without and with wind_down ...")
        wind_down_rows = wind_down.measure(args.wind_down_runs)

    payload = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "versions": _versions(),
        "reps": args.reps,
        "common_ai": common_ai_note,
        "skipped": skipped,
        "kill_latency": results,
        "overhead": overhead_rows,
        "task_setup": setup,
        "durable": durable_rows,
        "wind_down": wind_down_rows,
        "targets": {"raised_p99_ms": report.RAISED_TARGET_MS, "gone_p99_ms": report.GONE_TARGET_MS},
    }
    report.write_json(out / "results.json", payload)
    report.draw_chart(results, out / "kill_latency.png")
    _print_report(results, skipped, overhead_rows, setup, out, load_before)
    if durable_rows:
        print()
        print("## The continuity record (durable=True): cost per step")
        print()
        print(durable_cost.table(durable_rows))
    if wind_down_rows:
        print()
        print("## Wind-down: answers instead of kills on an overrunning workload")
        print()
        print(wind_down.table(wind_down_rows))
    return 0


def _choose_impls(requested: str) -> tuple[list[str], str]:
    """The implementations to measure, and what to say about common.ai (always printed)."""
    has_common_ai, note = common_ai_status()
    impls = _split(requested) or (["ours", "common-ai"] if has_common_ai else ["ours"])
    if "common-ai" in impls and not has_common_ai:
        print(f"common.ai comparison skipped: {note}")
        impls.remove("common-ai")
    elif "common-ai" not in impls:
        print(f"common.ai comparison skipped: {note if not has_common_ai else 'not requested'}")
    else:
        print(f"comparing with {note} (CancellableAgentRunMixin)")
    return impls, note


def _kill_latency(
    chosen: list[Scenario], impls: list[str], reps: int, out: Path, logs: Path
) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, str]]:
    """Every chosen scenario through every implementation, against one local model server."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    skipped: dict[str, str] = {}
    with ScriptedModelServer() as server, ScriptedModelServer() as warmup_server:
        env = {**_child_env(server, out), WARMUP_ENV: warmup_server.base_url}
        for scenario in chosen:
            reason = skip_reason(scenario)
            if reason is not None:
                skipped[scenario.name] = reason
                print(f"{scenario.name}: {reason}")
                continue
            results[scenario.name] = {}
            print(f"{scenario.name}: {scenario.title}")
            for impl in impls:
                if scenario.name == "stream-dagtest" and impl != "ours":
                    continue
                count = min(reps, scenario.reps) if scenario.reps else reps
                measured = _measure(scenario, impl, count, server, env, out, logs)
                results[scenario.name][impl] = [r.as_dict() for r in measured]
    return results, skipped


def _measure(
    scenario: Scenario,
    impl: str,
    reps: int,
    server: ScriptedModelServer,
    env: dict[str, str],
    out: Path,
    logs: Path,
) -> list[RepResult]:
    if scenario.name == "stream-dagtest":
        from benchmarks import dagtest

        return dagtest.measure(reps, server, out / "airflow_home", logs)
    return measure_scenario(scenario, cast(Impl, impl), reps, server, env, logs)


def _child_env(server: ScriptedModelServer, out: Path) -> dict[str, str]:
    home = out / "airflow_home"
    home.mkdir(parents=True, exist_ok=True)
    conn = {"conn_type": "cancellable_agents_model", "host": server.base_url}
    return airflow_env(home, {CONN_ENV: json.dumps(conn)})


def _versions() -> dict[str, str]:
    found = {}
    for dist in (
        "airflow-provider-cancellable-agents",
        "apache-airflow",
        "pydantic-ai-slim",
        "apache-airflow-providers-common-ai",
    ):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _print_report(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    skipped: dict[str, str],
    overhead_rows: list[dict[str, Any]],
    setup: dict[str, Any],
    out: Path,
    load_before: tuple[float, float, float],
) -> None:
    print()
    print(f"## Kill latency (ms after the SIGTERM; load average before {load_before[0]:.1f})")
    print()
    print(report.latency_table(results))
    for name, reason in skipped.items():
        print(f"| {BY_NAME[name].title} | - | 0 | {reason} |")
    notes = [f"- {BY_NAME[s].title}: {BY_NAME[s].note}" for s in results if BY_NAME[s].note]
    if notes:
        print()
        print("\n".join(notes))
    errors = report.harness_errors(results)
    if errors:
        print("\nNot measured (harness errors, left out of the statistics):")
        print("\n".join(f"- {e}" for e in errors))
    ratios = report.ratio_table(results)
    if ratios:
        print()
        print("## Side by side: common.ai / ours (medians)")
        print()
        print(ratios)
    if overhead_rows:
        print()
        print("## Scope overhead on a normal run")
        print()
        print(overhead.overhead_table(overhead_rows))
        if setup:
            setup_ms = setup["pre_execute_ms"]
            print(f"\nOnce per task: pre_execute (scope + descendant reaper) {setup_ms:.2f} ms (median).")
    print()
    print(f"wrote {out / 'results.json'} and {out / 'kill_latency.png'}")


if __name__ == "__main__":
    sys.exit(main())
