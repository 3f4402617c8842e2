"""Find, stop and reap the processes a run left behind, and only those.

Airflow signals the task process (or its process group), never the grandchildren an agent's
tools started: a ``setsid``'d or double-forked child survives the task and keeps running on the
worker. :class:`DescendantReaper` closes that gap for a whole task process on Linux:

- it makes the task process a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), so orphans
  of the run are reparented to the task process instead of to PID 1 and stay findable;
- it snapshots the descendants that already exist when the run starts and never touches them
  (nor what they start): they belong to whoever started them;
- a daemon thread polls the process tree every ~50 ms while the run is active, so processes that
  later escape the tree (``setsid``, reparenting) are still known by pid and start time;
- on cancel (a ``Phase.TEARDOWN`` resource) or on :meth:`DescendantReaper.reap` it sends SIGTERM
  to everything the run started, SIGKILLs what is left inside the scope's budget, reaps the
  zombies reparented to the task process, and records each kill on the scope;
- orphans reparented to the task process are reaped as soon as they exit; only a zombie child
  this process may have forked itself is left a short ``owner_grace`` for its ``Popen`` to wait.

The low-level helpers (``read_proc``, ``walk_descendants``, ``terminate``, ``reap_zombie`` ...)
are shared with :mod:`cancellable_agents.toolsets.sandbox`. Every signal goes to a process
identified by pid *and* start time (through a pidfd where the kernel has one), so a recycled pid
is never signalled. Airflow-free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from cancellable_agents.core.record import KillRecord

if TYPE_CHECKING:
    from cancellable_agents.cancellation import ResourceHandle, TaskCancellation

log = logging.getLogger(__name__)

IS_LINUX = sys.platform.startswith("linux")
PR_SET_CHILD_SUBREAPER = 36
_PROC = Path("/proc")
#: Index of ``starttime`` among the fields of /proc/PID/stat that follow ``(comm)``.
_STARTTIME_FIELD = 19


# -- reading the process table --------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc (or psutil) sees it. ``start`` identifies it across pid reuse."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start: float
    state: str
    name: str

    @property
    def exited(self) -> bool:
        """Zombie or dead: it runs no code any more, only its exit status is left."""
        return self.state in ("Z", "X", "x")


@dataclass(frozen=True)
class ProcKey:
    """A process identity that survives pid reuse: pid plus start time."""

    pid: int
    start: float


def read_proc(pid: int) -> ProcInfo | None:
    """The process ``pid`` now, or ``None`` if there is none (or it cannot be read)."""
    if _PROC.is_dir():
        return _read_proc_stat(pid)
    return _read_psutil(pid)


def _read_proc_stat(pid: int) -> ProcInfo | None:
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes().decode("utf-8", "replace")
    except OSError:
        return None
    # comm may contain spaces and parentheses: it ends at the *last* ')'.
    left, _, rest = raw.rpartition(")")
    fields = rest.split()
    try:
        return ProcInfo(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            start=float(fields[_STARTTIME_FIELD]),
            state=fields[0],
            name=left.partition("(")[2],
        )
    except (IndexError, ValueError):
        return None


def _read_psutil(pid: int) -> ProcInfo | None:
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status = proc.status()
            return ProcInfo(
                pid=pid,
                ppid=proc.ppid(),
                pgid=os.getpgid(pid),
                sid=os.getsid(pid),
                start=proc.create_time(),
                state="Z" if status == psutil.STATUS_ZOMBIE else "R",
                name=proc.name(),
            )
    except (psutil.Error, OSError):
        return None


def all_pids() -> list[int]:
    """Every pid on the host (thread ids are not listed)."""
    if _PROC.is_dir():
        return [int(entry) for entry in os.listdir(_PROC) if entry.isdigit()]
    return psutil.pids()


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (of all its threads), without scanning the whole host.

    Uses /proc/PID/task/TID/children when the kernel has it; a child forked by a non-main
    thread is listed only under that thread.
    """
    tasks = _PROC / str(pid) / "task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return _children_psutil(pid)
    kids: list[int] = []
    for tid in tids:
        try:
            kids.extend(int(k) for k in (tasks / tid / "children").read_text().split())
        except FileNotFoundError:
            if tid == str(pid):  # no CONFIG_PROC_CHILDREN: fall back to a full scan
                return _children_psutil(pid)
        except (OSError, ValueError):
            continue
    return kids


def _children_psutil(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def walk_descendants(root: int, *, skip: Callable[[ProcInfo], bool] | None = None) -> dict[int, ProcInfo]:
    """All live-or-zombie descendants of ``root`` (not ``root`` itself).

    ``skip(info)`` excludes a process *and its subtree* (used for pre-existing processes).
    """
    found: dict[int, ProcInfo] = {}
    pending = children_of(root)
    while pending:
        pid = pending.pop()
        if pid in found or pid == root:
            continue
        info = read_proc(pid)
        if info is None or (skip is not None and skip(info)):
            continue
        found[pid] = info
        pending.extend(children_of(pid))
    return found


def is_running(key: ProcKey) -> bool:
    """Whether that very process (same start time) exists and is not yet a zombie."""
    info = read_proc(key.pid)
    return info is not None and info.start == key.start and not info.exited


def nested_pid_namespace(pid: int) -> bool:
    """Whether ``pid`` lives in a PID namespace below this process's (bubblewrap's namespace init
    does, as seen from outside). Unreadable: no."""
    depth = _pid_namespace_depth(pid)
    own = _pid_namespace_depth(os.getpid())
    return depth is not None and own is not None and depth > own


def _pid_namespace_depth(pid: int) -> int | None:
    """How many PID namespaces ``pid`` is seen in (the ``NSpid`` line: one pid per level)."""
    try:
        status = (_PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) - 1
    return None


def children_born_in_own_pid_namespace() -> bool:
    """Whether this process's children start in its own PID namespace (it did not ``unshare``
    one for them), so a child of it that lives in a nested namespace cannot have been forked here."""
    try:
        return os.readlink("/proc/self/ns/pid") == os.readlink("/proc/self/ns/pid_for_children")
    except OSError:
        return False


def environ_contains(pid: int, needle: bytes) -> bool:
    """Whether ``needle`` occurs in the initial environment of ``pid`` (unreadable: no)."""
    try:
        return needle in (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False


# -- signalling and reaping -----------------------------------------------------------------


def send_signal(key: ProcKey, sig: int) -> bool:
    """Signal exactly that process; return whether it was signalled.

    The pid is pinned with a pidfd and its start time checked afterwards, so a pid recycled
    between the check and the kill is never hit. Without pidfds the window is microseconds.
    """
    pidfd = _pidfd_open(key.pid)
    try:
        info = read_proc(key.pid)
        if info is None or info.start != key.start or info.exited:
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(key.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _pidfd_open(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None or not hasattr(signal, "pidfd_send_signal"):
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def _gone(key: ProcKey) -> bool:
    """Whether that very process no longer exists (reaped; its pid free or someone else's)."""
    info = read_proc(key.pid)
    return info is None or info.start != key.start


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return predicate()
        time.sleep(min(interval, remaining))


def terminate(keys: Iterable[ProcKey], grace: float, *, kill_wait: float = 1.0) -> dict[int, int]:
    """SIGTERM ``keys``, wait up to ``grace``, SIGKILL what is left; return ``{pid: signal}``.

    The signal is the last one a process received while still running (15 or 9). Returns
    once every process is gone or a zombie, or ``kill_wait`` after the SIGKILL.
    """
    signalled = {key: signal.SIGTERM for key in keys if send_signal(key, signal.SIGTERM)}
    wait_until(lambda: not any(is_running(k) for k in signalled), grace)
    for key in signalled:
        if send_signal(key, signal.SIGKILL):
            signalled[key] = signal.SIGKILL
    wait_until(lambda: not any(is_running(k) for k in signalled), kill_wait)
    return {key.pid: int(sig) for key, sig in signalled.items()}


def reap_zombie(key: ProcKey) -> int | None:
    """Collect the exit status of that process if it is *our* zombie child; else ``None``.

    Returns the exit code (negative signal number if a signal ended it). Only pids this
    process itself killed or knows to be orphans should be passed: a status reaped here is
    lost to whoever else might wait for it.
    """
    pidfd = _pidfd_open(key.pid)
    try:
        info = read_proc(key.pid)
        if info is None or info.start != key.start or not info.exited or info.ppid != os.getpid():
            return None
        return _wait_nohang(key.pid, pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _wait_nohang(pid: int, pidfd: int | None) -> int | None:
    """Collect an exited child's status without blocking; ``None`` if someone else already did.

    Through the pidfd where the kernel has ``waitid(P_PIDFD)``: it names that very process, so a
    pid reaped by another thread and recycled since the identity check is never reaped instead.
    """
    try:
        if pidfd is not None and hasattr(os, "P_PIDFD"):
            try:
                result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                return None
            except OSError:
                pass  # EINVAL: a kernel with pidfds but without waitid(P_PIDFD); use the pid
            else:
                if result is None:
                    return None
                return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if reaped == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux); return whether it worked."""
    if not IS_LINUX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        log.warning("Could not make the task process a child subreaper: %s", exc)
        return False
    return True


def command_line(pid: int, limit: int = 120) -> str:
    """A short, human-readable command line for the record (best effort)."""
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        info = read_proc(pid)
        return info.name if info else ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:limit]


# -- the reaper -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Seen:
    key: ProcKey
    command: str
    orphan: bool
    """Nobody in this process will ever wait for it: it was first seen as another process's
    child, or it is our child but provably was not forked here (see ``_reparented``)."""


class DescendantReaper:
    """Stops, on cancel, every process the run started in this process's subtree.

    Create with :meth:`start` when the run starts. Thread-safe; :meth:`reap` is idempotent.
    It never signals this process, its threads, processes that existed before :meth:`start`,
    or anything started by those. It works per *process*: it cannot tell which scope started a
    descendant, so use one per task process (Airflow's model), not one per scope in a shared one.
    """

    #: How often the tree is polled while the run is active.
    poll_interval = 0.05
    #: Longest SIGTERM grace before SIGKILL (always also bounded by the scope's budget).
    term_grace = 1.0
    #: Budget kept back after the SIGTERM grace for SIGKILL and reaping.
    kill_reserve = 0.5
    #: How long zombie children this process may have forked itself are left for their owners
    #: (``Popen``, asyncio) to reap: one window per ``reap`` shared by all of them, so it never
    #: adds up per process. Orphans reparented to us have no owner here and never wait for it.
    owner_grace = 0.1

    def __init__(self, baseline: dict[int, float]) -> None:
        self._pid = os.getpid()
        self._sid = os.getsid(0)
        self._own_namespace_children = children_born_in_own_pid_namespace()
        self._baseline = baseline
        self._seen: dict[int, _Seen] = {}
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._stopped = threading.Event()
        self._owner_deadline = 0.0
        self._handle: ResourceHandle | None = None
        self._thread: threading.Thread | None = None
        self.subreaper = False

    @classmethod
    def start(cls, scope: TaskCancellation) -> DescendantReaper | None:
        """Start watching this process's descendants for ``scope``; ``None`` off Linux."""
        if not IS_LINUX:
            log.debug("DescendantReaper needs Linux (/proc, PR_SET_CHILD_SUBREAPER); not started")
            return None
        from cancellable_agents.cancellation import Phase

        subreaper = become_subreaper()
        baseline = {pid: info.start for pid, info in walk_descendants(os.getpid()).items()}
        reaper = cls(baseline)
        reaper.subreaper = subreaper
        reaper._handle = scope.register(
            lambda: reaper.reap(scope), name="descendant reaper", phase=Phase.TEARDOWN
        )
        reaper._thread = threading.Thread(target=reaper._poll, name="cancellable-agents-reaper", daemon=True)
        reaper._thread.start()
        scope.record("reaper_started", subreaper=subreaper, preexisting=len(baseline))
        return reaper

    # -- watching ------------------------------------------------------------------------

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            try:
                self._scan()
            except Exception as exc:  # the watcher must never die of a transient /proc race
                log.debug("descendant scan failed: %r", exc)

    def _is_preexisting(self, info: ProcInfo) -> bool:
        return self._baseline.get(info.pid) == info.start

    def _scan(self) -> dict[int, ProcInfo]:
        """Record every current descendant started during the run; reap known orphans."""
        current = walk_descendants(self._pid, skip=self._is_preexisting)
        with self._lock:
            for pid, info in current.items():
                known = self._seen.get(pid)
                if known is None or known.key.start != info.start:
                    orphan = info.ppid != self._pid or self._reparented(info)
                    self._seen[pid] = _Seen(ProcKey(pid, info.start), command_line(pid), orphan)
            orphans = [s.key for s in self._seen.values() if s.orphan]
        # An orphan that exits on its own is our zombie and nobody else will ever wait for it.
        for key in orphans:
            reap_zombie(key)
        return current

    def _reparented(self, info: ProcInfo) -> bool:
        """Whether ``info``, a child of this process, provably was not forked by it.

        A process forked here is born in our session and, unless we unshared one for our
        children, in our PID namespace; the only way out of the session is to lead a new one
        (``setsid``). So a child in a session that is neither ours nor its own (the ``(cmd &)``
        orphan of a shell that started a new session), or in a nested PID namespace (bubblewrap's
        init, once the outer ``bwrap`` exited), was reparented to us as the subreaper: no
        ``Popen`` or asyncio watcher here knows its pid, so waiting for one to reap it only
        wastes the owner grace. Anything else may have an owner here and keeps its grace.
        """
        if os.getsid(0) == self._sid and info.sid not in (info.pid, self._sid):
            return True
        return self._own_namespace_children and nested_pid_namespace(info.pid)

    def descendants(self) -> list[int]:
        """Pids of the run's descendants that are still running (for tests and logs)."""
        with self._lock:
            keys = [s.key for s in self._seen.values()]
        return sorted(k.pid for k in keys if is_running(k))

    def close(self) -> None:
        """Stop watching without killing anything (the run ended normally)."""
        self._stopped.set()
        if self._handle is not None:
            self._handle.unregister()

    # -- killing -------------------------------------------------------------------------

    def reap(self, scope: TaskCancellation) -> list[KillRecord]:
        """Terminate what the run started, reap the zombies, record the kills; return them.

        Idempotent: a second call finds nothing left and records nothing.
        """
        with self._reap_lock:
            self._stopped.set()
            self._owner_deadline = time.monotonic() + self.owner_grace
            killed = self._kill_round(scope)
            # Something may have forked while it was being terminated: sweep until quiet.
            for _ in range(2):
                more = self._kill_round(scope, grace=0.0)
                if not more:
                    break
                killed.extend(more)
            self._reap_leftover_zombies(scope)
            if self._handle is not None:
                self._handle.unregister()
            return killed

    def _targets(self) -> dict[ProcKey, _Seen]:
        current = self._scan()
        with self._lock:
            seen = dict(self._seen)
        targets = {s.key: s for s in seen.values() if s.key.pid != self._pid}
        for pid, info in current.items():
            targets.setdefault(ProcKey(pid, info.start), seen[pid])
        return {key: s for key, s in targets.items() if is_running(key)}

    def _kill_round(self, scope: TaskCancellation, grace: float | None = None) -> list[KillRecord]:
        targets = self._targets()
        if not targets:
            return []
        if grace is None:
            grace = max(0.0, min(self.term_grace, scope.remaining() - self.kill_reserve))
        signals = terminate(targets, grace, kill_wait=max(0.2, min(1.0, scope.remaining())))
        records = []
        for key, seen in targets.items():
            if key.pid not in signals:
                continue  # it exited on its own before the signal
            exit_code = self._collect(key, seen, scope)
            record = KillRecord(
                source="descendant_reaper",
                pid=key.pid,
                signal=signals[key.pid],
                exit_code=exit_code,
                command=seen.command,
                at=round(time.time(), 3),
            )
            scope.record_killed(record)
            records.append(record)
        return records

    def _collect(self, key: ProcKey, seen: _Seen, scope: TaskCancellation) -> int | None:
        """Reap ``key`` if it is our zombie; a child that may have an owner here (a ``Popen``
        about to wait for it) first gets what is left of the shared owner grace."""
        if not seen.orphan:
            left = min(self._owner_deadline - time.monotonic(), scope.remaining())
            wait_until(lambda: _gone(key), max(0.0, left))
        return reap_zombie(key)

    def _reap_leftover_zombies(self, scope: TaskCancellation) -> None:
        with self._lock:
            seen = list(self._seen.values())
        for item in seen:
            info = read_proc(item.key.pid)
            if info is None or info.start != item.key.start or not info.exited:
                continue
            code = self._collect(item.key, item, scope)
            if code is not None:
                scope.record("zombie_reaped", pid=item.key.pid, exit_code=code)
