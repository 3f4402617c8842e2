"""Sandbox working directories that outlive a SIGKILLed task are removed by the next sandbox.

A task killed with SIGKILL (the pod's grace ran out, the OOM killer) cannot remove the workdir
its :class:`LocalSandbox` created, and a sandbox's files can be large. So a workdir we create is
named after its owner: the pid namespace, pid and start time of the process that created it.
Creating a workdir first removes those whose owner is gone (same namespace, that pid is not that
process any more). A directory without that name (someone else's, an older version's), or
whose owner lives in another pid namespace sharing this ``/tmp``, is never touched: its owner
cannot be checked from here.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

from cancellable_agents.procs.proc import read_proc
from cancellable_agents.toolsets.sandbox.workdir_size import remove_workdir

__all__ = [
    "WORKDIR_PREFIX",
    "new_workdir",
    "owner_gone",
    "owner_tag",
    "prepare_workdir",
    "remove_orphaned_workdirs",
]

log = logging.getLogger(__name__)

WORKDIR_PREFIX = "cancellable-agents-sandbox-"

_TAG = r"(?P<ns>\d+)\.(?P<pid>\d+)\.(?P<start>\d+)"
_OWNED = re.compile(re.escape(WORKDIR_PREFIX) + _TAG + "-")


def new_workdir() -> Path:
    """A fresh workdir in the temp folder, named after this process (after removing orphans)."""
    remove_orphaned_workdirs()
    owner = _owner_tag(os.getpid())
    prefix = f"{WORKDIR_PREFIX}{owner}-" if owner else WORKDIR_PREFIX
    return Path(tempfile.mkdtemp(prefix=prefix)).resolve()


def prepare_workdir(workdir: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The resolved workdir (a :func:`new_workdir` if ``None``, created if missing) and whether
    we created it (and so may delete it)."""
    if workdir is None:
        return new_workdir(), True
    path = Path(workdir).resolve()
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, not existed


def remove_orphaned_workdirs(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the workdirs in ``root`` (the temp folder) whose owning process is gone."""
    namespace = _pid_namespace()
    if namespace is None:
        return []
    folder = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    for entry in folder.glob(WORKDIR_PREFIX + "*"):
        match = _OWNED.match(entry.name)
        if match is None or int(match["ns"]) != namespace or _owner_alive(match):
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


def owner_tag() -> str | None:
    """This process as an owner tag (pid namespace, pid, start time) for the name of something a
    SIGKILL of the task would leave behind (a workdir, a sandbox cgroup); ``None`` where unknown."""
    return _owner_tag(os.getpid())


def owner_gone(tag: str) -> bool:
    """Whether the owner ``tag`` names is gone for sure: ``False`` for a malformed tag or one from
    another pid namespace, whose owner cannot be checked from here."""
    match = re.fullmatch(_TAG, tag)
    namespace = _pid_namespace()
    if match is None or namespace is None or int(match["ns"]) != namespace:
        return False
    return not _owner_alive(match)


def _owner_alive(match: re.Match[str]) -> bool:
    info = read_proc(int(match["pid"]))
    return info is not None and not info.exited and int(info.start) == int(match["start"])


def _owner_tag(pid: int) -> str | None:
    namespace, info = _pid_namespace(), read_proc(pid)
    if namespace is None or info is None:
        return None
    return f"{namespace}.{pid}.{int(info.start)}"


def _pid_namespace() -> int | None:
    """This process's pid namespace inode; ``None`` (no sweeping, no owner in the name) where
    /proc does not say, or is another namespace's /proc, whose pids are not ours."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
