"""Owner tags: which process made something that a SIGKILL of the task would leave behind.

A task killed with SIGKILL cannot remove what it made outside itself (a sandbox's workdir, its
cgroup). Named after its owner (``<pid namespace>.<pid>.<start time>``), such a thing can be
removed by a later process once that owner is gone for sure: the same pid namespace, and that pid
is not that process any more. An owner in another pid namespace (sharing ``/tmp``, say) cannot be
checked from here, so what it made is never touched. Airflow-free.
"""

from __future__ import annotations

import os
import re

from cancellable_agents.procs._proc import read_proc

__all__ = ["OWNER_TAG", "owner_gone", "owner_tag"]

#: An owner tag as a pattern (its groups: ``ns``, ``pid``, ``start``), to find one in a name.
OWNER_TAG = r"(?P<ns>\d+)\.(?P<pid>\d+)\.(?P<start>\d+)"


def owner_tag() -> str | None:
    """This process as an owner tag; ``None`` where /proc does not say."""
    pid = os.getpid()
    namespace, info = _pid_namespace(), read_proc(pid)
    if namespace is None or info is None:
        return None
    return f"{namespace}.{pid}.{int(info.start)}"


def owner_gone(tag: str) -> bool:
    """Whether the owner ``tag`` names is gone for sure: ``False`` for a malformed tag or one from
    another pid namespace, whose owner cannot be checked from here."""
    match = re.fullmatch(OWNER_TAG, tag)
    namespace = _pid_namespace()
    if match is None or namespace is None or int(match["ns"]) != namespace:
        return False
    info = read_proc(int(match["pid"]))
    return info is None or info.exited or int(info.start) != int(match["start"])


def _pid_namespace() -> int | None:
    """This process's pid namespace inode; ``None`` (no owner to name or check) where /proc does
    not say, or is another namespace's /proc, whose pids are not ours."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
