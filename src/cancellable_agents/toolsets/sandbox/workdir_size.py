"""A total size for a sandbox's workdir: a size-capped tmpfs mounted on the folder it created.

``RLIMIT_FSIZE`` caps each file, not their sum, and a periodic measure can be outrun by a
command writing fast between two looks. A tmpfs with ``size=`` is a cap the kernel enforces on
every write (``ENOSPC``), whoever writes: the commands (which see it through their bind) and the
file tools (which open the same folder from outside). Its pages are memory, charged to the writer's
memory cgroup, so a command's files count against its sandbox's memory too.

Only where the worker may mount (root, i.e. ``CAP_SYS_ADMIN``: the usual container set-up), and
only on a workdir the sandbox created: a tmpfs on the DAG author's own folder would hide what is
in it. Elsewhere the workdir has no total and :func:`mount_workdir` says so once. A task killed
with SIGKILL leaves the mount behind; the next sandbox's orphan cleanup unmounts it
(:func:`unmount_workdir`) before removing the folder. This module imports no Airflow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import shutil
from pathlib import Path

__all__ = ["mount_workdir", "remove_workdir", "unmount_workdir"]

from cancellable_agents.core.once import Once

log = logging.getLogger(__name__)

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


def remove_workdir(workdir: Path) -> None:
    """Remove a workdir the sandbox created, its tmpfs (if any) first: removing only the files
    would leave the mount, and the folder under it, behind."""
    unmount_workdir(workdir)
    shutil.rmtree(workdir, ignore_errors=True)


def _note(reason: str) -> None:
    if not _noted.first():
        return
    log.warning(
        "LocalSandbox: the workdir has no total size here (%s); each file is capped at "
        "Limits.file_size_bytes, not their sum. A root worker mounts a tmpfs of Limits.workdir_bytes.",
        reason,
    )
