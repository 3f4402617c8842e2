"""Supervisor loss is a kill: a task process whose Task SDK supervisor died stops itself.

The Task SDK runs each task in a child of a *supervisor* process (a LocalExecutor worker, or a
Celery prefork pool child) that forwards signals, heartbeats and carries every request and log
line. When the supervisor dies without killing the task first (SIGKILL or OOM of the worker,
Celery's ``REMAP_SIGTERM=SIGQUIT``, a crashed pool child), nothing ever signals the task
process: it is orphaned and the agent keeps calling the model and its tools, while the
scheduler's heartbeat timeout starts the next try beside it. Only the task process can notice.

[`watch_supervisor`][] (called from the mixin's ``pre_execute``) starts a daemon thread that
polls ``os.getppid()`` against the supervisor's pid every `SupervisorWatch.poll_interval`
(50 ms). A poll is portable (Linux and macOS) and cannot misfire; ``PR_SET_PDEATHSIG`` would
fire when the supervisor's *forking thread* exits, is Linux-only, and delivers a signal to the
main thread, which is the one blocked in the run. On loss the watch:

1. cancels the scope as ``EVICTION`` with detail ``supervisor lost``, decided locally (a cause
   query would go through the dead supervisor);
2. waits for the unwind (sandboxes, the descendant reaper, sub-agents) within the budget;
3. writes the record as one ``cancellable_agents.record`` JSON line to stderr and to a local
   file ([`fallback_record_path`][]), because the log channel went with the supervisor;
4. exits the process with ``os._exit``: nobody is left to report a state to, and the
   scheduler's ``task_instance_heartbeat_timeout`` decides the retry.

Steps 1-4 run on a non-daemon thread that an ``atexit`` hook joins, so a main thread that
reaches the exit first still waits for the record. After any other cancel,
[`notice_exit_at_once`][] makes the supervisor see the task's exit at once. The watch stops by
itself once the run settled otherwise (completed or failed). Under ``dag.test()`` or without a
Task SDK supervisor it is not started.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import Outcome, TaskCancellation

log = logging.getLogger(__name__)

#: The cause detail a supervisor loss records.
SUPERVISOR_LOST = "supervisor lost"
#: Exit status of a task process that stopped itself after losing its supervisor (EX_TEMPFAIL).
EXIT_SUPERVISOR_LOST = 75
#: How long the watch waits, after the unwind, for the main thread to settle the run's outcome.
_SETTLE_WAIT = 0.5
#: Longest a lingering exit helper outlives the task process (it normally lingers microseconds).
_LINGER_MAX = 10.0
_linger_lock = threading.Lock()
_linger_registered = False  # guarded by _linger_lock


@dataclass(frozen=True)
class TaskIdentity:
    """Which try of which task instance this process runs (names the fallback record file)."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 0

    @classmethod
    def from_context(cls, context: Any) -> TaskIdentity | None:
        ti = context.get("ti") if hasattr(context, "get") else None
        if ti is None:
            return None
        map_index = getattr(ti, "map_index", None)
        return cls(
            str(ti.dag_id),
            str(ti.run_id),
            str(ti.task_id),
            -1 if map_index is None else int(map_index),
            int(getattr(ti, "try_number", 0) or 0),
        )


def records_root(airflow_home: str | None = None) -> Path:
    """``$AIRFLOW_HOME/cancellable_agents/records``, or under the temp dir if AIRFLOW_HOME is unset."""
    home = airflow_home if airflow_home is not None else os.environ.get("AIRFLOW_HOME")
    base = Path(home) if home else Path(tempfile.gettempdir())
    return base / "cancellable_agents" / "records"


def fallback_record_path(task: TaskIdentity, root: Path | None = None) -> Path:
    """``<root>/<dag_id>/<run_id>/<task_id>[_<map_index>]/<try_number>.json`` (root: [`records_root`][])."""
    task_dir = task.task_id if task.map_index < 0 else f"{task.task_id}_{task.map_index}"
    parts = [_safe(task.dag_id), _safe(task.run_id), _safe(task_dir)]
    return (root or records_root()).joinpath(*parts, f"{task.try_number}.json")


def _safe(name: str) -> str:
    """A path component that cannot climb out of the records directory."""
    cleaned = name.replace(os.sep, "_").replace("\0", "_")
    return "_" if cleaned in ("", ".", "..") else cleaned


# -- detecting the supervisor ---------------------------------------------------------------


def supervisor_pid() -> int | None:
    """The pid of this process's Task SDK supervisor, or ``None`` if there is none to watch.

    There is one when the Task SDK's comms channel is a socket (``task_runner.main`` set it up;
    ``dag.test()`` uses an in-process channel without one) and our parent is at the other end
    of it (``SO_PEERCRED`` on Linux; elsewhere the parent is taken to be the supervisor).
    """
    runner = sys.modules.get("airflow.sdk.execution_time.task_runner")
    comms = getattr(runner, "SUPERVISOR_COMMS", None)
    sock = getattr(comms, "socket", None)
    if not isinstance(sock, socket.socket):
        return None
    parent = os.getppid()
    if parent <= 1:
        return None  # already orphaned, or the parent is outside our PID namespace
    peer = _peer_pid(sock)
    if peer is not None and peer != parent:
        log.debug("the Task SDK comms peer (pid %s) is not our parent (%s); not watching", peer, parent)
        return None
    return parent


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid that created the other end of a Unix socket (Linux), else ``None``."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    pid = int(struct.unpack("3i", raw)[0])
    return pid or None


# -- the watch -------------------------------------------------------------------------------


class SupervisorWatch:
    """Polls for the loss of the supervisor; on loss, unwinds ``scope``, records and exits.

    :param scope: the task's scope.
    :param supervisor: the pid whose death means the task lost its supervisor (our parent).
    :param record_path: where the record is written besides stderr.
    :param exit: how the process ends after the record (``os._exit``; tests pass their own).
    """

    #: Seconds between two ``getppid()`` polls: the loss is noticed within this.
    poll_interval = 0.05

    def __init__(
        self,
        scope: TaskCancellation,
        supervisor: int,
        record_path: Path,
        *,
        exit: Callable[[int], Any] = os._exit,
        parent: Callable[[], int] = os.getppid,
    ) -> None:
        self.scope = scope
        self.supervisor = supervisor
        self.record_path = record_path
        self._exit = exit
        self._parent = parent
        self._stopped = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cancellable-agents-supervisor", daemon=True)

    def start(self) -> SupervisorWatch:
        self.scope.record("supervisor_watched", supervisor_pid=self.supervisor)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the run ended normally). Idempotent."""
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            if self.scope.outcome in (Outcome.COMPLETED, Outcome.FAILED):
                return  # settled without a kill: the Task SDK reports it the usual way
            now = self._parent()
            if now != self.supervisor:
                self.lost.set()
                # A main thread that reaches the exit first must wait for the record: Python joins
                # non-daemon threads at exit, and the Task SDK's forked task process (which ends
                # with os._exit) runs the atexit hooks registered after its fork.
                worker = threading.Thread(
                    target=self._on_lost, args=(now,), name="cancellable-agents-supervisor-lost"
                )
                worker.start()
                atexit.register(worker.join, self.scope.budget + 1.0)
                return

    def _on_lost(self, new_parent: int) -> None:
        code = EXIT_SUPERVISOR_LOST
        try:
            self._unwind(new_parent)
            self._write_record()
        except BaseException as exc:  # never keep an orphan alive because of a bug here
            _write_stderr(f"cancellable_agents: supervisor lost; unwinding failed: {exc!r}\n")
            code = 1
        finally:
            self._exit(code)

    def _unwind(self, new_parent: int) -> None:
        scope = self.scope
        scope.record("supervisor_lost", supervisor_pid=self.supervisor, new_parent=new_parent)
        if not scope.cancel(CancelCause.EVICTION, detail=SUPERVISOR_LOST):
            # Already being cancelled (a SIGTERM came first): its cause query went through the
            # supervisor and will not answer; what is known locally decides, if nothing has yet.
            scope.decide_cause(CancelCause.EVICTION, SUPERVISOR_LOST)
        scope.wait_released(scope.remaining())
        deadline = time.monotonic() + min(_SETTLE_WAIT, scope.remaining())
        while scope.outcome is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_record(self) -> None:
        record = self.scope.summary()
        record["supervisor"] = {"pid": self.supervisor, "lost": True, "record_path": str(self.record_path)}
        line = RECORD_PREFIX + json.dumps(record, default=str, sort_keys=True)
        _write_file(self.record_path, line + "\n")
        # Usually a socket to the dead supervisor (EPIPE); a real stderr elsewhere.
        _write_stderr(line + "\n")


def _write_file(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _write_stderr(text: str) -> None:
    with contextlib.suppress(Exception):
        os.write(2, text.encode("utf-8", "replace"))


def watch_supervisor(scope: TaskCancellation, context: Any) -> SupervisorWatch | None:
    """Start watching this task process's supervisor, if it runs under one (see the module doc)."""
    task = TaskIdentity.from_context(context)
    pid = supervisor_pid()
    if task is None or pid is None:
        return None
    return SupervisorWatch(scope, pid, fallback_record_path(task)).start()


# -- a prompt exit, seen by the supervisor at once -----------------------------------------------


def notice_exit_at_once() -> None:
    """Make the supervisor see this task process's exit the moment it is complete (once per process).

    The Task SDK supervisor waits in ``select`` on the task's sockets and only then asks whether
    the process exited (``waitpid(WNOHANG)``). The sockets close during the exit, a moment
    *before* the process can be reaped; when the woken supervisor wins that race it finds the
    process still there and, with no socket left to wake it, sleeps until its next heartbeat
    or kill deadline: a cancelled task counts as running for 5 s more (measured: 3 of 3
    evictions under Celery, and a Clear at the edge of the SIGKILL). So at exit a tiny forked
    helper keeps the task's stdout socket open until the kernel reports the whole task process
    gone (a pidfd), then exits: the supervisor's last EOF arrives after the process is reapable.
    (The helper is reparented to init when we exit, which reaps it.)
    Linux 5.3+ only; elsewhere, and without a Task SDK supervisor, nothing is done.
    """
    global _linger_registered
    if not hasattr(os, "pidfd_open") or supervisor_pid() is None:
        return
    with _linger_lock:
        if _linger_registered:
            return
        _linger_registered = True
    atexit.register(_linger_until_reaped)


def _linger_until_reaped() -> None:
    """At exit: start the helper that holds fd 1 (a socket to the supervisor) until we are gone.

    Exec'd, not merely forked: a forked copy of this multi-threaded interpreter can hang on a
    lock another thread held (measured: then the supervisor waited the full 5 s after all).
    """
    try:
        if not stat.S_ISSOCK(os.fstat(1).st_mode):
            return
        argv = [sys.executable, "-S", "-I", "-c", _LINGER_SCRIPT, str(os.getpid()), str(_LINGER_MAX)]
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    except (OSError, ValueError):
        return


#: The helper: wait (bounded) until the task process has fully exited, then end.
_LINGER_SCRIPT = (
    "import os, select, sys\n"
    "try:\n"
    "    pidfd = os.pidfd_open(int(sys.argv[1]))\n"
    "except OSError:\n"
    "    sys.exit()\n"
    "select.select([pidfd], [], [], float(sys.argv[2]))\n"
)
