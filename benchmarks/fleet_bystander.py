"""A bystander of the fleet benchmark: how long the machine kept a sleeping process from a CPU.

``benchmarks/fleet.py`` starts it in a session of its own, so that the kernel's autogroup
scheduling (on where ``/proc/sys/kernel/sched_autogroup_enabled`` is 1, as here) treats it as it treats
each Airflow component, which also runs in a session of its own. It sleeps ``TICK_S`` at a time
and writes one line per wake: when (``at``), how much later than asked it woke (``late_ms``), and
the API server's run-queue wait so far (``api_wait_ns``: the second field of
``/proc/PID/task/TID/schedstat``, the time a thread was runnable but not running, summed over the
threads of the API server's process and of its worker processes; a thread's wait counts from the
first wake that saw it, and stays in the sum after the thread ends).

A heartbeat slow while the bystander woke late was slowed by the machine (every process waited
for a core), not by what the API server was asked; the API server's wait says how much of its
requests' time was spent waiting for a core rather than served.

``python -m benchmarks.fleet_bystander OUT API_PID``: runs until the API server's process ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TICK_S = 0.1


class RunQueueWait:
    """The run-queue wait of every thread of a process and of its children, added up from wake
    to wake by thread, so that a thread that ends (the API server's idle worker threads do)
    takes nothing back."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.total_ns = 0
        self._seen: dict[int, int] = {}

    def update(self) -> bool:
        """Add what every thread waited since the last call; ``False`` once the process is gone."""
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            return False
        now: dict[int, int] = {}
        for pid in (self.pid, *map(int, children)):
            now.update(_threads_wait_ns(pid))
        for tid, wait_ns in now.items():
            self.total_ns += max(0, wait_ns - self._seen.get(tid, wait_ns))
        self._seen = now
        return True


def _threads_wait_ns(pid: int) -> dict[int, int]:
    """Each live thread of ``pid``: its run-queue wait so far, by thread id."""
    found: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            found[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended since the list was read
    return found


def main(out: Path, api_pid: int) -> None:
    wait = RunQueueWait(api_pid)
    with out.open("a", buffering=1) as lines:
        last = time.monotonic()
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            late_ms, last = (now - last - TICK_S) * 1000, now
            if not wait.update():
                return
            wake = {"at": time.time(), "late_ms": round(late_ms, 1), "api_wait_ns": wait.total_ns}
            lines.write(json.dumps(wake) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
