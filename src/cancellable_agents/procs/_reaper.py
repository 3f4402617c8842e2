"""Find, stop and reap the processes a run left behind, and only those.

Airflow signals the task process (or its process group), never the grandchildren an agent's
tools started: a ``setsid``'d or double-forked child survives the task and keeps running on the
worker. [`DescendantReaper`][] closes that gap for a whole task process on Linux:

- it makes the task process a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), so orphans
  of the run are reparented to the task process instead of to PID 1 and stay findable;
- it snapshots the descendants that already exist when the run starts and never touches them
  (nor what they start): they belong to whoever started them;
- a daemon thread polls the process tree every ~50 ms while the run is active, so processes that
  later escape the tree (``setsid``, reparenting) are still known by pid and start time; while
  the task process has no child at all a poll is one ``waitid`` that reaps nothing;
- on cancel (a ``Phase.TEARDOWN`` resource) or on [`DescendantReaper.reap`][] it sends SIGTERM
  to everything the run started, SIGKILLs what is left inside the scope's budget, reaps the
  zombies reparented to the task process, and records each kill on the scope;
- orphans reparented to the task process are reaped as soon as they exit; only a zombie child
  this process may have forked itself is left a short ``owner_grace`` for its ``Popen`` to wait.

The low-level helpers live in [`cancellable_agents.procs._proc`][] (shared with the sandbox).
Airflow-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cancellable_agents.core.timeline import KillRecord
from cancellable_agents.procs._proc import (
    IS_LINUX,
    ProcInfo,
    ProcKey,
    become_subreaper,
    children_born_in_own_pid_namespace,
    command_line,
    gone,
    has_children,
    is_running,
    nested_pid_namespace,
    read_proc,
    reap_zombie,
    terminate,
    wait_until,
    walk_descendants,
)

if TYPE_CHECKING:
    from cancellable_agents.core.scope import ResourceHandle, TaskCancellation

log = logging.getLogger(__name__)

# -- the reaper -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Seen:
    key: ProcKey
    command: str
    orphan: bool
    """Nobody in this process will ever wait for it: it was first seen as another process's
    child, or it is our child but provably was not forked here (see ``_reparented``)."""


class DescendantReaper:
    """Stops, on cancel, every process the run started in this process's subtree.

    Create with [`start`][] when the run starts. Thread-safe; [`reap`][] is idempotent.
    It never signals this process, its threads, processes that existed before [`start`][],
    or anything started by those. It works per *process*: it cannot tell which scope started a
    descendant, so use one per task process (Airflow's model), not one per scope in a shared one.
    """

    #: How often the tree is polled while the run is active.
    poll_interval = 0.05
    #: Longest SIGTERM grace before SIGKILL (always also bounded by the scope's budget).
    term_grace = 1.0
    #: Budget kept back after the SIGTERM grace for SIGKILL and reaping.
    kill_reserve = 0.5
    #: How long zombie children this process may have forked itself are left for their owners
    #: (``Popen``, asyncio) to reap: one window per ``reap`` shared by all of them, so it never
    #: adds up per process. Orphans reparented to us have no owner here and never wait for it.
    owner_grace = 0.1

    def __init__(self, baseline: dict[int, float]) -> None:
        self._pid = os.getpid()
        self._sid = os.getsid(0)
        self._own_namespace_children = children_born_in_own_pid_namespace()
        self._baseline = baseline
        self._seen: dict[int, _Seen] = {}
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._stopped = threading.Event()
        self._owner_deadline = 0.0
        self._handle: ResourceHandle | None = None
        self._thread: threading.Thread | None = None
        self.subreaper = False

    @classmethod
    def start(cls, scope: TaskCancellation) -> DescendantReaper | None:
        """Start watching this process's descendants for ``scope``; ``None`` off Linux."""
        if not IS_LINUX:
            log.debug("DescendantReaper needs Linux (/proc, PR_SET_CHILD_SUBREAPER); not started")
            return None
        from cancellable_agents.core.unwind import Phase

        subreaper = become_subreaper()
        baseline = {pid: info.start for pid, info in walk_descendants(os.getpid()).items()}
        reaper = cls(baseline)
        reaper.subreaper = subreaper
        reaper._handle = scope.register(
            lambda: reaper.reap(scope), name="descendant reaper", phase=Phase.TEARDOWN, inline=True
        )
        reaper._thread = threading.Thread(target=reaper._poll, name="cancellable-agents-reaper", daemon=True)
        reaper._thread.start()
        scope.record("reaper_started", subreaper=subreaper, preexisting=len(baseline))
        return reaper

    # -- watching ------------------------------------------------------------------------

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            try:
                self._scan()
            except Exception as exc:  # the watcher must never die of a transient /proc race
                log.debug("descendant scan failed: %r", exc)

    def _is_preexisting(self, info: ProcInfo) -> bool:
        return self._baseline.get(info.pid) == info.start

    def _scan(self) -> dict[int, ProcInfo]:
        """Record every current descendant started during the run; reap known orphans.

        Nothing to read while this process has no child: a descendant has a child of ours above
        it (an orphan reparents to us, the subreaper), and an orphan of ours that exited is our
        zombie child. So a run that starts no process costs a poll one syscall, not a walk of
        every thread's children (at 20 polls a second, nearly 1 % of a core per task process).
        """
        if not has_children():
            return {}
        current = walk_descendants(self._pid, skip=self._is_preexisting)
        with self._lock:
            for pid, info in current.items():
                known = self._seen.get(pid)
                if known is None or known.key.start != info.start:
                    orphan = info.ppid != self._pid or self._reparented(info)
                    self._seen[pid] = _Seen(ProcKey(pid, info.start), command_line(pid), orphan)
            orphans = [s.key for s in self._seen.values() if s.orphan]
        # An orphan that exits on its own is our zombie and nobody else will ever wait for it.
        for key in orphans:
            reap_zombie(key)
        return current

    def _reparented(self, info: ProcInfo) -> bool:
        """Whether ``info``, a child of this process, provably was not forked by it.

        A process forked here is born in our session and, unless we unshared one for our
        children, in our PID namespace; the only way out of the session is to lead a new one
        (``setsid``). So a child in a session that is neither ours nor its own (the ``(cmd &)``
        orphan of a shell that started a new session), or in a nested PID namespace (bubblewrap's
        init, once the outer ``bwrap`` exited), was reparented to us as the subreaper: no
        ``Popen`` or asyncio watcher here knows its pid, so waiting for one to reap it only
        wastes the owner grace. Anything else may have an owner here and keeps its grace.
        """
        if os.getsid(0) == self._sid and info.sid not in (info.pid, self._sid):
            return True
        return self._own_namespace_children and nested_pid_namespace(info.pid)

    def descendants(self) -> list[int]:
        """Pids of the run's descendants that are still running (for tests and logs)."""
        with self._lock:
            keys = [s.key for s in self._seen.values()]
        return sorted(k.pid for k in keys if is_running(k))

    def close(self) -> None:
        """Stop watching without killing anything (the run ended normally)."""
        self._stopped.set()
        if self._handle is not None:
            self._handle.unregister()

    # -- killing -------------------------------------------------------------------------

    def reap(self, scope: TaskCancellation) -> list[KillRecord]:
        """Terminate what the run started, reap the zombies, record the kills; return them.

        Idempotent: a second call finds nothing left and records nothing.
        """
        with self._reap_lock:
            self._stopped.set()
            self._owner_deadline = time.monotonic() + self.owner_grace
            killed = self._kill_round(scope)
            # Something may have forked while it was being terminated: sweep until quiet.
            for _ in range(2):
                more = self._kill_round(scope, grace=0.0)
                if not more:
                    break
                killed.extend(more)
            self._reap_leftover_zombies(scope)
            if self._handle is not None:
                self._handle.unregister()
            return killed

    def _targets(self) -> dict[ProcKey, _Seen]:
        current = self._scan()
        with self._lock:
            seen = dict(self._seen)
        targets = {s.key: s for s in seen.values() if s.key.pid != self._pid}
        for pid, info in current.items():
            targets.setdefault(ProcKey(pid, info.start), seen[pid])
        return {key: s for key, s in targets.items() if is_running(key)}

    def _kill_round(self, scope: TaskCancellation, grace: float | None = None) -> list[KillRecord]:
        targets = self._targets()
        if not targets:
            return []
        if grace is None:
            grace = max(0.0, min(self.term_grace, scope.remaining() - self.kill_reserve))
        # Read now, not when first seen: a process first seen as a shell's fork may have exec'd since.
        commands = {key: command_line(key.pid) or seen.command for key, seen in targets.items()}
        signals = terminate(targets, grace, kill_wait=max(0.2, min(1.0, scope.remaining())))
        records = []
        for key, seen in targets.items():
            if key.pid not in signals:
                continue  # it exited on its own before the signal
            exit_code = self._collect(key, seen, scope)
            record = KillRecord(
                source="descendant_reaper",
                pid=key.pid,
                signal=signals[key.pid],
                exit_code=exit_code,
                command=commands[key],
                at=round(time.time(), 3),
            )
            scope.record_killed(record)
            records.append(record)
        return records

    def _collect(self, key: ProcKey, seen: _Seen, scope: TaskCancellation) -> int | None:
        """Reap ``key`` if it is our zombie; a child that may have an owner here (a ``Popen``
        about to wait for it) first gets what is left of the shared owner grace."""
        if not seen.orphan:
            left = min(self._owner_deadline - time.monotonic(), scope.remaining())
            wait_until(lambda: gone(key), max(0.0, left))
        return reap_zombie(key)

    def _reap_leftover_zombies(self, scope: TaskCancellation) -> None:
        with self._lock:
            seen = list(self._seen.values())
        for item in seen:
            info = read_proc(item.key.pid)
            if info is None or info.start != item.key.start or not info.exited:
                continue
            code = self._collect(item.key, item, scope)
            if code is not None:
                scope.record("zombie_reaped", pid=item.key.pid, exit_code=code)
