"""The init of one Landlock-mode command: a process tree no command can leave.

Without a PID namespace nothing ends a command's tree with it: a daemon that double-forks, calls
``setsid``, renames itself and execs with an empty environment is reparented to PID 1 and is
found by nobody. So each Landlock-mode command starts as this program (``python -I -S
_command_init.py RULESET_FD SECCOMP_FD REPORT_FD TASK_PID GRACE -- argv``), which:

- makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every orphan of the command is
  reparented to it, whatever it does, so the tree under it is the whole command;
- stays **outside** the Landlock domain and the seccomp filter: it forks the command, and only
  the child applies them before ``exec``. With ABI 6 scoping a command can neither signal nor
  ptrace it, so the command cannot end its own keeper;
- arms a parent-death signal (``SIGHUP``) and checks its parent at every wake-up: when the task
  process dies, SIGKILL included, it SIGKILLs the whole tree at once;
- when the command's main process ends, SIGKILLs what it left behind (a command never outlives
  itself); on ``SIGTERM`` (a stop) it freezes the tree, SIGTERMs every process, waits ``GRACE``
  (or ``SIGUSR1``: "now") and SIGKILLs what is left; and exits only once its tree is empty and
  reaped, with the command's own status;
- writes one line per process it signalled to ``REPORT_FD`` (a memfd the task reads after it
  exited, so writing never blocks): ``pid start signal command-line``, which the sandbox turns
  into the kill record.

Killing is freeze-then-kill: ``SIGSTOP`` every process found, scan again until no new one
appears (a stopped process cannot fork), then signal them all, so a fork storm cannot outrun it.

Standard library only, no ``site``: it runs as a script with the sandbox's interpreter and
imports nothing of the package.
[`parse_report`][cancellable_agents.toolsets.sandbox.local.boundary._command_init.parse_report] is the task's
side of ``REPORT_FD``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import NamedTuple

#: The exit code of a command whose Landlock or seccomp rules could not be applied (it never ran).
BOUNDARY_FAILED = 125
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2
SYS_LANDLOCK_RESTRICT_SELF = 446
#: What wakes the init: a child's end, a stop (TERM/INT), "kill now" (USR1), the task's death (HUP).
WAKERS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP}
#: How often the init looks at its parent even without a signal (a missed parent-death signal).
POLL = 0.2
#: How long one SIGKILL round may wait for its processes to be reaped before scanning again.
REAP_WAIT = 1.0
KILL_ROUNDS = 5
#: A stop: SIGTERM (the sandbox's), SIGINT (an interrupt of the whole session).
STOPS = (signal.SIGTERM, signal.SIGINT)


class ReportedKill(NamedTuple):
    """One process the init signalled: what the task records."""

    pid: int
    start: float
    signal: int
    command: str


def parse_report(data: bytes) -> list[ReportedKill]:
    """The init's report: the last (strongest) signal each process got, in the order sent.
    Lines that do not parse are skipped (the init may have died mid-line)."""
    kills: dict[tuple[int, float], ReportedKill] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        pid, start, sig, command = [*line.split(" ", 3), ""][:4]
        try:
            kill = ReportedKill(int(pid), float(start), int(sig), command)
        except ValueError:
            continue
        kills[(kill.pid, kill.start)] = kill
    return list(kills.values())


# -- the init's side ------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _fail(what: str, libc: ctypes.CDLL) -> None:
    sys.stderr.write(f"sandbox: cannot apply the boundary ({what}: {os.strerror(ctypes.get_errno())})\n")
    os._exit(BOUNDARY_FAILED)


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _exec_confined(libc: ctypes.CDLL, ruleset_fd: int, seccomp_fd: int, init: int, argv: list[str]) -> None:
    """The command's side of the fork: restrict itself for good, then become the command."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, None, 0, 0) != 0:
        _fail("parent-death signal", libc)
    if os.getppid() != init:
        os._exit(BOUNDARY_FAILED)  # the init died before the signal was armed
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0) != 0:
        _fail("landlock_restrict_self", libc)
    if seccomp_fd >= 0:
        size = os.fstat(seccomp_fd).st_size
        code = os.pread(seccomp_fd, size, 0)
        if len(code) != size or size % 8:
            os._exit(BOUNDARY_FAILED)
        program = _Program(size // 8, code)
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
            _fail("seccomp", libc)
        os.close(seccomp_fd)
    os.close(ruleset_fd)
    # Python ignores these at start, and an ignored signal stays ignored across exec: a command
    # would get EPIPE instead of dying in a closed pipe (`yes | head`), EFBIG instead of SIGXFSZ.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"{argv[0]}: {exc.strerror}\n")
        os._exit(126 if exc.errno in (13, 1) else 127)


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` with its start time (``/proc/PID/task/TID/children``; a full
    scan of ``/proc`` by parent where the kernel lacks that file)."""
    found: dict[int, str] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        for child in _children(pid):
            start = _start_of(child)
            if child not in found and start is not None:
                found[child] = start
                pending.append(child)
    return found


def _children(pid: int) -> list[int]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as children:
                kids.extend(int(k) for k in children.read().split())
        except FileNotFoundError:
            return [p for p in _all_pids() if _parent_of(p) == pid]
        except OSError:
            continue
    return kids


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read().decode("utf-8", "replace")
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def _parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def _start_of(pid: int) -> str | None:
    """The start time field (clock ticks since boot): with the pid, a process's identity."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read(4096)
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:120].replace("\n", " ")


class _Init:
    """The init's state: the command's pid, its status once ended, the report."""

    def __init__(self, command: int, task: int, report_fd: int) -> None:
        self.command = command
        self.task = task
        self.report_fd = report_fd
        self.status: int | None = None

    def report(self, pid: int, seen: tuple[str, str], sig: int) -> None:
        if self.report_fd >= 0:
            start, command = seen
            os.write(self.report_fd, f"{pid} {start} {int(sig)} {command}\n".encode())

    def reap(self) -> bool:
        """Collect every exited child; ``False`` once there is none left at all."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.command:
                self.status = status

    def task_gone(self) -> bool:
        return os.getppid() != self.task

    def freeze(self) -> dict[int, tuple[str, str]]:
        """SIGSTOP everything below, scanning again until nothing new appears; each process's
        start time and command line, read while it is stopped (a killed one has none)."""
        frozen: dict[int, tuple[str, str]] = {}
        while True:
            new = {pid: start for pid, start in _descendants(os.getpid()).items() if pid not in frozen}
            if not new:
                return frozen
            for pid, start in new.items():
                _signal(pid, signal.SIGSTOP)
                frozen[pid] = (start, _command_line(pid))

    def signal_all(self, sig: int) -> None:
        """Freeze the tree, send ``sig`` to every process in it, thaw it (a SIGTERM must be
        pending everywhere before any process can react to another's death)."""
        frozen = self.freeze()
        for pid, seen in frozen.items():
            if _signal(pid, sig):
                self.report(pid, seen, sig)
        for pid in frozen:
            _signal(pid, signal.SIGCONT)

    def kill_all(self) -> None:
        """SIGKILL the whole tree until none of it is left, and reap it (a process stuck in the
        kernel for good is given up on after ``KILL_ROUNDS``: the task's own bound takes over)."""
        for _ in range(KILL_ROUNDS):
            self.signal_all(signal.SIGKILL)
            deadline = time.monotonic() + REAP_WAIT
            while self.reap():
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            else:
                return

    def wait(self, until: float | None, stop_early: bool) -> int:
        """Sleep on the wakers until ``until`` (``None``: forever), the command's end (unless
        ``stop_early`` is False, i.e. waiting for the whole tree), or an event; return the
        signal that woke it (0: the command ended / the tree emptied, -1: the time is up)."""
        while True:
            timeout = POLL if until is None else max(0.0, min(POLL, until - time.monotonic()))
            info = signal.sigtimedwait(WAKERS, timeout)
            alive = self.reap()
            if self.task_gone():
                return signal.SIGHUP
            if info is not None and info.si_signo != signal.SIGCHLD:
                return info.si_signo
            if (stop_early and self.status is not None) or not alive:
                return 0
            if until is not None and time.monotonic() >= until:
                return -1

    def run(self, grace: float) -> int:
        """Supervise the command until its tree is gone; return its wait status.

        The command's end, a ``SIGUSR1`` or the task's death: SIGKILL whatever is left. A stop:
        SIGTERM everything, then SIGKILL what is left after ``grace`` (or at ``SIGUSR1``)."""
        woke = self.wait(None, stop_early=True)
        if woke in STOPS:
            self.signal_all(signal.SIGTERM)
            until = time.monotonic() + grace
            while woke in STOPS:  # a second stop (the group's and the sandbox's) is the same stop
                woke = self.wait(until, stop_early=False)
        if self.reap():
            self.kill_all()
        return self.status if self.status is not None else signal.SIGKILL


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True


def _exit_like(status: int) -> None:
    """End as the command ended: its exit code, or death by its signal (no core dump)."""
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else signal.SIGKILL
    if sig != signal.SIGKILL:  # SIGKILL has no disposition to reset, nor a core to prevent
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        except (OSError, ValueError):
            os._exit(128 + sig)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def main(args: list[str]) -> None:
    ruleset_fd, seccomp_fd, report_fd, task = (int(a) for a in args[:4])
    grace = float(args[4])
    argv = args[6:]
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        _fail("no_new_privs", libc)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, None, 0, 0) != 0:
        _fail("child subreaper", libc)
    for sig in WAKERS:
        # An ignored signal is discarded even while blocked (SIGCHLD ignored: no zombies to wait
        # for), and ignoring is inherited: the task's dispositions must not decide the init's.
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, WAKERS)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP, None, 0, 0) != 0:
        _fail("parent-death signal", libc)
    if os.getppid() != task:
        os._exit(BOUNDARY_FAILED)  # the task died before the signal was armed
    init = os.getpid()
    command = os.fork()
    if command == 0:
        if report_fd >= 0:
            os.close(report_fd)
        _exec_confined(libc, ruleset_fd, seccomp_fd, init, argv)
    for fd in (ruleset_fd, seccomp_fd):
        if fd >= 0:
            os.close(fd)
    # The command's pipes close when its tree is gone, not when its keeper is.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _exit_like(_Init(command, task, report_fd).run(grace))


if __name__ == "__main__":
    main(sys.argv[1:])
