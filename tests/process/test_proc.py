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


#: A child that reports, at each stage, whether it has a child and whether the reaper's poll
#: walked /proc for it.
_CHILDREN_CHILD = """
import json, subprocess, threading, time
from cancellable_agents.procs import _reaper
from cancellable_agents.procs._proc import has_children, read_proc
walks = []
walk = _reaper.walk_descendants
_reaper.walk_descendants = lambda *a, **k: walks.append(1) or walk(*a, **k)
reaper = _reaper.DescendantReaper({{}})
seen = {{}}
def stage(name):
    before = len(walks)
    reaper._scan()
    seen[name] = [has_children(), len(walks) > before]
stage("none")
proc = subprocess.Popen(["sleep", "{marker}"])
stage("running")
proc.kill()
deadline = time.monotonic() + 10  # no event tells a zombie: /proc is read until it says so
while not read_proc(proc.pid).exited and time.monotonic() < deadline:
    time.sleep(0.01)
stage("zombie")
proc.wait()
stage("reaped")
box = []
forker = threading.Thread(target=lambda: box.append(subprocess.Popen(["sleep", "{marker}"])))
forker.start()
forker.join(10)
stage("forked by another thread")
box[0].kill(); box[0].wait()
print(json.dumps(seen))
"""


def test_a_process_without_children_is_polled_with_one_syscall_not_a_walk(marker: str) -> None:
    """``has_children`` sees a running child, an unreaped zombie and another thread's child; the
    reaper walks /proc only then (a run that starts no process costs its polls nothing else)."""
    code = _CHILDREN_CHILD.format(marker=marker)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "none": [False, False],
        "running": [True, True],
        "zombie": [True, True],
        "reaped": [False, False],
        "forked by another thread": [True, True],
    }
