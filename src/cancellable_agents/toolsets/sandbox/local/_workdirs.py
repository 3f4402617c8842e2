"""Sandbox working directories that outlive a SIGKILLed task are removed by the next sandbox.

A task killed with SIGKILL (the pod's grace ran out, the OOM killer) cannot remove the workdir
its ``LocalSandbox`` created, and a sandbox's files can be large. So a workdir we create is
named after its owner: the pid namespace, pid and start time of the process that created it.
Creating a workdir first removes those whose owner is gone (same namespace, that pid is not that
process any more). A directory without that name (someone else's, an older version's), or
whose owner lives in another pid namespace sharing this ``/tmp``, is never touched: its owner
cannot be checked from here ([`cancellable_agents.procs._owner`][cancellable_agents.procs._owner]). Nor,
unless we are root, is
another user's: a sticky ``/tmp`` refuses its removal and only root may unmount its tmpfs (a
non-root worker beside a root one would otherwise log a failed unmount at every start).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from cancellable_agents.procs._owner import OWNER_TAG, owner_gone, owner_tag
from cancellable_agents.toolsets.sandbox.local.boundary._quotas import unmount_workdir

__all__ = [
    "WORKDIR_PREFIX",
    "new_workdir",
    "prepare_workdir",
    "remove_orphaned_workdirs",
    "remove_workdir",
]

log = logging.getLogger(__name__)

WORKDIR_PREFIX = "cancellable-agents-sandbox-"

_OWNED = re.compile(re.escape(WORKDIR_PREFIX) + "(?P<owner>" + OWNER_TAG + ")-")


def new_workdir() -> Path:
    """A fresh workdir in the temp folder, named after this process (after removing orphans)."""
    remove_orphaned_workdirs()
    owner = owner_tag()
    prefix = f"{WORKDIR_PREFIX}{owner}-" if owner else WORKDIR_PREFIX
    return Path(tempfile.mkdtemp(prefix=prefix)).resolve()


def prepare_workdir(workdir: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The resolved workdir (a
    [`new_workdir`][cancellable_agents.toolsets.sandbox.local._workdirs.new_workdir] if ``None``, created if
    missing) and whether
    we created it (and so may delete it)."""
    if workdir is None:
        return new_workdir(), True
    path = Path(workdir).resolve()
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, not existed


def remove_workdir(workdir: Path) -> None:
    """Remove a workdir the sandbox created, its tmpfs (if any) first: removing only the files
    would leave the mount, and the folder under it, behind.

    A command may leave folders it cannot be removed from (``chmod 000``, a read-only folder):
    root ignores modes, a non-root worker does not, so what is left after a first pass is made
    traversable and writable (by descriptor, never through a symlink) and removed again."""
    unmount_workdir(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    if not os.path.lexists(workdir):
        return
    _unlock_folders(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    if os.path.lexists(workdir):
        log.warning("sandbox workdir %s could not be removed completely", workdir)


def _unlock_folders(root: Path) -> None:
    """Give the owner ``rwx`` on ``root`` and every folder below it. Each folder is opened
    ``O_NOFOLLOW`` relative to its parent's descriptor and changed through that descriptor, so a
    symlink planted anywhere is never followed out of the tree."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        _chmod_path(root)
        try:
            top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return
    pending = [top]
    while pending:
        fd = pending.pop()
        try:
            for name in _folder_names(fd):
                child = _open_folder(fd, name)
                if child is not None:
                    pending.append(child)
        finally:
            os.close(fd)


def _chmod_path(path: Path) -> None:
    """``chmod u+rwx`` of the folder ``path`` itself (not a symlink's target)."""
    try:
        handle = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        _add_owner_rights(handle)
    finally:
        os.close(handle)


def _add_owner_rights(fd: int) -> None:
    # fchmod refuses an O_PATH descriptor; its /proc/self/fd entry names that very folder.
    try:
        mode = os.fstat(fd).st_mode
        os.chmod(f"/proc/self/fd/{fd}", (mode & 0o7777) | 0o700)
    except OSError:
        pass


def _folder_names(fd: int) -> list[str]:
    try:
        return [entry.name for entry in os.scandir(fd) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _open_folder(parent: int, name: str) -> int | None:
    """The sub-folder ``name`` of ``parent``, made ``u+rwx`` and opened for reading."""
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:
        return None  # gone, or a symlink swapped in: not followed
    try:
        _add_owner_rights(handle)
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    finally:
        os.close(handle)


def remove_orphaned_workdirs(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the workdirs in ``root`` (the temp folder) whose owning process is gone."""
    folder = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    for entry in folder.glob(WORKDIR_PREFIX + "*"):
        match = _OWNED.match(entry.name)
        if match is None or not _ours_to_remove(entry) or not owner_gone(match["owner"]):
            continue
        remove_workdir(entry)
        if not entry.exists():
            removed.append(entry)
    if removed:
        log.info(
            "removed %d sandbox workdir(s) left by tasks that were killed before they could clean up: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def _ours_to_remove(entry: Path) -> bool:
    """Root may remove any orphan; another user only its own."""
    uid = os.geteuid()
    if uid == 0:
        return True
    try:
        return entry.lstat().st_uid == uid
    except OSError:
        return False
