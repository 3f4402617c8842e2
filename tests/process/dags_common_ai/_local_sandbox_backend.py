"""A common.ai ``SandboxBackend`` that runs each sandbox as a local process tree (for tests).

common.ai's remote backends (Modal, sbx, ...) cannot run here; this one implements the same
protocol with real processes: ``create`` makes a working directory, ``run_command`` starts
``bash -c COMMAND`` as the leader of a new session there, ``destroy`` terminates every session
the sandbox started (SIGTERM, then SIGKILL after ``KILL_AFTER`` seconds) and removes the
directory. It reports ``destroy_started``/``destroy_finished`` through ``emit`` so a test can see
that the teardown ran, and when. Not a security boundary: it enforces no network policy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from airflow.providers.common.ai.sandbox.base import SandboxBackend, SandboxExecResult, SandboxSpec

KILL_AFTER = 1.0


class LocalProcessSandboxBackend(SandboxBackend):
    name: ClassVar[str] = "local-process"

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._procs: dict[str, list[subprocess.Popen[bytes]]] = {}  # guarded by _lock

    def __deepcopy__(self, memo: dict[int, Any]) -> LocalProcessSandboxBackend:
        return self  # one backend per task process; the toolset copies itself per run

    def create(self, *, spec: SandboxSpec | None = None) -> str:
        handle = tempfile.mkdtemp(prefix="local-sandbox-")
        with self._lock:
            self._procs[handle] = []
        self._emit("sandbox_created", handle=handle)
        return handle

    def run_command(
        self, sandbox: str, command: str, *, timeout: float, max_output_bytes: int
    ) -> SandboxExecResult:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=sandbox,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        with self._lock:
            self._procs.setdefault(sandbox, []).append(proc)
        self._emit("sandbox_command_started", pid=proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            out, err = proc.communicate()
            return SandboxExecResult(exit_code=-1, stdout="", stderr="", timed_out=True)
        return SandboxExecResult(
            exit_code=proc.returncode,
            stdout=out[:max_output_bytes].decode(errors="replace"),
            stderr=err[:max_output_bytes].decode(errors="replace"),
        )

    def destroy(self, sandbox: str) -> None:
        self._emit("destroy_started", handle=sandbox)
        with self._lock:
            procs = self._procs.pop(sandbox, [])
        for proc in procs:
            _kill_session(proc)
        shutil.rmtree(sandbox, ignore_errors=True)
        self._emit("destroy_finished", handle=sandbox, pids=[p.pid for p in procs])


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the command's session (it leads its own group), SIGKILL it if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_AFTER
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
