"""A cgroup per sandbox: memory and process count for all its commands together.

Per-process limits (``setrlimit``) let six processes under a 256 MiB limit hold ~950 MiB
between them. A cgroup counts the whole sandbox: every command, everything each one starts,
the private ``/tmp`` (a tmpfs is memory) and bubblewrap's own two processes per command.

Where: a child of the worker's own cgroup, in cgroup v2 (where the worker's cgroup delegates
``memory`` and ``pids`` to its children, as with systemd's ``Delegate=yes``) or in the v1
``memory`` and ``pids`` hierarchies (where the worker may create folders, as root in most
containers). [`cgroup_support`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups.cgroup_support]
probes once per process; where neither works, sandboxes
keep the per-process limits and
[`note_if_missing`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups.note_if_missing] says so
once.

Placement: each command starts as ``/bin/sh -c 'echo $$ > .../cgroup.procs ... && exec bwrap
...'``, so its first process is in the cgroup before it execs anything, and all it starts is
born inside (there is no window in which a fork escapes). A failed write ends the command
(exit 125) rather than running it unconfined. The command cannot move itself out: the boundary
profile shows no ``/sys``, and its uid may not write the cgroup's files. Removed by
[`SandboxCgroup.remove`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups.SandboxCgroup.remove]
once every command is dead. This module imports no Airflow.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cancellable_agents.core._once import Once
from cancellable_agents.procs._owner import owner_gone, owner_tag

__all__ = [
    "PLACEMENT_FAILED",
    "CgroupSupport",
    "LimitHits",
    "SandboxCgroup",
    "cgroup_support",
    "note_if_missing",
]

log = logging.getLogger(__name__)

#: The exit code of a command that could not be placed in its sandbox's cgroup (it never ran).
PLACEMENT_FAILED = 125
#: How long
#: [`SandboxCgroup.remove`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups.SandboxCgroup.remove]
#: waits for the kernel to let go of exited processes.
REMOVE_WAIT = 2.0
_NAME_PREFIX = "cancellable-agents-"


@dataclass(frozen=True)
class CgroupSupport:
    """Where this process can create a cgroup per sandbox (probed once)."""

    version: int | None
    """2, 1, or ``None``: no cgroup per sandbox here (``reason`` says why)."""
    memory_parent: Path | None = None
    pids_parent: Path | None = None
    """The folders sandbox cgroups are created in (the same folder in v2)."""
    reason: str = ""


@dataclass(frozen=True)
class LimitHits:
    """How often the kernel enforced a sandbox's totals: counters that only grow, so the hits
    during one command are the difference of two readings (``since``)."""

    oom_kills: int
    """Processes the OOM killer ended at the memory total."""
    fork_failures: int
    """Forks refused at the process total."""

    def since(self, earlier: LimitHits) -> LimitHits:
        return LimitHits(self.oom_kills - earlier.oom_kills, self.fork_failures - earlier.fork_failures)


@dataclass(frozen=True)
class SandboxCgroup:
    """One sandbox's cgroup(s): created with its limits, joined by every command, removed at the end."""

    version: int
    paths: tuple[Path, ...]
    """One folder in v2; the ``memory`` then the ``pids`` folder in v1."""

    @classmethod
    def create(
        cls, name: str, *, memory_bytes: int | None, max_processes: int | None
    ) -> SandboxCgroup | None:
        """A new cgroup named after the sandbox with these limits, or ``None`` (logged once) where
        this worker cannot make one: the caller then keeps the per-process limits."""
        if memory_bytes is None and max_processes is None:
            return None
        support = cgroup_support()
        if support.version is None:
            _note(support.reason)
            return None
        assert support.memory_parent is not None and support.pids_parent is not None
        parents = [support.memory_parent]
        if support.pids_parent != support.memory_parent:
            parents.append(support.pids_parent)
        for parent in parents:
            _remove_orphans(parent)
        # Named after its owner, so that a later sandbox can tell one a SIGKILLed task left behind.
        folder = f"{_NAME_PREFIX}{owner_tag() or 'unknown'}-{name}"
        paths = tuple(parent / folder for parent in parents)
        cgroup = cls(support.version, paths)
        try:
            for path in paths:
                path.mkdir()
            cgroup._set_limits(memory_bytes, max_processes)
        except OSError as exc:
            cgroup.remove()
            _note(f"creating the sandbox's cgroup failed ({exc})")
            return None
        return cgroup

    def _set_limits(self, memory_bytes: int | None, max_processes: int | None) -> None:
        if self.version == 2:
            _write(self.paths[0] / "memory.max", memory_bytes)
            _write(self.paths[0] / "memory.swap.max", 0 if memory_bytes is not None else None, optional=True)
            _write(self.paths[0] / "pids.max", max_processes)
            return
        memory, pids = self.paths[0], self.paths[-1]
        _write(memory / "memory.limit_in_bytes", memory_bytes)
        # Memory plus swap: the same total, or swapping out would be the way past the limit.
        _write(memory / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        _write(pids / "pids.max", max_processes)

    def placement_prefix(self) -> list[str]:
        """The argv prefix that puts a command's first process into this cgroup before it execs
        the rest (``sh`` writes its own pid, then ``exec``s: same pid, already inside)."""
        procs = [str(path / "cgroup.procs") for path in self.paths]
        writes = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(procs)))
        script = f'{{ {writes}; }} || exit {PLACEMENT_FAILED}; shift {len(procs)}; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *procs]

    def memory_events(self) -> int:
        """How often the kernel's OOM killer has ended a process of this sandbox (0 if unknown)."""
        if self.version == 2:
            return _read_key(self.paths[0] / "memory.events", "oom_kill")
        return _read_key(self.paths[0] / "memory.oom_control", "oom_kill")

    def process_limit_hits(self) -> int:
        """How often a fork failed at this sandbox's process limit."""
        return _read_key(self.paths[-1] / "pids.events", "max")

    def limit_hits(self) -> LimitHits:
        """Both counters, read now."""
        return LimitHits(self.memory_events(), self.process_limit_hits())

    def remove(self, wait: float = REMOVE_WAIT) -> None:
        """Remove the cgroup(s). Call once the commands are dead: a cgroup with processes cannot
        be removed, and exited ones leave it a moment after they are reaped (retried for ``wait``
        seconds)."""
        deadline = time.monotonic() + wait
        for path in self.paths:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                        log.warning("sandbox cgroup %s could not be removed: %s", path, exc)
                        break
                    time.sleep(0.01)  # the kernel frees the last exited task on its own schedule


def _remove_orphans(parent: Path) -> None:
    """Remove the sandbox cgroups in ``parent`` whose owning task process is gone (a SIGKILLed
    task cannot remove its own). One that still has processes stays (``rmdir`` refuses)."""
    for entry in parent.glob(f"{_NAME_PREFIX}*-*"):
        tag = entry.name[len(_NAME_PREFIX) :].split("-", 1)[0]
        if owner_gone(tag):
            with contextlib.suppress(OSError):
                entry.rmdir()
                log.info("removed sandbox cgroup %s left by a task that was killed", entry)


def _write(path: Path, value: int | None, *, optional: bool = False) -> None:
    if value is None:
        return
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not optional:
            raise


def _read_key(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


# -- probing ---------------------------------------------------------------------------------

_noted = Once()


def note_if_missing() -> None:
    """Once per process: where there is no cgroup per sandbox, say which limits are per process."""
    support = cgroup_support()
    if support.version is None:
        _note(support.reason)


def _note(reason: str) -> None:
    if not _noted.first():
        return
    log.warning(
        "LocalSandbox: no cgroup per sandbox here (%s): boundary-mode sandboxes count "
        "Limits.memory_bytes and max_processes over their commands' trees themselves, every 50 ms, "
        "and kill their commands past them (a fast fork storm or allocation can pass them until "
        "the next count); each process is also bound by address space and RLIMIT_NPROC. For totals "
        "the kernel enforces at every fork and page, run the worker where it may create cgroups: "
        "cgroup v2 with memory and pids delegated to it (systemd Delegate=yes), or v1 memory and "
        "pids hierarchies it can write to.",
        reason,
    )


@functools.cache
def cgroup_support() -> CgroupSupport:
    """Where sandbox cgroups go here: v2 if the worker's cgroup delegates memory and pids, else
    the v1 hierarchies if writable. Probed once per process by creating and removing a child."""
    own = _own_cgroups(Path("/proc/self/cgroup"))
    mounts = _cgroup_mounts(Path("/proc/self/mountinfo"))
    why: list[str] = []
    v2 = mounts.get("cgroup2")
    if v2 is not None and "" in own:
        folder = _inside(v2, own[""])
        if folder is not None and _probe_v2(folder, why):
            return CgroupSupport(2, folder, folder)
    memory, pids = mounts.get("memory"), mounts.get("pids")
    if memory is not None and pids is not None:
        memory_folder = _inside(memory, own.get("memory", ""))
        pids_folder = _inside(pids, own.get("pids", ""))
        if (
            memory_folder is not None
            and pids_folder is not None
            and _probe_v1(memory_folder, why)
            and _probe_v1(pids_folder, why)
        ):
            return CgroupSupport(1, memory_folder, pids_folder)
    return CgroupSupport(None, reason="; ".join(why) or "no cgroup v2 or v1 memory and pids hierarchy")


def _own_cgroups(path: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path (``""`` for the v2 hierarchy)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            _, controllers, cgroup = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                found[controller] = cgroup
    return found


@dataclass(frozen=True)
class _Mount:
    root: str
    """The hierarchy path mounted (``/`` unless in a cgroup namespace or a bind)."""
    point: str


def _cgroup_mounts(path: Path) -> dict[str, _Mount]:
    """``cgroup2`` and each v1 controller -> where its hierarchy is mounted."""
    found: dict[str, _Mount] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            fields = line.split()
            dash = fields.index("-")
            fstype, options = fields[dash + 1], fields[dash + 3].split(",")
            mount = _Mount(root=fields[3], point=fields[4])
            if fstype == "cgroup2":
                found.setdefault("cgroup2", mount)
            elif fstype == "cgroup":
                for option in options:
                    found.setdefault(option, mount)
    return found


def _inside(mount: _Mount, cgroup: str) -> Path | None:
    """The folder of ``cgroup`` under ``mount``, or ``None`` if that mount does not show it."""
    if mount.root != "/" and cgroup != mount.root and not cgroup.startswith(mount.root + "/"):
        return None
    relative = cgroup[len(mount.root) :] if mount.root != "/" else cgroup
    folder = Path(mount.point, relative.lstrip("/"))
    return folder if folder.is_dir() else None


def _probe_v2(folder: Path, why: list[str]) -> bool:
    """A child of ``folder`` gets memory and pids (enabling them if this worker may)."""
    if not {"memory", "pids"} <= set(_words(folder / "cgroup.subtree_control")):
        try:
            (folder / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError as exc:
            why.append(f"cgroup v2: {folder} does not delegate memory and pids ({exc.strerror})")
            return False
    return _probe_v1(folder, why)


def _probe_v1(folder: Path, why: list[str]) -> bool:
    probe = folder / f"{_NAME_PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        pass
    except OSError as exc:
        why.append(f"cannot create cgroups in {folder} ({exc.strerror})")
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []
