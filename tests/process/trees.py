"""What a real-process test needs to find, and clean up, the process trees it started.

Long-running processes are ``sleep 3NN.<digits>`` with a per-test marker (the ``marker``
fixture in ``conftest.py``), so a survivor is found in /proc by that marker and, if a test
fails, SIGKILLed by pid without touching anyone else's processes. :class:`ChildTask` runs
``_sandbox_task.py MODE MARKER``: a task process of its own, to signal for real.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from cancellable_agents.toolsets.sandbox import bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import landlock_support
from cancellable_agents.toolsets.sandbox.local.boundary._seccomp import SocketRule, seccomp_filter

TASK_SCRIPT = Path(__file__).with_name("_sandbox_task.py")
SRC = Path(__file__).parents[2] / "src"


def landlock_usable() -> bool:
    """Whether ``isolation="landlock"`` works here (Landlock and the seccomp filter)."""
    return landlock_support().usable and seccomp_filter(SocketRule.UNIX_ONLY).program is not None


def landlock_reason() -> str:
    return landlock_support().reason or seccomp_filter(SocketRule.UNIX_ONLY).reason


NAMESPACE = pytest.param(
    "namespace",
    marks=pytest.mark.skipif(
        not bwrap_support().usable,
        reason=f"bubblewrap cannot create PID namespaces here: {bwrap_support().reason}",
    ),
)


LANDLOCK = pytest.param("landlock", marks=pytest.mark.skipif(not landlock_usable(), reason=landlock_reason()))
#: Every isolation mode, namespace mode skipped where bubblewrap cannot create PID namespaces,
#: landlock mode where the kernel has no Landlock or there is no seccomp filter.
MODES = [NAMESPACE, LANDLOCK, "process-group"]
NAMESPACE_BOUNDARY = pytest.param(
    "namespace",
    marks=pytest.mark.skipif(
        not bwrap_support().boundary,
        reason=f"no boundary profile here: {bwrap_support().boundary_reason or bwrap_support().reason}",
    ),
)
#: The modes that claim a boundary (namespace mode with the boundary profile, landlock mode).
BOUNDARY_MODES = [NAMESPACE_BOUNDARY, LANDLOCK]


def new_marker() -> str:
    """A unique ``sleep`` duration (300-400 s, so nothing it names ends during a test)."""
    return f"3{uuid.uuid4().int % 100:02d}.{uuid.uuid4().int % 10**9:09d}"


def eventually(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def survivors(marker: str, name: str | None = None) -> list[int]:
    """Pids of running (non-zombie) processes whose command line contains ``marker`` (and
    named ``name``)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if name is not None and proc.name() != name:
                continue
            if marker in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def sleepers(marker: str) -> list[int]:
    """The marker's ``sleep`` processes: the command really runs (not just its bwrap wrapper)."""
    return survivors(marker, name="sleep")


class ChildTask:
    """``_sandbox_task.py MODE MARKER`` with its stdout read line by line on a thread."""

    def __init__(self, mode: str, marker: str, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, str(TASK_SCRIPT), mode, marker, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"no output from the task within {timeout}s; stderr:\n{err}") from None

    def ready(self, timeout: float = 30.0) -> dict[str, Any]:
        line = self.next_line(timeout)
        assert line.startswith("READY "), line
        return json.loads(line[len("READY ") :])

    def result(self, timeout: float = 30.0) -> dict[str, Any]:
        record = json.loads(self.next_line(timeout))
        assert self.proc.wait(timeout) == 0
        return record

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
