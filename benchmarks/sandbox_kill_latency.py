"""Kill -> tree-gone latency of LocalSandbox, per isolation mode and profile (prints numbers).

Namespace mode runs twice, side by side in the same run: ``profile="host"`` (the view before the
boundary: host read-only, no limits) and ``profile="boundary"`` (the default), so the cost of the
boundary shows against a baseline measured under the same load; then landlock mode (the boundary
without namespaces) and process-group mode (no boundary), interleaved with them. ``--hostile`` also runs the
hostile-command table (``tests/process/_sandbox_task.py hostile``): each command's result as
the model reads it, then SIGTERM -> all gone with every one of them running.

Each run starts ``sh -c 'setsid sleep M & (sleep M &) ; sleep M'`` (M a unique marker), waits
until the three sleeps run (and, in process-group mode, until the tracker has seen the setsid'd
one), then stops it two ways:

- ``stop()``: ``LocalSandbox.stop(command_id)`` called directly;
- ``scope.cancel()``: the task scope is cancelled (what ``on_kill`` does); the sandbox's
  IN_FLIGHT resource stops the command on the scope's helper thread.

"gone" is the time from the call until no process with the marker in its command line runs
(scanned every ~1 ms); "returned" is when ``stop()`` returned / the scope reported release.

It ends with ``run('true')`` in the boundary profile with the seccomp filter on and off,
interleaved: what the filter adds to each command's start; then the boundary profile without a
network against the same with an egress allowlist (start and kill, interleaved).

The main measurements end in one table, the modes side by side. ``--pod`` (root only) then
measures every mode again as uid 50000 without capabilities where user namespaces are allowed,
then landlock and process-group mode inside a restricted pod (``tests/process/restricted_pod.py``:
the same user, ``no_new_privs``, a RuntimeDefault-like seccomp filter; no cgroup, no tmpfs), and
prints their rows beside (measured after the root rows, so under the load of that moment).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/sandbox_kill_latency.py [--runs 20] [--hostile] [--pod]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.once import Once
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.procs.proc import all_pids, command_line, read_proc
from cancellable_agents.toolsets.sandbox import EgressPolicy, LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary.landlock import landlock_support

TREE = "setsid sleep {m} & (sleep {m} &) ; sleep {m}"


def marker_processes(marker: str, name: str | None = None) -> list[int]:
    found = []
    for pid in all_pids():
        info = read_proc(pid)
        if info is None or info.exited or (name is not None and info.name != name):
            continue
        if marker in command_line(pid, limit=4096):
            found.append(pid)
    return found


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"condition not met within {timeout}s")
        time.sleep(0.005)


def one_run(
    mode: str, via_scope: bool, profile: str, network: bool | EgressPolicy = False
) -> tuple[float, float]:
    """Return (seconds until the tree was gone, seconds until the stop call returned)."""
    marker = f"39{uuid.uuid4().int % 10:d}.{uuid.uuid4().int % 10**9:09d}"
    scope = TaskCancellation("bench", budget=4.0)
    box = LocalSandbox(isolation=mode, profile=profile, scope=scope, stop_grace=1.0, network=network)  # type: ignore[arg-type]
    try:
        command = box.start(TREE.format(m=marker))
        wait_for(lambda: len(marker_processes(marker, "sleep")) == 3)
        if mode != "namespace":  # tracked by the watcher (process-group and landlock modes)
            wait_for(lambda: len(box.descendants(command)) >= 2)
        returned: list[float] = []

        def kill() -> None:
            if via_scope:
                scope.cancel(CancelCause.USER)
                scope.wait_released(10)
            else:
                box.stop(command)
            returned.append(time.monotonic())

        started = time.monotonic()
        killer = threading.Thread(target=kill)
        killer.start()
        while marker_processes(marker):
            time.sleep(0.001)
        gone = time.monotonic()
        killer.join(15)
        return gone - started, returned[0] - started
    finally:
        box.destroy()


def describe(label: str, samples: list[float]) -> str:
    ms = [s * 1000 for s in samples]
    return f"{label:<9} median {statistics.median(ms):7.1f} ms   max {max(ms):7.1f} ms"


def ms_pair(samples: list[float]) -> str:
    ms = [s * 1000 for s in samples]
    return f"{statistics.median(ms):.0f} / {max(ms):.0f} ms"


def table_rows(summary: dict[str, dict[str, list[float]]], where: str) -> list[str]:
    """Markdown rows: a setup per row, run('true') and the two kills (median / max)."""
    return [
        f"| {label} | {where} | {ms_pair(cols['true'])} | {ms_pair(cols['stop()'])} | "
        f"{ms_pair(cols['scope.cancel()'])} |"
        for label, cols in summary.items()
    ]


TABLE_HEAD = [
    "| mode | where | `run('true')` end to end | `stop()` of a 3-process tree, until gone "
    "| `scope.cancel()`, until gone |",
    "|---|---|---|---|---|",
]


def pod_rows(runs: int, *, runtime_default: bool = True) -> list[str]:
    """The same measurements inside a restricted pod (landlock and process-group mode), or
    (``runtime_default=False``) as the same user where user namespaces are allowed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.process.restricted_pod import make_pod_dir, pod_env, restricted_argv, unavailable_reason

    why_not = unavailable_reason()
    if why_not is not None:
        print(f"restricted pod skipped: {why_not}")
        return []
    pod_dir = make_pod_dir()
    try:
        where = "pod" if runtime_default else "userns"
        argv = [sys.executable, str(Path(__file__).resolve()), "--runs", str(runs), f"--inside={where}"]
        proc = subprocess.run(
            restricted_argv(argv, runtime_default=runtime_default),
            env=pod_env(pod_dir),
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    finally:
        shutil.rmtree(pod_dir, ignore_errors=True)
    if proc.returncode != 0:
        print(f"restricted pod failed: {proc.stderr[-2000:]}")
        return []
    return [line for line in proc.stdout.splitlines() if line.startswith("| ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hostile", action="store_true", help="also run the hostile-command table")
    parser.add_argument("--pod", action="store_true", help="also measure inside a restricted pod (root only)")
    parser.add_argument("--inside", choices=["pod", "userns"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    # The process-group rows would print the "not a boundary" warning once per run.
    logging.getLogger("cancellable_agents.toolsets.sandbox.local.isolation").setLevel(logging.ERROR)
    logging.getLogger("cancellable_agents.toolsets.sandbox.local").setLevel(logging.ERROR)
    support = bwrap_support()
    setups = [("process-group", "boundary")]
    if landlock_support().usable:
        setups[:0] = [("landlock", "boundary")]
    else:
        print(f"landlock mode skipped: {landlock_support().reason}")
    if support.usable:
        setups[:0] = [("namespace", "host")] + ([("namespace", "boundary")] if support.boundary else [])
    else:
        print(f"namespace mode skipped: {support.reason}")
    summary: dict[str, dict[str, list[float]]] = {}
    for via_scope in (False, True):
        how = "scope.cancel()" if via_scope else "stop()"
        # Interleaved, so the profiles share the same load.
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {setup: [] for setup in setups}
        for _ in range(args.runs):
            for setup in setups:
                samples[setup].append(one_run(setup[0], via_scope, setup[1]))
        for (mode, profile), results in samples.items():
            label = f"{mode}, profile={profile}" if mode == "namespace" else mode
            summary.setdefault(label, {})[how] = [g for g, _ in results]
            print(f"{label} / {how}, {args.runs} runs:")
            print("  " + describe("gone", [g for g, _ in results]))
            print("  " + describe("returned", [r for _, r in results]))
    print(f"run('true') end to end (what a profile costs per command), {args.runs} runs:")
    for mode, profile in setups:
        box = LocalSandbox(isolation=mode, profile=profile)  # type: ignore[arg-type]
        try:
            took = [box.run("true").duration for _ in range(args.runs)]
        finally:
            box.destroy()
        label = f"{mode}, profile={profile}" if mode == "namespace" else mode
        summary[label]["true"] = took
        ms = [t * 1000 for t in took]
        print(f"  {label:<28} median {statistics.median(ms):7.1f} ms   max {max(ms):7.1f} ms")
    where = {
        "pod": "restricted pod (uid 50000, RuntimeDefault-like seccomp)",
        "userns": "uid 50000, user namespaces allowed",
    }.get(args.inside or "", f"uid {os.getuid()}")
    rows = table_rows(summary, where)
    if args.inside:
        print("\n".join(rows))
        return
    if args.pod:
        rows += pod_rows(args.runs, runtime_default=False) + pod_rows(args.runs)
    print(f"\nSide by side, median / max of {args.runs} runs (gone: no process of the tree left):")
    print("\n".join(TABLE_HEAD + rows))
    if support.boundary:
        filter_cost(args.runs)
        egress_cost(args.runs)
        limits_cost(args.runs)
    if args.hostile and support.boundary:
        hostile_table()


def filter_cost(runs: int) -> None:
    """run('true') in the boundary profile with and without the seccomp filter, interleaved so
    both share the same load: what the filter adds to each command's start."""
    from unittest import mock

    from cancellable_agents.toolsets.sandbox.local.boundary import seccomp

    if seccomp.seccomp_filter().program is None:
        print(f"seccomp filter cost skipped: {seccomp.seccomp_filter().reason}")
        return
    off = seccomp.SeccompFilter(None, "off for the benchmark")
    took: dict[str, list[float]] = {"filter": [], "no filter": []}
    box = LocalSandbox(isolation="namespace")
    try:
        for _ in range(runs):
            took["filter"].append(box.run("true").duration)
            with mock.patch.object(seccomp, "seccomp_filter", lambda *_: off):  # asked at each start
                took["no filter"].append(box.run("true").duration)
    finally:
        box.destroy()
    print(f"run('true'), profile=boundary, seccomp filter on/off interleaved, {runs} runs:")
    for label, samples in took.items():
        print("  " + describe(label, samples))


def limits_cost(runs: int) -> None:
    """The limits per sandbox (its cgroup, the workdir's tmpfs) against the per-process limits of
    before, boundary profile, interleaved: creating + destroying a sandbox, its first and second
    ``run('true')`` (the first command in a fresh cgroup costs more), and ``stop()`` of a running
    ``sleep`` (until it returns: the tree gone and reaped)."""
    from unittest import mock

    from cancellable_agents.toolsets.sandbox import Limits
    from cancellable_agents.toolsets.sandbox.local.boundary import cgroups

    if cgroups.cgroup_support().version is None:
        print(f"limits per sandbox cost skipped: {cgroups.cgroup_support().reason}")
        return
    off = cgroups.CgroupSupport(None, reason="off for the benchmark")
    setups: dict[str, Callable[[], LocalSandbox]] = {
        "per sandbox": lambda: LocalSandbox(isolation="namespace"),
        "per process": lambda: LocalSandbox(isolation="namespace", limits=Limits(workdir_bytes=None)),
    }
    took: dict[str, dict[str, list[float]]] = {
        what: {label: [] for label in setups} for what in ("setup", "1st run", "next run", "stop")
    }
    said = Once()
    said.first()  # already said: no fallback note per "per process" sandbox
    with mock.patch.object(cgroups, "_noted", said):
        for _ in range(runs):
            for label, make in setups.items():
                patch = mock.patch.object(cgroups, "cgroup_support", lambda: off)
                with patch if label == "per process" else contextlib.nullcontext():
                    started = time.monotonic()
                    box = make()
                    box.destroy()
                    took["setup"][label].append(time.monotonic() - started)
                    box = make()
                try:
                    took["1st run"][label].append(box.run("true").duration)
                    took["next run"][label].append(box.run("true").duration)
                    command = box.start("sleep 60")
                    wait_for(functools.partial(box.descendants, command))
                    started = time.monotonic()
                    box.stop(command)
                    took["stop"][label].append(time.monotonic() - started)
                finally:
                    box.destroy()
    print(f"limits per sandbox (cgroup + workdir tmpfs) vs per process, profile=boundary, {runs} runs:")
    for what, samples in took.items():
        for label, values in samples.items():
            print("  " + describe(f"{what} {label}", values))


def egress_cost(runs: int) -> None:
    """The boundary profile without a network and with an egress allowlist (its proxy in the
    task, its forwarder in the sandbox before each command), interleaved so both share the same
    load: what the allowlist adds to a command's start and to its kill (stop() and scope.cancel())."""
    policy = EgressPolicy(["pypi.org"])
    setups: dict[str, bool | EgressPolicy] = {"no network": False, "allowlist": policy}
    took: dict[str, list[float]] = {label: [] for label in setups}
    kills: dict[tuple[str, bool], list[tuple[float, float]]] = {
        (label, via_scope): [] for label in setups for via_scope in (False, True)
    }
    boxes = {label: LocalSandbox(isolation="namespace", network=network) for label, network in setups.items()}
    try:
        for _ in range(runs):
            for label, box in boxes.items():
                took[label].append(box.run("true").duration)
            for (label, via_scope), samples in kills.items():
                samples.append(one_run("namespace", via_scope, "boundary", setups[label]))
    finally:
        for box in boxes.values():
            box.destroy()
    print(f"profile=boundary, no network vs egress allowlist, interleaved, {runs} runs:")
    for label in setups:
        print(f"  {label}:")
        print("    run('true')    " + describe("start", took[label]))
        for via_scope in (False, True):
            results = kills[(label, via_scope)]
            how = "scope.cancel()" if via_scope else "stop()"
            print(f"    {how:<15}" + describe("gone", [g for g, _ in results]))


def hostile_table() -> None:
    """Run ``_sandbox_task.py hostile`` and print each command's result and the kill latency."""
    root = Path(__file__).parents[1]
    secrets = Path(tempfile.mkdtemp(prefix="cancellable-agents-secrets-", dir="/var/tmp"))
    (secrets / "airflow").mkdir()
    (secrets / "airflow" / "airflow.cfg").write_text("[database]\nsql_alchemy_conn = secret\n")
    (secrets / "home" / ".aws").mkdir(parents=True)
    (secrets / "home" / ".aws" / "credentials").write_text("[default]\nkey = SECRET\n")
    secrets.chmod(0o755)
    marker = f"38{uuid.uuid4().int % 10:d}.{uuid.uuid4().int % 10**9:09d}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    script = root / "tests" / "process" / "_sandbox_task.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "hostile", marker, str(secrets), "namespace"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline().removeprefix("READY "))
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        while set(marker_processes(marker)) - {proc.pid}:  # the task's own argv has the marker
            time.sleep(0.001)
        gone = time.monotonic() - started
        record = json.loads(proc.stdout.readline())
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(secrets, ignore_errors=True)
    print("hostile commands (boundary profile; result as the model reads it):")
    for name, result in ready["results"].items():
        said = (
            result.get("killed_by") or result["stderr"].strip().splitlines() or [result["stdout"].strip()]
        )[-1]
        print(f"  {name:<26} exit {result['exit_code']:>4}  {result['seconds'] * 1000:6.0f} ms  {said[:70]}")
        print(f"  {'':<26} stdout: {result['stdout'].strip()[:70]!r}")
    print(
        f"  all {len(ready['results'])} running ({ready['sleepers']} sleeps), SIGTERM -> all gone: "
        f"{gone * 1000:.0f} ms; listener connections: {record['accepted']}; "
        f"stragglers: {record['summary']['stragglers']}; zombies: {record['zombies']}"
    )


if __name__ == "__main__":
    main()
