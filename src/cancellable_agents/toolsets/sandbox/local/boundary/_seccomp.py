"""The boundary profile's seccomp filter: the system calls a sandboxed command may not make.

Built once per process (per
[`SocketRule`][cancellable_agents.toolsets.sandbox.local.boundary._seccomp.SocketRule]) with libseccomp and
handed to bubblewrap
(``--seccomp FD``) or to Landlock mode's helper, which load it right before the command runs,
so it binds the command and everything it starts
(a filter is inherited and cannot be removed). A denied call fails with ``EPERM`` (``clone3``
with ``ENOSYS``, see below): the command sees an error it can report, it is not killed.

Binding: ``pyseccomp`` from PyPI, ctypes over the system's ``libseccomp.so.2``. Debian's
``python3-seccomp`` is a C extension built for Debian's own Python, so a venv on another
interpreter (pyenv, the Airflow image's) cannot import it; the ctypes binding installs anywhere
and only needs the shared library (Debian's ``libseccomp2``, on every machine with systemd or
apt). Where the library is missing, commands run without the filter and
[`warn_if_missing`][cancellable_agents.toolsets.sandbox.local.boundary._seccomp.warn_if_missing]
says so once, naming the protections that are off.

The filter is a denylist on top of bubblewrap's namespaces, no capabilities and no new
privileges: at least what Docker's default profile denies to a container without capabilities,
plus what lets a command reach more of the kernel or of other processes than it needs.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "DENIED",
    "DENIED_SOCKET_FAMILIES",
    "PROTECTIONS",
    "SeccompFilter",
    "SocketRule",
    "command_filter",
    "filter_fd",
    "seccomp_filter",
    "warn_if_missing",
]

from cancellable_agents.core._once import Once

log = logging.getLogger(__name__)

#: What the filter protects, in the words the missing-library warning uses.
PROTECTIONS: tuple[str, ...] = (
    "no nested namespaces (unshare -r: uid 0 with all capabilities in its own user namespace)",
    "no keyrings (the task's session keyring is readable otherwise)",
    "no ptrace or process_vm_readv/writev",
    "no io_uring",
    "no AF_VSOCK sockets (the hypervisor's channel, which no network namespace confines)",
    "no mount, bpf, perf_event_open, userfaultfd, kernel modules, kexec, reboot, clock or swap changes",
)

#: Denied with EPERM, grouped by what each group keeps a command from.
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "keyrings": ("keyctl", "add_key", "request_key"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "mounts": (
        "mount",
        "umount",
        "umount2",
        "pivot_root",
        "chroot",
        "open_tree",
        "move_mount",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
    ),
    "kernel attack surface": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "lookup_dcookie",
        "name_to_handle_at",
        "open_by_handle_at",
        "fanotify_init",
        "get_mempolicy",
        "set_mempolicy",
        "mbind",
        "move_pages",
        "migrate_pages",
        "sysfs",
        "_sysctl",
        "ustat",
        "uselib",
        "vm86",
        "vm86old",
        "iopl",
        "ioperm",
        "nfsservctl",
        "get_kernel_syms",
        "query_module",
    ),
    "the machine": (
        "init_module",
        "finit_module",
        "delete_module",
        "create_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "quotactl_fd",
        "settimeofday",
        "stime",
        "clock_settime",
        "clock_adjtime",
        "syslog",
        "vhangup",
        "sethostname",
        "setdomainname",
    ),
}

#: Socket families a command may not create: ``socket(family, ...)`` fails with EPERM. AF_VSOCK
#: (40) talks to the hypervisor and its other guests; it is not a network interface, so the
#: sandbox's network namespace does not confine it (Docker's default profile refuses it too).
#: On x86_64, libseccomp also writes the rule for the 32-bit ``socketcall(SYS_SOCKET, ...)``,
#: whose family sits in memory a filter cannot read: that form is refused for every family (a
#: 32-bit program gets sockets only from the direct ``socket`` call, kernel 4.3+).
DENIED_SOCKET_FAMILIES: dict[str, int] = {"AF_VSOCK": 40}
AF_UNIX = 1
#: ``socketpair`` types refused where named unix sockets are (all but ``SOCK_STREAM`` 1 and
#: ``SOCK_SEQPACKET`` 5: a datagram pair can ``sendto`` any named datagram socket). Compared
#: under ``SOCK_TYPE_MASK``, so ``SOCK_CLOEXEC``/``SOCK_NONBLOCK`` change nothing.
UNCONNECTED_PAIR_TYPES: tuple[int, ...] = (2, 3, 4, 6, 10)
SOCK_TYPE_MASK = 0xF


class SocketRule(Enum):
    """Which sockets a command may create.

    Landlock mode has no namespace to hide the worker's named unix sockets (``/tmp/*.sock``,
    Docker's, D-Bus's), and Landlock before ABI 9 does not mediate ``connect()`` on a path: there
    ``socket(AF_UNIX)`` is refused unless the author opts in (``unix_sockets=True``), and only
    ``socketpair`` of a connected type (stream, seqpacket) stays, which ordinary programs need
    (a datagram pair could still ``sendto`` a named socket).
    """

    #: Every family but those in ``DENIED_SOCKET_FAMILIES`` (a network namespace, or the
    #: host's network on purpose, decides the rest).
    NAMESPACED = "namespaced"
    #: ``AF_UNIX`` only (``socket`` and ``socketpair``): no network where no namespace confines
    #: one (Landlock mode): no TCP, UDP, raw, netlink or vsock. The comparison is on all 64 bits
    #: of the argument, so ``0x1_0000_0001`` (``AF_UNIX`` to the kernel) is refused too.
    UNIX_ONLY = "unix-only"
    #: No ``socket()`` at all; ``socketpair(AF_UNIX)`` of a connected type only (Landlock mode,
    #: no network, the default).
    PAIRS_ONLY = "pairs-only"
    #: The host's network (Landlock mode, ``network=True``) but no ``socket(AF_UNIX)``; pairs as
    #: ``PAIRS_ONLY``.
    NO_NAMED_UNIX = "no-named-unix"


#: ``clone`` flags that create namespaces (``CLONE_NEWNS`` .. ``CLONE_NEWNET``): a clone with any
#: of them is denied, a plain fork or thread is not.
CLONE_NAMESPACE_FLAGS: tuple[int, ...] = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
#: ``clone3`` passes its flags in a struct a filter cannot read: it fails with ENOSYS, on which
#: glibc (threads, ``posix_spawn``) falls back to ``clone``, whose flags the filter checks.
ENOSYS_CALLS: tuple[str, ...] = ("clone3",)
#: libseccomp's ``__NR_SCMP_ERROR``: a name it does not know.
UNKNOWN_SYSCALL = -1


@dataclass(frozen=True)
class SeccompFilter:
    """The compiled filter (classic BPF, as bubblewrap reads it), or why there is none."""

    program: bytes | None
    reason: str = ""


@functools.cache
def seccomp_filter(sockets: SocketRule = SocketRule.NAMESPACED) -> SeccompFilter:
    """The filter for ``sockets``, compiled once per process (the library is loaded here, not at
    import)."""
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: the binding found no library
        return SeccompFilter(None, f"libseccomp is not available ({exc})")
    try:
        return SeccompFilter(_compile(pyseccomp, sockets))
    except OSError as exc:
        return SeccompFilter(None, f"libseccomp could not build the filter ({exc})")


def _compile(pyseccomp: Any, sockets: SocketRule) -> bytes:
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for arch in _companion_arches(pyseccomp):
        # The same rules for the 32-bit ABIs the CPU also runs, or `int 0x80` would bypass them.
        if not rules.exist_arch(arch):
            rules.add_arch(arch)
    eperm = pyseccomp.ERRNO(errno.EPERM)
    for names in DENIED.values():
        for name in names:
            _deny(pyseccomp, rules, eperm, name)
    for name in ENOSYS_CALLS:
        _deny(pyseccomp, rules, pyseccomp.ERRNO(errno.ENOSYS), name)
    for flag in CLONE_NAMESPACE_FLAGS:
        _deny(pyseccomp, rules, eperm, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    for family in DENIED_SOCKET_FAMILIES.values():
        # Masked to 32 bits: the kernel reads the family as an int, so 0x1_0000_0028 is AF_VSOCK
        # too, and a plain EQ on the 64-bit register would let it through.
        low32 = pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, family)
        _deny(pyseccomp, rules, eperm, "socket", low32)
    if sockets in (SocketRule.UNIX_ONLY, SocketRule.PAIRS_ONLY):
        for name in ("socket", "socketpair"):
            _deny(pyseccomp, rules, eperm, name, pyseccomp.Arg(0, pyseccomp.NE, AF_UNIX))
    if sockets in (SocketRule.PAIRS_ONLY, SocketRule.NO_NAMED_UNIX):
        _deny(pyseccomp, rules, eperm, "socket", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, AF_UNIX))
        for kind in UNCONNECTED_PAIR_TYPES:
            _deny(
                pyseccomp,
                rules,
                eperm,
                "socketpair",
                pyseccomp.Arg(1, pyseccomp.MASKED_EQ, SOCK_TYPE_MASK, kind),
            )
    # A memfd, not a pipe: a program larger than a pipe's buffer would block its own export.
    with os.fdopen(os.memfd_create("cancellable-agents-seccomp-build", os.MFD_CLOEXEC), "w+b") as buffer:
        rules.export_bpf(buffer)
        buffer.seek(0)
        return buffer.read()


def _companion_arches(pyseccomp: Any) -> list[int]:
    native = pyseccomp.system_arch()
    companions = {
        pyseccomp.Arch.X86_64: [pyseccomp.Arch.X86, pyseccomp.Arch.X32],
        pyseccomp.Arch.AARCH64: [pyseccomp.Arch.ARM],
    }
    return companions.get(native, [])


def _deny(pyseccomp: Any, rules: Any, action: int, name: str, *args: Any) -> None:
    """Add one rule; a call this libseccomp does not know is skipped (it is newer than the
    library, and then on no ABI it builds the filter for)."""
    number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    if number == UNKNOWN_SYSCALL:  # a call missing on this ABI only has a (negative) pseudo-number
        log.debug("seccomp: %s is unknown to libseccomp; not in the filter", name)
        return
    try:
        rules.add_rule(action, number, *args)
    except OSError as exc:
        log.debug("seccomp: %s not added (%s)", name, exc)


@contextmanager
def filter_fd(program: bytes) -> Iterator[int]:
    """A file descriptor bubblewrap reads ``program`` from, open for the ``with`` block.

    One per command: bubblewrap reads it to the end, and a descriptor shared by concurrent
    starts would share its read offset too.
    """
    fd = os.memfd_create("cancellable-agents-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


@contextmanager
def command_filter(wanted: bool, sockets: SocketRule = SocketRule.NAMESPACED) -> Iterator[int | None]:
    """For one command start: the descriptor to hand bubblewrap (``--seccomp FD``) or the
    Landlock helper, or ``None`` when not ``wanted`` (no boundary) or there is no filter here."""
    program = seccomp_filter(sockets).program if wanted else None
    if program is None:
        yield None
        return
    with filter_fd(program) as fd:
        yield fd


_warned = Once()


def warn_if_missing() -> SeccompFilter:
    """The filter; without one, a warning once per process naming the protections that are off
    (the boundary still has its namespaces, no capabilities, no new privileges and limits)."""
    found = seccomp_filter()
    if found.program is None and _warned.first():
        log.warning(
            "LocalSandbox: %s; boundary-profile commands run WITHOUT the seccomp filter, so these "
            "protections are off: %s. Fix: install libseccomp (`apt-get install libseccomp2`).",
            found.reason,
            "; ".join(PROTECTIONS),
        )
    return found
