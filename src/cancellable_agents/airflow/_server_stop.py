"""Why the supervisor stopped us, from what its heartbeat already learned: no round trip.

A user's *Mark failed* / *Mark success* / *Clear* reaches a task only through its supervisor's
heartbeat: the API server answers 409 (``not_running`` with the ``current_state``) or 404/410
(``not_found``: the try was cleared and archived), and the Task SDK supervisor then logs
`SERVER_STOP_EVENT` with that answer's ``detail`` to the try's log file (structlog's JSON
lines, written and flushed) and only *then* sends SIGTERM (Airflow 3.1-3.3,
``ActivitySubprocess._send_heartbeat_if_needed``). So when our SIGTERM handler runs, the cause
is already on the local disk, in a file the task process has open (inherited from the
supervisor, which opened it before forking us). Reading its tail costs microseconds and cannot
queue behind other tasks' requests at a busy API server, which a ``get_task_states`` round trip
does: at 16 concurrent durable tasks that query took ~300 ms and, on a slower server, would
outlast ``classify_timeout`` and turn a user's stop into ``unknown``.

No such line in the try's log means the SIGTERM came another way while the server still runs
this try: the supervisor forwarding a worker shutdown, or giving up on a server it cannot reach
(too many failed heartbeats). That is what the server's ``running`` says today (``eviction``), so
it is decided locally too, but only where the installed supervisor is known to log that line
(its source is checked once, [`supervisor_logs_server_stops`][]): a later Airflow that words it
otherwise makes us ask the server, never misread a user's stop as an eviction. Without a log file
to read, or for ``running_elsewhere`` (another host/pid holds the try), [`server_stop_verdict`][]
returns ``None`` and the caller asks the server as before.

Where the log files are, and whether their silence decides, is looked up once when the try
starts ([`LocalEvidence.gather`][]): at the SIGTERM only the file's tail is read, on the signal's
own thread, so the cause is decided within a few milliseconds of the kill even when 32 task
processes unwind at once on two cores (a thread started to look it up could wait past the
classifier's 1 s budget for a core: 4 of 32 evictions were ``unknown`` that way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cancellable_agents.airflow._adapter import verdict_for_state
from cancellable_agents.airflow._supervisor import supervisor_pid
from cancellable_agents.core.causes import CauseSource, CauseVerdict

#: The supervisor's log event just before it SIGTERMs a task the server no longer runs.
SERVER_STOP_EVENT = "Server indicated the task shouldn't be running anymore. Terminating process"
#: How much of the log file's end is read: the event precedes our SIGTERM by microseconds, so
#: only the lines the task logged since (its own kill messages) can follow it.
TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class LocalEvidence:
    """Where this try's cause can be read on local disk, looked up before any kill."""

    #: This try's log file(s); none: only the server can tell.
    log_files: tuple[Path, ...]
    #: Whether a log without a refused heartbeat means ``eviction`` (the installed supervisor
    #: logs every refusal before it signals).
    absence_decides: bool

    @classmethod
    def gather(cls) -> LocalEvidence:
        """This process's evidence: its try's open log files ([`open_task_logs`][]) and what the
        installed supervisor logs ([`supervisor_logs_server_stops`][])."""
        return cls(tuple(open_task_logs()), supervisor_logs_server_stops())

    def verdict(self) -> CauseVerdict | None:
        """The cause of this SIGTERM from the log's tail (source ``task log``), or ``None`` if
        only the server can tell. Reads one file's end: safe and quick in a signal handler."""
        if not self.log_files:
            return None
        for path in self.log_files:
            entry = last_server_stop(path)
            if entry is _UNREADABLE:
                return None
            if entry is not None:
                found = verdict_for_detail(entry.get("detail"))
                return None if found is None else _from_task_log(found)
        return _from_task_log(verdict_for_state("running")) if self.absence_decides else None


def _from_task_log(verdict: CauseVerdict) -> CauseVerdict:
    return dataclasses.replace(verdict, source=CauseSource.TASK_LOG)


def server_stop_verdict(
    log_files: Iterable[Path] | None = None, *, absence_decides: bool | None = None
) -> CauseVerdict | None:
    """The cause of this SIGTERM from the try's log file (see the module doc), or ``None`` if
    only the server can tell.

    :param log_files: where to look; by default this try's log file(s) found among the open
        files of this process and of its supervisor ([`open_task_logs`][]).
    :param absence_decides: whether a log without a refused heartbeat means ``eviction``; by
        default where the installed supervisor logs one ([`supervisor_logs_server_stops`][]).
    """
    files = tuple(open_task_logs() if log_files is None else log_files)
    if absence_decides is None:
        absence_decides = bool(files) and supervisor_logs_server_stops()
    return LocalEvidence(files, absence_decides).verdict()


@functools.cache
def supervisor_logs_server_stops() -> bool:
    """Whether the installed Task SDK supervisor logs `SERVER_STOP_EVENT` for *every*
    answer that means the server no longer runs the try, before it signals (Airflow 3.2-3.3;
    pinned by tests/unit/test_server_stop.py against the real code). 3.1's supervisor counts a
    410 (a newer server's answer after a Clear) as a failed heartbeat and, after enough of them,
    signals without the line: there the server is asked."""
    spec = importlib.util.find_spec("airflow.sdk.execution_time.supervisor")
    if spec is None or spec.origin is None:
        return False
    try:
        source = Path(spec.origin).read_text(errors="replace")
    except OSError:
        return False
    return SERVER_STOP_EVENT in source and "HTTPStatus.GONE" in source


def verdict_for_detail(detail: Any) -> CauseVerdict | None:
    """Map a refused heartbeat's ``detail`` to a cause (``None``: not a state this can decide)."""
    if isinstance(detail, dict) and isinstance(detail.get("detail"), dict):
        detail = detail["detail"]  # an error body the client did not unwrap
    if not isinstance(detail, dict):
        return None
    reason = detail.get("reason")
    if reason == "not_running":
        state = detail.get("current_state")
        return verdict_for_state(None if state is None else str(state))
    if reason == "not_found":  # 404, or 410 Gone: the try was cleared and archived
        return verdict_for_state(None)
    return None


#: What `last_server_stop` returns for a file it could not read (nothing can be told).
_UNREADABLE: dict[str, Any] = {}


def last_server_stop(path: Path) -> dict[str, Any] | None:
    """The last `SERVER_STOP_EVENT` log entry in the end of ``path``, or ``None`` if there
    is none (`_UNREADABLE` if the file cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return _UNREADABLE
    marker = SERVER_STOP_EVENT.encode()
    for line in reversed(tail.splitlines()):
        if marker not in line:
            continue
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") == SERVER_STOP_EVENT:
                return entry
    return None


def open_task_logs(pids: Iterable[str] | None = None) -> list[Path]:
    """This try's log files: regular files under ``[logging] base_log_folder`` open in this
    process (inherited from the supervisor) or, failing that, in the supervisor.

    :param pids: the ``/proc`` entries to look in, in order; by default ``self`` and the Task SDK
        supervisor's pid, and nothing at all without a supervisor (``dag.test()``: no heartbeat).
    """
    if pids is None:
        supervisor = supervisor_pid()
        pids = () if supervisor is None else ("self", str(supervisor))
    base = _base_log_folder()
    if base is None:
        return []
    for pid in pids:
        found = sorted(set(_open_files_under(pid, base)))
        if found:
            return found
    return []


def _open_files_under(pid: str, base: Path) -> Iterator[Path]:
    fd_dir = Path("/proc") / pid / "fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = Path(os.readlink(fd_dir / fd))
                if target.is_relative_to(base) and target.is_file():
                    yield target


def _base_log_folder() -> Path | None:
    try:
        from airflow.configuration import conf
    except ImportError:
        return None
    folder = conf.get("logging", "base_log_folder", fallback=None)
    return Path(folder).resolve() if folder else None
