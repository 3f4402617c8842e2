"""A sandbox's totals where the kernel keeps none: processes, memory and disk, counted.

Where the worker can make a cgroup per sandbox, the kernel bounds its process count and memory,
and a tmpfs bounds its workdir and tmp. An unprivileged pod (uid 50000, no capabilities) can make
neither, and the per-process limits left (``RLIMIT_AS``, ``RLIMIT_NPROC``) do not add up: six
processes each under ``memory_bytes`` hold six times it, and ``RLIMIT_NPROC`` counts every process
of the worker's user, the task's and other tasks' included, so no value of it bounds one sandbox.

But the sandbox owns its whole tree (each Landlock-mode command runs under a subreaper init that
no process can leave; a namespace-mode command's tree is bubblewrap's), so it can count it:
[`TotalsWatcher`][cancellable_agents.toolsets.sandbox.local._totals.TotalsWatcher] samples the trees of the
running commands every ``INTERVAL`` (the
workdir and tmp every ``DISK_INTERVAL``) and, at the first total past its limit, calls the
sandbox back, which SIGKILLs every running command at once and names the limit in each result
and kill record. This is reactive: a fork storm or a fast writer can pass the limit by what it
does between two samples (the reaction time is measured in ``benchmarks/sandbox_kill_latency.py``);
the stop that follows is not (the init freezes the tree before it kills). Memory is the sum of
each process's PSS (shared pages counted once, as a cgroup would), read only once the cheaper RSS
sum is past the limit. This module imports no Airflow.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cancellable_agents.procs._proc import children_of

__all__ = ["DISK_INTERVAL", "INTERVAL", "LimitBreach", "TotalsWatcher", "folder_bytes", "tree_pids"]

log = logging.getLogger(__name__)

#: How often the process count and memory are sampled.
INTERVAL = 0.05
#: How often the workdir and tmp are measured (a walk of their files costs more).
DISK_INTERVAL = 0.2
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class LimitBreach:
    """A sandbox total past its limit: which (a ``Limits`` field name), by how much."""

    limit: str
    value: int
    allowed: int

    def describe(self) -> str:
        if self.limit == "max_processes":
            return f"max_processes: {self.value} processes > {self.allowed}"
        return f"{self.limit}: {self.value / 2**20:.1f} MiB > {self.allowed / 2**20:.1f} MiB"


def tree_pids(roots: Iterable[int]) -> list[int]:
    """Every process below ``roots`` (not the roots: an init or bubblewrap's outer process)."""
    found: list[int] = []
    seen: set[int] = set()
    pending = list(roots)
    while pending:
        for child in children_of(pending.pop()):
            if child not in seen:
                seen.add(child)
                found.append(child)
                pending.append(child)
    return found


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _pss(pid: int) -> int:
    """Proportional set size (``smaps_rollup``, kernel 4.14+); RSS where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return _rss(pid)


def folder_bytes(root: Path) -> int:
    """Bytes the files below ``root`` take on disk (each inode once; symlinks not followed)."""
    total = 0
    inodes: set[tuple[int, int]] = set()
    pending = [str(root)]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            if (stat.st_dev, stat.st_ino) not in inodes:
                inodes.add((stat.st_dev, stat.st_ino))
                total += stat.st_blocks * 512
    return total


class TotalsWatcher:
    """Samples a sandbox's totals on a thread of its own and reports the first breach.

    ``roots()`` gives the main pids of the running commands not yet being stopped (``None``
    once the sandbox is gone); ``folders``
    maps a limit name (``"workdir_bytes"``, ``"tmp_bytes"``) to the folder it bounds and its
    size; ``on_breach`` is called on the watcher's thread at each sample that finds a total past
    its limit while such a command runs (a workdir still past its size stops the next command
    too: the sandbox is over its limit until its files shrink).
    """

    def __init__(
        self,
        *,
        max_processes: int | None,
        memory_bytes: int | None,
        folders: dict[str, tuple[Path, int]],
        roots: Callable[[], list[int] | None],
        on_breach: Callable[[LimitBreach], None],
    ) -> None:
        self.max_processes = max_processes
        self.memory_bytes = memory_bytes
        self.folders = folders
        self._roots = roots
        self._on_breach = on_breach
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def needed(self) -> bool:
        """Whether there is a total to watch at all."""
        return self.max_processes is not None or self.memory_bytes is not None or bool(self.folders)

    def ensure_started(self) -> None:
        """Start the sampling thread (once; at the sandbox's first command)."""
        with self._lock:
            if self._thread is not None or self._closed.is_set() or not self.needed:
                return
            self._thread = threading.Thread(target=self._watch, name="sandbox-totals", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop sampling (idempotent; returns without waiting for a sample in progress)."""
        self._closed.set()

    def check(self, *, disk: bool = True) -> LimitBreach | None:
        """One sample: the first total past its limit, or ``None``."""
        roots = self._roots()
        if roots is None:  # the sandbox is gone: so is the watch
            self.close()
            return None
        if not roots:
            return None
        if self.max_processes is not None or self.memory_bytes is not None:
            pids = tree_pids(roots)
            if self.max_processes is not None and len(pids) > self.max_processes:
                return LimitBreach("max_processes", len(pids), self.max_processes)
            if self.memory_bytes is not None:
                breach = self._memory(pids, self.memory_bytes)
                if breach is not None:
                    return breach
        if disk:
            for limit, (folder, allowed) in self.folders.items():
                used = folder_bytes(folder)
                if used > allowed:
                    return LimitBreach(limit, used, allowed)
        return None

    @staticmethod
    def _memory(pids: list[int], allowed: int) -> LimitBreach | None:
        if sum(_rss(pid) for pid in pids) <= allowed:
            return None  # RSS counts shared pages in every process: never below PSS
        held = sum(_pss(pid) for pid in pids)
        return LimitBreach("memory_bytes", held, allowed) if held > allowed else None

    def _watch(self) -> None:
        every = max(1, round(DISK_INTERVAL / INTERVAL))
        tick = 0
        while not self._closed.wait(INTERVAL):
            tick += 1
            try:
                breach = self.check(disk=tick % every == 0)
            except Exception as exc:  # a /proc race must not end the watch
                log.debug("sandbox totals: sample failed: %r", exc)
                continue
            if breach is not None:
                self._on_breach(breach)
