"""The /proc and signal helpers (``procs/_proc.py``) against real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cancellable_agents.procs._proc import ProcKey, read_proc, reap_zombie
from tests.process.trees import eventually

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "pid"])
def test_reap_zombie_collects_exactly_that_exited_child(
    pidfd: bool, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pidfd:
        monkeypatch.setattr("cancellable_agents.procs._proc._pidfd_open", lambda pid: None)

    def zombie(proc: subprocess.Popen[bytes]) -> ProcKey:
        info = eventually(lambda: (i := read_proc(proc.pid)) is not None and i.exited and i)
        return ProcKey(proc.pid, info.start)

    running = subprocess.Popen(["sleep", marker])
    exited = subprocess.Popen(["sh", "-c", "exit 5"])
    try:
        key = zombie(exited)
        assert reap_zombie(ProcKey(key.pid, key.start + 1)) is None, "another start time: not that process"
        assert read_proc(key.pid) is not None, "a process with another identity was reaped"
        assert reap_zombie(key) == 5
        assert read_proc(key.pid) is None and reap_zombie(key) is None
        info = read_proc(running.pid)
        assert info is not None
        assert reap_zombie(ProcKey(running.pid, info.start)) is None, "a running process was reaped"
        running.kill()
        assert reap_zombie(zombie(running)) == -signal.SIGKILL
    finally:
        for proc in (running, exited):
            if proc.poll() is None:  # not reaped above: the test failed early
                proc.kill()
                proc.wait(10)


#: A child that starts a thread, runs ``what`` (Python source), starts another, and prints the nice
#: value of each of its threads.
_NICE_CHILD = """
import json, os, sys, threading
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.procs._proc import lower_priority
from cancellable_agents.airflow.kill_record._task_log import yield_cpu_if_evicted
hold = threading.Event()
before = threading.Thread(target=hold.wait, args=(30,)); before.start()
{what}
after = threading.Thread(target=hold.wait, args=(30,)); after.start()
print(json.dumps(sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))))
hold.set()
"""


def _nice_of_threads(what: str) -> set[int]:
    """The nice values of the child's threads (the one it inherits from us, unless lowered)."""
    code = _NICE_CHILD.format(what=what)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    return set(json.loads(done.stdout))


#: This process's nice value, which a child starts with.
OURS = os.getpriority(os.PRIO_PROCESS, 0)


def test_lower_priority_lowers_every_thread_and_never_raises_it_back() -> None:
    assert _nice_of_threads("lower_priority(10)") == {max(OURS, 10)}
    assert _nice_of_threads("lower_priority(12); lower_priority(5)") == {max(OURS, 12)}


@pytest.mark.parametrize(("cause", "nice"), [("EVICTION", max(OURS, 10)), ("USER", OURS), ("TIMEOUT", OURS)])
def test_only_an_evicted_task_yields_the_cpu_once_unwound(cause: str, nice: int) -> None:
    """A worker shutdown stops all its tasks at once: those done yield to those still unwinding.
    A user's stop leaves the task beside others that keep running: it keeps its share."""
    what = (
        f"scope = TaskCancellation(); scope.cancel(CancelCause.{cause}); scope.wait_released(5); "
        "yield_cpu_if_evicted(scope)"
    )
    assert _nice_of_threads(what) == {nice}
