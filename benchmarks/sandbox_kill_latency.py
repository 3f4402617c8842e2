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
the same user, ``no_new_privs``, the container runtime's default seccomp profile; no cgroup, no tmpfs), and
prints their rows beside (measured after the root rows, so under the load of that moment).

``--before REV`` adds Landlock mode as it was at git revision ``REV`` (a helper that execs
the command, no init keeping its tree) to the interleaved rows: what the init costs per command
against it and against namespace mode, side by side. ``--totals`` measures the sandbox's own count
of its totals (no cgroup, no tmpfs): how long after a fork storm, a memory hog and a disk fill
pass their limit the command is killed, and the share of a core the watcher costs.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/sandbox_kill_latency.py [--runs 20] [--hostile] [--pod]
[--before REV] [--totals]``
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
from collections.abc import Callable, Iterator
from pathlib import Path

from cancellable_agents.core._once import Once
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.procs._proc import all_pids, command_line, read_proc
from cancellable_agents.toolsets.sandbox import EgressPolicy, LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import landlock_support

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


#: The profile name of Landlock mode as it was before its init (``--before REV``).
BEFORE_INIT = "before-init"


@contextlib.contextmanager
def landlock_as_of(rev: str | None, profile: str) -> Iterator[None]:
    """For ``profile == BEFORE_INIT``: commands start under the helper of revision ``rev``
    (no init, no kill report), as Landlock mode ran before its init; else nothing changes."""
    if profile != BEFORE_INIT or rev is None:
        yield
        return
    from unittest import mock

    from cancellable_agents.toolsets.sandbox.local.boundary import _landlock as landlock

    path = "src/cancellable_agents/toolsets/sandbox/local/boundary/landlock.py"
    text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    helper = text.split('HELPER = """', 1)[1].split('""".replace', 1)[0].replace("BOUNDARY_FAILED", "125")

    def helper_argv(python: str, ruleset: object, seccomp_fd: int | None, **_: object) -> list[str]:
        seccomp = -1 if seccomp_fd is None else seccomp_fd
        return [python, "-I", "-S", "-c", helper, str(ruleset.fd), str(seccomp), str(os.getpid()), "--"]  # type: ignore[attr-defined]

    with (
        mock.patch.object(landlock, "init_argv", helper_argv),
        mock.patch.object(LocalSandbox, "_kill_report", lambda self: None),
    ):
        yield


def sandbox_for(mode: str, profile: str, **options: object) -> LocalSandbox:
    real = "boundary" if profile == BEFORE_INIT else profile
    return LocalSandbox(isolation=mode, profile=real, **options)  # type: ignore[arg-type]


def label_of(mode: str, profile: str) -> str:
    if profile == BEFORE_INIT:
        return "landlock, before its init"
    return f"{mode}, profile={profile}" if mode == "namespace" else mode


def one_run(
    mode: str, via_scope: bool, profile: str, network: bool | EgressPolicy = False
) -> tuple[float, float]:
    """Return (seconds until the tree was gone, seconds until the stop call returned)."""
    marker = f"39{uuid.uuid4().int % 10:d}.{uuid.uuid4().int % 10**9:09d}"
    scope = TaskCancellation("bench", budget=4.0)
    box = sandbox_for(mode, profile, scope=scope, stop_grace=1.0, network=network)
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
    parser.add_argument("--before", metavar="REV", help="also Landlock mode as of git revision REV")
    parser.add_argument("--totals", action="store_true", help="also the sandbox's own count of its totals")
    args = parser.parse_args()
    # The process-group rows would print the "not a boundary" warning once per run.
    logging.getLogger("cancellable_agents.toolsets.sandbox.local._isolation").setLevel(logging.ERROR)
    logging.getLogger("cancellable_agents.toolsets.sandbox.local").setLevel(logging.ERROR)
    support = bwrap_support()
    setups = [("process-group", "boundary")]
    if landlock_support().usable:
        setups[:0] = [("landlock", "boundary")] + ([("landlock", BEFORE_INIT)] if args.before else [])
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
                with landlock_as_of(args.before, setup[1]):
                    samples[setup].append(one_run(setup[0], via_scope, setup[1]))
        for (mode, profile), results in samples.items():
            label = label_of(mode, profile)
            summary.setdefault(label, {})[how] = [g for g, _ in results]
            print(f"{label} / {how}, {args.runs} runs:")
            print("  " + describe("gone", [g for g, _ in results]))
            print("  " + describe("returned", [r for _, r in results]))
    print(f"run('true') end to end (what a profile costs per command), {args.runs} runs:")
    boxes = {setup: sandbox_for(*setup) for setup in setups}
    took_by: dict[tuple[str, str], list[float]] = {setup: [] for setup in setups}
    try:
        for _ in range(args.runs):  # interleaved, as the kills
            for setup, box in boxes.items():
                with landlock_as_of(args.before, setup[1]):
                    took_by[setup].append(box.run("true").duration)
    finally:
        for box in boxes.values():
            box.destroy()
    for (mode, profile), took in took_by.items():
        label = label_of(mode, profile)
        summary[label]["true"] = took
        ms = [t * 1000 for t in took]
        print(f"  {label:<28} median {statistics.median(ms):7.1f} ms   max {max(ms):7.1f} ms")
    where = {
        "pod": "restricted pod (uid 50000, the runtime's default seccomp profile)",
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
    if args.totals and landlock_support().usable:
        totals_cost(args.runs)


#: Commands that pass a limit and print when they did (CLOCK_MONOTONIC, shared by every process).
PAST_THE_LIMIT = {
    "max_processes": (
        "import subprocess, time\nkids = [subprocess.Popen(['sleep', '60']) for _ in range(40)]\n"
        "print(time.monotonic(), flush=True)\ntime.sleep(60)"
    ),
    "memory_bytes": (
        "import subprocess, sys, time\n"
        "kid = 'b = bytearray(100 * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
        "print(1, flush=True)\\nimport time; time.sleep(60)'\n"
        "kids = [subprocess.Popen([sys.executable, '-c', kid], stdout=subprocess.PIPE) for _ in range(3)]\n"
        "[k.stdout.readline() for k in kids]\nprint(time.monotonic(), flush=True)\ntime.sleep(60)"
    ),
    "workdir_bytes": (
        "import time\nfor i in range(40):\n    open(f'f{i}', 'wb').write(bytes(2**20))\n"
        "print(time.monotonic(), flush=True)\ntime.sleep(60)"
    ),
}


def totals_cost(runs: int) -> None:
    """Landlock mode without a cgroup or a tmpfs (as in an unprivileged pod): the reaction time
    from a total passing its limit (the command prints when) to the command's end, and the
    watcher's CPU with ten idle processes in the sandbox, against the same sandbox unwatched."""
    import resource
    from unittest import mock

    from cancellable_agents.toolsets.sandbox import Limits
    from cancellable_agents.toolsets.sandbox.local import _sandbox as sandbox_module
    from cancellable_agents.toolsets.sandbox.local.boundary import _cgroups as cgroups

    off = cgroups.CgroupSupport(None, reason="off for the benchmark")
    limits = Limits(max_processes=32, memory_bytes=256 * 2**20, workdir_bytes=16 * 2**20)
    reaction: dict[str, list[float]] = {limit: [] for limit in PAST_THE_LIMIT}
    with (
        mock.patch.object(cgroups, "cgroup_support", lambda: off),
        mock.patch.object(sandbox_module, "mount_workdir", lambda folder, size: False),
    ):
        for _ in range(runs):
            for limit, script in PAST_THE_LIMIT.items():
                box = LocalSandbox(isolation="landlock", limits=limits)
                try:
                    result = box.run([sys.executable, "-c", script], timeout=60)
                    ended = time.monotonic()
                finally:
                    box.destroy()
                if result.limit_exceeded != limit or not result.stdout.strip():
                    print(f"  {limit}: not killed at its limit as expected: {result}")
                    continue
                reaction[limit].append(ended - float(result.stdout.split()[0]))
        cpu: dict[str, list[float]] = {"watched": [], "unwatched": []}
        for _ in range(max(3, runs // 5)):
            for label, box_limits in (
                ("watched", limits),
                (
                    "unwatched",
                    Limits(max_processes=None, memory_bytes=None, workdir_bytes=None, tmp_bytes=None),
                ),
            ):
                box = LocalSandbox(isolation="landlock", limits=box_limits)
                try:
                    box.start("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 60 & done; wait")
                    time.sleep(0.5)
                    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                    time.sleep(2.0)
                    after, took = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
                finally:
                    box.destroy()
                used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                cpu[label].append(used / took)
    print(f"sandbox totals without a cgroup (landlock), {runs} runs: limit passed -> command ended")
    for limit, samples in reaction.items():
        if samples:
            print("  " + describe(limit, samples))
    for label, shares in cpu.items():
        share = statistics.median(shares) * 100
        print(f"  task CPU, 10 idle processes, {label}: median {share:.2f} % of a core")


def filter_cost(runs: int) -> None:
    """run('true') in the boundary profile with and without the seccomp filter, interleaved so
    both share the same load: what the filter adds to each command's start."""
    from unittest import mock

    from cancellable_agents.toolsets.sandbox.local.boundary import _seccomp as seccomp

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
    from cancellable_agents.toolsets.sandbox.local.boundary import _cgroups as cgroups

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
