"""The /proc and signal helpers (``procs/_proc.py``) against real processes."""

from __future__ import annotations

import signal
import subprocess

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
