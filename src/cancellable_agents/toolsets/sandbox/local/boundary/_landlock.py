"""Landlock: a boundary that needs neither privilege nor namespaces (``isolation="landlock"``).

Where bubblewrap cannot make namespaces (an unprivileged Kubernetes pod: no capabilities, a
``RuntimeDefault`` seccomp profile refusing ``unshare``), an unprivileged process can still
restrict itself and everything it starts, for good, once it has ``no_new_privs``:

- **files** (ABI 1+): commands read the system folders, the interpreter's installation, the
  parts of ``/etc`` the namespace profile shows (not
  ``HIDDEN_ETC``), a few device
  nodes and global ``/proc`` files, the paths the author listed; they read and write only their
  workdir and a private tmp folder (``TMPDIR``). Nothing else: no home, no ``AIRFLOW_HOME``, no
  DAGs folder, no ``/var/run/secrets``, no ``/proc/<pid>`` (the task's environ included);
- **network** (off unless ``network=True``): the seccomp filter refuses ``socket()`` for every
  family but ``AF_UNIX``
  ([`SocketRule`][cancellable_agents.toolsets.sandbox.local.boundary._seccomp.SocketRule]), and from ABI 4
  Landlock refuses every
  TCP bind and connect too;
- **processes** (ABI 6+): a command can signal only processes of its own domain, and reach no
  abstract unix socket made outside it; ptrace of anything outside its domain is refused at
  every ABI; plus the sandbox's seccomp filter.

How the child applies it: the sandbox builds the ruleset once
([`LandlockRuleset`][cancellable_agents.toolsets.sandbox.local.boundary._landlock.LandlockRuleset], a file
descriptor) and each command starts under its init
([`init_argv`][cancellable_agents.toolsets.sandbox.local.boundary._landlock.init_argv],
[`command_init`][cancellable_agents.toolsets.sandbox.local.boundary._command_init]): a tiny exec'd program,
a child subreaper outside the domain, that forks the command; the child sets ``no_new_privs``
and its parent-death signal, restricts itself with the inherited ruleset, loads the seccomp
program from the inherited memfd, closes both and ``execvp``\\ s the command. The init keeps the
whole tree: nothing the command starts outlives it, its stop, or the task's death. Not
``preexec_fn``: it runs Python between ``fork`` and ``exec`` in a process with many threads (a
lock held by another thread at the fork, logging's or the import lock, deadlocks the child), and
CPython documents it as unsafe with threads. The init costs one interpreter start (no ``site``)
per command; if the child cannot apply every rule it exits ``BOUNDARY_FAILED`` and the
command never runs.

On an older ABI the sandbox applies what there is and says, once and in its record, what is
missing
([`LandlockSupport.missing`][cancellable_agents.toolsets.sandbox.local.boundary._landlock.LandlockSupport.missing]).
This module imports no Airflow and loads no library
at import; the ABI is probed once per process.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from cancellable_agents.core._once import Once
from cancellable_agents.toolsets.sandbox.local.boundary import _command_init as command_init
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import HIDDEN_ETC, SYSTEM_DIRS
from cancellable_agents.toolsets.sandbox.local.boundary._command_init import BOUNDARY_FAILED

__all__ = [
    "BOUNDARY_FAILED",
    "LandlockRuleset",
    "LandlockSupport",
    "init_argv",
    "landlock_support",
    "readable_paths",
    "warn_if_missing",
]

log = logging.getLogger(__name__)


#: ``landlock_create_ruleset``, ``landlock_add_rule``, ``landlock_restrict_self``: the same number
#: on every architecture (the generic syscall table), x86_64 and aarch64 included.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

# File-system rights (``LANDLOCK_ACCESS_FS_*``) and the ABI that introduced each.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
_FS_BY_ABI = {1: (1 << 13) - 1, 2: REFER, 3: TRUNCATE, 5: IOCTL_DEV}
#: The rights a rule on a file (not a folder) may carry; the kernel refuses others there.
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
READ = EXECUTE | READ_FILE | READ_DIR
#: The workdir and the private tmp: everything but device nodes.
READ_WRITE = READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK
READ_WRITE |= MAKE_FIFO | MAKE_SYM | REFER | TRUNCATE
# Network rights (ABI 4) and scopes (ABI 6).
BIND_TCP, CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

#: What each ABI adds, in the words the log and the record use when it is missing.
PROTECTIONS_BY_ABI: dict[int, str] = {
    2: "renames and links across folders are refused (ABI 2)",
    3: "truncating files outside the workdir is refused (ABI 3)",
    4: "TCP bind/connect refused by Landlock (ABI 4; seccomp still refuses non-unix sockets)",
    5: "ioctl on devices refused (ABI 5)",
    6: (
        "signals and abstract unix sockets scoped to the command (ABI 6; below it a command can "
        "signal the task and its own init, and what it started then outlives it)"
    ),
}

#: Device nodes commands may read and write (``> /dev/null``), and those they may only read.
DEVICES_READ_WRITE: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/full")
DEVICES_READ: tuple[str, ...] = ("/dev/random", "/dev/urandom")
#: Global ``/proc`` files tools read (``nproc``, ``free``, numpy). No ``/proc/<pid>``, not even
#: ``/proc/self``: a rule is on an inode, and ``/proc/self`` here would be the task's own.
PROC_FILES: tuple[str, ...] = (
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/loadavg",
    "/proc/uptime",
    "/proc/version",
)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.cache
def _syscall() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall


@dataclass(frozen=True)
class LandlockSupport:
    """The Landlock ABI of this kernel (0: none, ``reason`` says why)."""

    abi: int
    reason: str = ""

    @property
    def usable(self) -> bool:
        return self.abi >= 1

    def missing(self) -> tuple[str, ...]:
        """The protections this ABI lacks (empty from ABI 6 on)."""
        return tuple(text for abi, text in PROTECTIONS_BY_ABI.items() if self.abi < abi)

    def handled_fs(self) -> int:
        return functools.reduce(int.__or__, (bits for abi, bits in _FS_BY_ABI.items() if self.abi >= abi), 0)

    def handled_net(self, network: bool) -> int:
        return BIND_TCP | CONNECT_TCP if self.abi >= 4 and not network else 0

    def scoped(self) -> int:
        return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if self.abi >= 6 else 0


@functools.cache
def landlock_support() -> LandlockSupport:
    """Probed once per process: ``landlock_create_ruleset(NULL, 0, VERSION)``."""
    if platform.system() != "Linux":
        return LandlockSupport(0, "Landlock needs Linux")
    abi = _syscall()(SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    if abi >= 1:
        return LandlockSupport(int(abi))
    error = ctypes.get_errno()
    why = {
        errno.ENOSYS: "the kernel has no Landlock (5.13+ built with CONFIG_SECURITY_LANDLOCK)",
        errno.EOPNOTSUPP: "Landlock is built in but not enabled (add it to the lsm= boot parameter)",
        errno.EPERM: "the container's seccomp profile refuses the landlock_* system calls",
    }.get(error, f"landlock_create_ruleset failed: {os.strerror(error)}")
    return LandlockSupport(0, why)


def readable_paths(interpreter: Iterable[str], extra: Iterable[str]) -> list[str]:
    """What commands may read: the system folders (``/etc`` minus its secrets), the
    interpreter's installation and the author's ``read_only_paths``; missing paths dropped."""
    system = [d for d in SYSTEM_DIRS if d != "/etc"]
    paths = [*system, *_shown_beneath("/etc", HIDDEN_ETC), *interpreter, *extra]
    # A rule follows a symlink when it is made, here, in the task process: /etc/mtab ->
    # /proc/self/mounts would grant the *task's* /proc entry. No rule reaches into /proc.
    return [p for p in dict.fromkeys(paths) if os.path.exists(p) and not _in_proc(p)]


def _in_proc(path: str) -> bool:
    resolved = os.path.realpath(path)
    return resolved == "/proc" or resolved.startswith("/proc/")


def _shown_beneath(root: str, hidden: tuple[str, ...]) -> Iterator[str]:
    """The entries of ``root`` a rule may name so that nothing in ``hidden`` is reachable: a
    folder holding a hidden path is entered, never granted whole. (Landlock only adds rights, so
    hiding means never granting: ``/etc`` itself is not listable.)"""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.path in hidden:
            continue
        if any(h.startswith(entry.path + "/") for h in hidden):
            yield from _shown_beneath(entry.path, hidden)
        else:
            yield entry.path


class LandlockRuleset:
    """A sandbox's ruleset, built once: a file descriptor each command restricts
    itself with (inherited, never modified after ``build``, so concurrent starts share it).

    ``network``: ``True`` leaves TCP unhandled (the host's network, as ``network=True`` in
    namespace mode); ``False`` handles bind and connect and grants no port.
    """

    def __init__(self, fd: int, support: LandlockSupport) -> None:
        self.fd = fd
        self.support = support

    @classmethod
    def build(
        cls,
        support: LandlockSupport,
        *,
        readable: Iterable[str],
        writable: Iterable[str],
        network: bool,
    ) -> LandlockRuleset:
        """The ruleset; ``OSError`` if the kernel refuses it or a rule (the sandbox cannot start)."""
        attr = _RulesetAttr(support.handled_fs(), support.handled_net(network), support.scoped())
        fd = _checked(_syscall()(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0))
        ruleset = cls(fd, support)
        try:
            for path in readable:
                ruleset._allow(path, READ)
            for path in [*PROC_FILES, *DEVICES_READ]:
                ruleset._allow(path, READ_FILE)
            for path in DEVICES_READ_WRITE:
                ruleset._allow(path, READ_FILE | WRITE_FILE | IOCTL_DEV)
            for path in writable:
                ruleset._allow(path, READ_WRITE)
        except BaseException:
            ruleset.close()
            raise
        return ruleset

    def _allow(self, path: str, access: int) -> None:
        """A rule for ``path`` and what beneath it; a path missing here is skipped."""
        try:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            rights = access & self.support.handled_fs()
            if not os.path.isdir(f"/proc/self/fd/{target}"):
                rights &= FILE_RIGHTS
            rule = _PathBeneathAttr(rights, target)
            _checked(_syscall()(SYS_ADD_RULE, self.fd, _RULE_PATH_BENEATH, ctypes.byref(rule), 0))
        finally:
            os.close(target)

    def close(self) -> None:
        """Close the descriptor (commands already restricted stay so). Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _checked(result: int) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"landlock: {os.strerror(error)}")
    return int(result)


def init_argv(
    python: str, ruleset: LandlockRuleset, seccomp_fd: int | None, *, report_fd: int = -1, grace: float = 1.0
) -> list[str]:
    """What goes before a command's argv: its init
    ([`command_init`][cancellable_agents.toolsets.sandbox.local.boundary._command_init]), with the
    descriptors
    it inherits (``seccomp_fd`` ``None``: no filter; the sandbox refuses that when it needs one;
    ``report_fd`` -1: no kill report) and the SIGTERM grace of a stop."""
    seccomp = -1 if seccomp_fd is None else seccomp_fd
    fds = [str(ruleset.fd), str(seccomp), str(report_fd), str(os.getpid()), repr(float(grace))]
    return [python, "-I", "-S", command_init.__file__, *fds, "--"]


_warned = Once()


def warn_if_missing(support: LandlockSupport) -> None:
    """Once per process: the protections this kernel's ABI lacks (the sandbox's record lists
    them too)."""
    missing = support.missing()
    if missing and _warned.first():
        log.warning(
            "LocalSandbox: Landlock ABI %d on this kernel; these protections are missing in "
            "Landlock mode: %s. Fix: a newer kernel (6.12+ has them all).",
            support.abi,
            "; ".join(missing),
        )
