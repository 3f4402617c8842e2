"""Kill -> tree-gone latency of LocalSandbox, per isolation mode (prints numbers; asserts nothing).

Each run starts ``sh -c 'setsid sleep M & (sleep M &) ; sleep M'`` (M a unique marker), waits
until the three sleeps run (and, in process-group mode, until the tracker has seen the setsid'd
one), then stops it two ways:

- ``stop()``: ``LocalSandbox.stop(command_id)`` called directly;
- ``scope.cancel()``: the task scope is cancelled (what ``on_kill`` does); the sandbox's
  IN_FLIGHT resource stops the command on the scope's helper thread.

"gone" is the time from the call until no process with the marker in its command line runs
(scanned every ~1 ms); "returned" is when ``stop()`` returned / the scope reported release.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/sandbox_kill_latency.py [--runs 20]``
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

from cancellable_agents.cancellation import TaskCancellation
from cancellable_agents.causes import CancelCause
from cancellable_agents.process_reaper import all_pids, command_line, read_proc
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support

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


def one_run(mode: str, via_scope: bool) -> tuple[float, float]:
    """Return (seconds until the tree was gone, seconds until the stop call returned)."""
    marker = f"39{uuid.uuid4().int % 10:d}.{uuid.uuid4().int % 10**9:09d}"
    scope = TaskCancellation("bench", budget=4.0)
    box = LocalSandbox(isolation=mode, scope=scope, stop_grace=1.0)  # type: ignore[arg-type]
    try:
        command = box.start(TREE.format(m=marker))
        wait_for(lambda: len(marker_processes(marker, "sleep")) == 3)
        if mode == "process-group":
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    support = bwrap_support()
    modes = ["namespace", "process-group"] if support.usable else ["process-group"]
    if not support.usable:
        print(f"namespace mode skipped: {support.reason}")
    for mode in modes:
        for via_scope in (False, True):
            results = [one_run(mode, via_scope) for _ in range(args.runs)]
            how = "scope.cancel()" if via_scope else "stop()"
            print(f"{mode} / {how}, {args.runs} runs:")
            print("  " + describe("gone", [g for g, _ in results]))
            print("  " + describe("returned", [r for _, r in results]))


if __name__ == "__main__":
    main()
