"""How the local backend enforces a sandbox's
[`Limits`][] outside its cgroup.

Each limit binds the command and everything it starts, not the task. Three enforcers share them:

- ``prlimit`` just before the command runs ([`limits_prefix`][]): CPU time, file size, open
  files, and memory and process count per process where the sandbox has no cgroup;
- the sandbox's cgroup ([`cgroups`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups]):
  memory and process count for the whole sandbox, where the worker can make one;
- tmpfs sizes: bubblewrap's private ``/tmp`` (``tmp_bytes``), and the workdir's total
  (``workdir_bytes``, [`mount_workdir`][]).

The workdir's total: ``RLIMIT_FSIZE`` caps each file, not their sum, and a periodic measure can
be outrun by a command writing fast between two looks. A tmpfs with ``size=`` is a cap the kernel
enforces on every write (``ENOSPC``), whoever writes: the commands (which see it through their
bind) and the file tools (which open the same folder from outside). Its pages are memory, charged
to the writer's memory cgroup, so a command's files count against its sandbox's memory too. Only
where the worker may mount (root, i.e. ``CAP_SYS_ADMIN``: the usual container set-up), and only on
a workdir the sandbox created: a tmpfs on the DAG author's own folder would hide what is in it.
Elsewhere the workdir has no total and [`mount_workdir`][] says so once. A task killed with
SIGKILL leaves the mount behind; the next sandbox's orphan cleanup unmounts it
([`unmount_workdir`][]) before removing the folder. This module imports no Airflow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import shutil
from pathlib import Path

from cancellable_agents.core._once import Once
from cancellable_agents.toolsets.sandbox.limits import CPU_KILL_GRACE, Limits

__all__ = ["limits_prefix", "mount_workdir", "prlimit_args", "prlimit_path", "unmount_workdir"]

log = logging.getLogger(__name__)


# -- per process: prlimit ----------------------------------------------------------------------


def prlimit_args(limits: Limits) -> list[str]:
    """``prlimit`` options: soft = hard (the command cannot raise them), except the CPU time,
    whose soft limit sends SIGXCPU and whose hard limit, a grace later, SIGKILL."""
    pairs = (
        ("nproc", limits.max_processes),
        ("as", limits.memory_bytes),
        ("fsize", limits.file_size_bytes),
        ("nofile", limits.open_files),
    )
    args = [f"--{name}={value}:{value}" for name, value in pairs if value is not None]
    if limits.cpu_seconds is not None:
        args.append(f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + CPU_KILL_GRACE}")
    return args


@functools.cache
def prlimit_path() -> str | None:
    """``prlimit`` (util-linux), found once; process-group mode needs it without bubblewrap."""
    return shutil.which("prlimit")


def limits_prefix(prlimit: str | None, limits: Limits) -> list[str]:
    """``prlimit --...= --`` before the command, or nothing without prlimit (logged)."""
    args = prlimit_args(limits)
    if not args:
        return []
    if prlimit is None:
        log.warning("LocalSandbox: prlimit (util-linux) is not installed; commands run without limits")
        return []
    return [prlimit, *args, "--"]


# -- the workdir's total: a tmpfs --------------------------------------------------------------


_MNT_DETACH = 2
_MS_NOSUID = 2
_MS_NODEV = 4

_noted = Once()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def mount_workdir(workdir: Path, size: int) -> bool:
    """Mount a tmpfs of ``size`` bytes on the (empty, just created) ``workdir``; ``False``, noted
    once per process, where this worker cannot mount."""
    libc = _libc()
    if libc is None or os.geteuid() != 0:
        _note("the worker is not root")
        return False
    options = f"size={size},mode=0700".encode()
    flags = _MS_NOSUID | _MS_NODEV
    if libc.mount(b"tmpfs", os.fsencode(workdir), b"tmpfs", flags, options) != 0:
        error = ctypes.get_errno()
        _note(f"mounting a tmpfs failed: {os.strerror(error)}")
        return False
    return True


def unmount_workdir(workdir: Path) -> None:
    """Unmount ``workdir``'s tmpfs if it has one (lazily: a process still inside cannot block it)."""
    libc = _libc()
    if libc is None or not os.path.ismount(workdir):
        return
    if libc.umount2(os.fsencode(workdir), _MNT_DETACH) != 0:
        log.warning("sandbox workdir %s could not be unmounted: %s", workdir, os.strerror(ctypes.get_errno()))


def _note(reason: str) -> None:
    if not _noted.first():
        return
    log.warning(
        "LocalSandbox: the workdir has no total size here (%s); each file is capped at "
        "Limits.file_size_bytes, not their sum. A root worker mounts a tmpfs of Limits.workdir_bytes.",
        reason,
    )
