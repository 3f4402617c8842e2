"""The /proc and signal helpers shared by the descendant reaper and the local sandbox.

Every signal goes to a process identified by pid *and* start time (through a pidfd where the
kernel has one), so a recycled pid is never signalled. Linux reads /proc; elsewhere psutil.
Airflow-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

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


def has_children() -> bool:
    """Whether this process has a child (running, stopped or a zombie): one ``waitid`` that reaps
    nothing, about 4 µs. Reading the children of every thread in /proc took 0.4 ms in a task
    process of six threads, and most runs start no process at all. Unsure (no ``waitid``): yes."""
    if not hasattr(os, "waitid"):
        return True
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except OSError:
        return True
    return True


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


def gone(key: ProcKey) -> bool:
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


def wait_gone(keys: Iterable[ProcKey], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until none of ``keys`` runs (gone or a zombie).

    Returns whether they all stopped. The one wait every kill path uses: each process is
    checked until it stops and then never again, so a long list costs one scan per process.
    """
    pending = list(keys)

    def stopped() -> bool:
        pending[:] = [key for key in pending if is_running(key)]
        return not pending

    return wait_until(stopped, timeout)


def terminate(keys: Iterable[ProcKey], grace: float, *, kill_wait: float = 1.0) -> dict[int, int]:
    """SIGTERM ``keys``, wait up to ``grace``, SIGKILL what is left; return ``{pid: signal}``.

    The signal is the last one a process received while still running (15 or 9). Returns
    once every process is gone or a zombie, or ``kill_wait`` after the SIGKILL.
    """
    signalled = {key: signal.SIGTERM for key in keys if send_signal(key, signal.SIGTERM)}
    wait_gone(signalled, grace)
    for key in signalled:
        if send_signal(key, signal.SIGKILL):
            signalled[key] = signal.SIGKILL
    wait_gone(signalled, kill_wait)
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


def lower_priority(niceness: int) -> None:
    """Lower every thread of this process to at least ``niceness`` (Linux's per-thread nice;
    threads started later inherit it from the one that starts them). A process may always lower
    its own priority but, unprivileged, not raise it back: this is for a process whose remaining
    work may wait. Nothing off Linux; a thread that ended meanwhile is skipped."""
    if not IS_LINUX:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < niceness:
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


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
