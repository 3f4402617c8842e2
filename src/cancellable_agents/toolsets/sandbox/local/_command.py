"""One sandbox command's process tree: watched while it runs, stopped whole, reaped, recorded.

[`CommandTree`][cancellable_agents.toolsets.sandbox.local._command.CommandTree] is everything
[`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox]
knows about one command once it was spawned: its main process, every descendant the watcher has
seen, its bounded output, its result. It decides how that tree ends: on its own (whatever it left
running in the background is killed), at its timeout, or by a stop (SIGTERM to the whole tree,
the grace, SIGKILL, reap, one [`KillRecord`][cancellable_agents.core.timeline.KillRecord] per process on the
sandbox's scope). The sandbox
keeps the workdir, the profile and the registry of its commands. This module imports no Airflow.

One module of ~500 lines: a tree's watcher, its stop and its reaping change the same state under
one lock (``CommandTree.lock``: who stops it once, what was seen, what was swept), so they stay
together; its spawning lives in ``spawn``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.core.timeline import KillRecord
from cancellable_agents.procs._owner import owner_gone
from cancellable_agents.procs._proc import (
    ProcKey,
    all_pids,
    children_of,
    command_line,
    environ_contains,
    is_running,
    nested_pid_namespace,
    read_proc,
    reap_zombie,
    send_signal,
    wait_gone,
    walk_descendants,
)
from cancellable_agents.toolsets.sandbox.local._isolation import Mode
from cancellable_agents.toolsets.sandbox.local._spawn import BoundedReader
from cancellable_agents.toolsets.sandbox.local._totals import LimitBreach
from cancellable_agents.toolsets.sandbox.local.boundary._cgroups import LimitHits, SandboxCgroup
from cancellable_agents.toolsets.sandbox.local.boundary._command_init import parse_report
from cancellable_agents.toolsets.sandbox.protocol import CommandResult

__all__ = [
    "KILL_WAIT",
    "OWNER_VAR",
    "READER_JOIN",
    "STOP_SLACK",
    "CommandOwner",
    "CommandTree",
    "kill_orphaned_commands",
    "stop_bound",
]

log = logging.getLogger(__name__)

#: How often a running command's process tree is scanned for new descendants.
TRACK_INTERVAL = 0.02
#: Budget kept back after the SIGTERM grace for SIGKILL, reaping and the record.
KILL_RESERVE = 0.3
#: How long to wait for SIGKILLed processes to disappear.
KILL_WAIT = 1.0
#: How long output readers may take to drain once the tree is gone.
READER_JOIN = 1.0
#: Scheduling slack on top of the parts of a stop (see
#: [`CommandTree.stop_bound`][cancellable_agents.toolsets.sandbox.local._command.CommandTree.stop_bound]).
STOP_SLACK = 2.0
#: Environment variable carrying the owner tag of the task process that started a command
#: ([`owner_tag`][cancellable_agents.procs._owner.owner_tag]), where no namespace ends the command with
#: the task: after a SIGKILL of the task,
#: [`kill_orphaned_commands`][cancellable_agents.toolsets.sandbox.local._command.kill_orphaned_commands]
#: finds what it left.
OWNER_VAR = "CANCELLABLE_AGENTS_OWNER"


class CommandOwner(Protocol):
    """What a command needs of its sandbox, read at each use: its ``scope`` is the one of the
    sandbox's attachment, which may come after the command started."""

    @property
    def id(self) -> str: ...

    @property
    def stop_grace(self) -> float: ...

    @property
    def scope(self) -> TaskCancellation | None: ...


def stop_bound(stop_grace: float) -> float:
    """The longest stopping one command can take: the SIGTERM grace, the SIGKILL wait, the
    output drain, and slack for a busy machine. Every wait for a stop is bounded by it."""
    return stop_grace + KILL_WAIT + READER_JOIN + STOP_SLACK


@dataclass(eq=False)
class CommandTree:
    """One spawned command and every process it started, until its result is recorded.

    ``watch`` starts the watcher thread; ``terminate`` stops the whole tree (once,
    whoever asks first; later callers wait for that stop). ``done`` is set, and ``result``
    filled, once the tree is gone and reaped.
    """

    id: str
    owner: CommandOwner
    popen: subprocess.Popen[bytes]
    main: ProcKey
    mode: Mode
    tag: bytes
    started: float
    timeout: float | None
    stdout: BoundedReader
    stderr: BoundedReader
    tracked: dict[int, ProcKey] = field(default_factory=dict)
    infra: set[ProcKey] = field(default_factory=set)
    #: Found by a stop's sweep (group or tag) but never by the tracker: e.g. the ``(cmd &)``
    #: orphan, reparented before the tracker's first look. Ours to reap all the same.
    swept: set[ProcKey] = field(default_factory=set)
    #: The sandbox's cgroup and its counters read just before the spawn: the result says which
    #: limits the kernel enforced while this command ran.
    cgroup: SandboxCgroup | None = None
    hits_before: LimitHits | None = None
    #: Landlock mode: the main process is the command's init (``boundary.command_init``), which
    #: keeps and stops the whole tree; this memfd is its report of what it signalled.
    report_fd: int | None = None
    report_read: bool = False
    #: The sandbox total this command was SIGKILLed at (no grace), where the sandbox counts them.
    breach: LimitBreach | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    terminated: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    stop_reason: str | None = None
    final_signal: int | None = None
    result: CommandResult | None = None
    callbacks: list[Callable[[CommandResult], None]] = field(default_factory=list)

    def add_done_callback(self, callback: Callable[[CommandResult], None]) -> None:
        """Call ``callback(result)`` once the command ended (at once if it already has)."""
        with self.lock:
            if self.result is None:
                self.callbacks.append(callback)
                return
            result = self.result
        callback(result)

    def known(self) -> set[ProcKey]:
        with self.lock:
            return {self.main, *self.tracked.values(), *self.infra, *self.swept}

    def descendants(self) -> list[int]:
        """Pids of the running descendants the tracker has seen (not bwrap itself)."""
        with self.lock:
            keys = list(self.tracked.values())
        return sorted(k.pid for k in keys if is_running(k))

    def stop_bound(self) -> float:
        return stop_bound(self.owner.stop_grace)

    def _grace(self) -> float:
        """SIGTERM grace: ``stop_grace``, but never past the cancelled scope's budget."""
        if self.breach is not None:
            return 0.0
        scope = self.owner.scope
        if scope is None or not scope.cancelled:
            return self.owner.stop_grace
        return max(0.0, min(self.owner.stop_grace, scope.remaining() - KILL_RESERVE))

    # -- watching ------------------------------------------------------------------------

    def watch(self) -> None:
        """Start the watcher thread, which owns the command from here to its result."""
        threading.Thread(target=self._monitor, name=f"sandbox-{self.id}-monitor", daemon=True).start()

    def _monitor(self) -> None:
        """Track the tree until the main process exits, enforce the timeout, then finish."""
        deadline = None if self.timeout is None else self.started + self.timeout
        while not _has_exited(self.popen):
            self._track()
            if deadline is not None and time.monotonic() >= deadline:
                deadline = None
                # Claimed here, before the main process can exit, so the result says timed_out.
                if self._claim("timeout"):
                    threading.Thread(
                        target=self._stop_claimed, name=f"sandbox-{self.id}-timeout", daemon=True
                    ).start()
            if self.wake.wait(TRACK_INTERVAL):
                self.wake.clear()
        self._finish()

    def _track(self) -> None:
        main = read_proc(self.main.pid)
        if main is None or main.start != self.main.start:
            return  # reaped: its pid may already belong to a stranger
        try:
            tree = walk_descendants(self.popen.pid, skip=lambda info: info.start < self.main.start)
            outer_children = set(children_of(self.popen.pid)) if self.mode == "namespace" else set()
        except Exception as exc:  # /proc races must not kill the watcher
            log.debug("sandbox %s: scan failed: %r", self.owner.id, exc)
            return
        with self.lock:
            for pid, info in tree.items():
                key = ProcKey(pid, info.start)
                if pid in outer_children:
                    self.infra.add(key)
                else:
                    self.tracked[pid] = key

    def _finish(self) -> None:
        if self.stop_reason is not None:
            self.terminated.wait(self.stop_bound())
        else:
            self._kill_leftovers()
        self._reap_session_orphans()
        self.popen.wait()  # only now: until here its pid, the group id, could not be recycled
        self._reap_tracked()
        for reader in (self.stdout, self.stderr):
            reader.thread.join(READER_JOIN)
        result = self._result()
        if self.report_fd is not None:
            os.close(self.report_fd)
        with self.lock:
            self.result = result
            callbacks = list(self.callbacks)
            self.done.set()
        for callback in callbacks:
            try:
                callback(result)
            except Exception as exc:
                log.debug("sandbox %s: result callback failed: %r", self.owner.id, exc)

    def _result(self) -> CommandResult:
        stdout, out_cut = self.stdout.text()
        stderr, err_cut = self.stderr.text()
        stopped = self.stop_reason is not None
        returncode = self.popen.returncode if self.popen.returncode is not None else -signal.SIGKILL
        hits = None
        if self.cgroup is not None and self.hits_before is not None:
            hits = self.cgroup.limit_hits().since(self.hits_before)
        return CommandResult(
            command_id=self.id,
            exit_code=-(self.final_signal or signal.SIGTERM) if stopped else returncode,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            timed_out=self.stop_reason == "timeout",
            stopped=stopped,
            duration=round(time.monotonic() - self.started, 4),
            memory_limit_kills=None if hits is None else hits.oom_kills,
            process_limit_hits=None if hits is None else hits.fork_failures,
            limit_exceeded=None if self.breach is None else self.breach.limit,
        )

    def _kill_leftovers(self) -> None:
        """The main process ended on its own (not yet reaped): nothing it started may outlive it."""
        if self.report_fd is not None:
            # The init ends only once it has killed what the command left: record what it did.
            self._record_report("leftover")
            return
        if self.mode == "namespace":
            # The kernel empties the namespace once bwrap's init is gone; just wait for it.
            wait_gone(self.known(), KILL_WAIT)
        leftovers = {k: c for k, c in self._tree().items() if k != self.main}
        if not leftovers:
            return
        sent = {key: int(signal.SIGKILL) for key in leftovers if send_signal(key, signal.SIGKILL)}
        wait_gone(sent, KILL_WAIT)
        self._record(sent, leftovers, reason="leftover")

    def _reap_tracked(self) -> None:
        """Reap the command's processes that were reparented to us (we may be a subreaper).

        The sandbox started and stopped them, so it collects them: left as zombies, they would
        wait out the descendant reaper's owner grace, or stay until the task process exits.
        """
        keys = self.known() - {self.main}
        if self.mode == "namespace":
            keys |= self._orphaned_inits()
        for key in keys:
            reap_zombie(key)

    def _reap_session_orphans(self) -> None:
        """Own-session modes: reap the command's processes that were reparented to this process
        (a subreaper task) and exited before the tracker ever saw them, a double fork's middle
        shell say. They are in the command's session, whose id is the main pid, which cannot be
        recycled while the main process is unreaped (call before ``popen.wait()``); no ``Popen``
        of the task's waits for them."""
        if not self._own_session:
            return
        for pid in children_of(os.getpid()):
            info = read_proc(pid)
            if info is None or pid == self.main.pid or not info.exited:
                continue
            if info.sid == self.main.pid and info.start >= self.main.start:
                reap_zombie(ProcKey(pid, info.start))

    def _orphaned_inits(self) -> set[ProcKey]:
        """bubblewrap's namespace inits reparented to this process, once they have exited.

        The outer bwrap exits as soon as the command does, and its init follows once the kernel
        has emptied the namespace: always an orphan, reparented to a subreaper task process, and
        for a short command never seen by the tracker. Only a process in a *nested* PID
        namespace qualifies, so an outer bwrap (a ``Popen`` of ours, waited for by its command)
        is never reaped here; nobody waits for an init.
        """
        me = os.getpid()
        inits = set()
        for pid in children_of(me):
            info = read_proc(pid)
            if info is not None and info.start >= self.main.start and nested_pid_namespace(pid):
                inits.add(ProcKey(pid, info.start))
        wait_gone(inits, KILL_WAIT)  # emptying a namespace of a fork bomb's processes takes a while
        return inits

    # -- finding the processes -----------------------------------------------------------

    def _tree(self) -> dict[ProcKey, str]:
        """Every running process of the command, with its command line: the tracked ones, a fresh
        walk from the main process, its process group, and anything with the command's tag."""
        self._track()
        keys = {k for k in self.known() if is_running(k)}
        swept = self._sweep() - keys
        with self.lock:
            self.swept |= swept
        return {key: command_line(key.pid) for key in keys | swept}

    def _sweep(self) -> set[ProcKey]:
        """Processes started after the command that are in its group or carry its tag."""
        found: set[ProcKey] = set()
        # The group id is the main pid: only meaningful while that pid cannot be recycled.
        group_alive = self._own_session and self.popen.returncode is None
        for pid in all_pids():
            info = read_proc(pid)
            if info is None or info.exited or info.start < self.main.start or pid == os.getpid():
                continue
            in_group = group_alive and info.pgid == self.main.pid
            if in_group or environ_contains(pid, self.tag):
                found.add(ProcKey(pid, info.start))
        return found

    # -- stopping ------------------------------------------------------------------------

    def terminate(self, reason: str) -> None:
        """Stop the whole tree for ``reason`` and wait (bounded) until its result is recorded;
        if someone else is stopping it already, wait for them. Never raises."""
        if self._claim(reason):
            self._stop_claimed()
        elif self.stop_reason is not None:  # someone else is stopping it: wait for them
            self.done.wait(self.stop_bound())

    def kill_at_limit(self, breach: LimitBreach) -> None:
        """SIGKILL the whole tree now (no grace, as the kernel's OOM killer would) because the
        sandbox passed ``breach``'s limit; a no-op if it is already stopping or finished."""
        if self._claim(f"limit {breach.describe()}", breach):
            self._stop_claimed()

    def _claim(self, reason: str, breach: LimitBreach | None = None) -> bool:
        """Make this caller the one that stops the command; ``False`` if stopping or finished."""
        with self.lock:
            if self.stop_reason is not None or self.done.is_set():
                return False
            self.stop_reason = reason
            self.breach = breach
            return True

    def _stop_claimed(self) -> None:
        try:
            self._signal_tree()
        finally:
            self.terminated.set()
            self.wake.set()
        self.done.wait(self.stop_bound())

    def _signal_tree(self) -> None:
        if self.report_fd is not None:
            self._stop_through_init()
            return
        tree = self._tree()
        # Youngest first, so children are signalled before their parents: in a namespace the
        # command's exit tears everything down, and each process should get its SIGTERM first.
        workers = sorted(
            (k for k in tree if k not in self.infra and not self._is_outer_bwrap(k)),
            key=lambda k: (k.start, k.pid),
            reverse=True,
        )
        sent: dict[ProcKey, int] = {}
        self.final_signal = signal.SIGTERM
        # Freeze, signal, thaw: every process has its SIGTERM pending before any of them can
        # react to another's death (a shell exiting as its child dies, the namespace torn down
        # as the command exits) or fork something new in the middle of the stop.
        frozen = [key for key in workers if send_signal(key, signal.SIGSTOP)]
        try:
            for key in workers:
                if send_signal(key, signal.SIGTERM):
                    sent[key] = signal.SIGTERM
            self._signal_group(signal.SIGTERM)
        finally:
            for key in frozen:
                send_signal(key, signal.SIGCONT)
            self._signal_group(signal.SIGCONT)
        if not workers or not wait_gone(workers, self._grace()):
            self.final_signal = signal.SIGKILL
            sent.update(self._kill_everything(tree))
        # bwrap's init leaves as soon as the command does; whatever is still around goes now.
        wait_gone(tree, KILL_WAIT)
        stragglers = self._tree()
        for key in stragglers:
            if send_signal(key, signal.SIGKILL):
                sent[key] = signal.SIGKILL
        tree.update(stragglers)
        wait_gone(sent, KILL_WAIT)
        self._record(sent, tree, reason=self.stop_reason or "stopped")
        if self.mode == "namespace":
            # Running when the stop began, gone before our signal reached it: the kernel's
            # SIGKILL of the emptied namespace ended it.
            torn_down = {key: int(signal.SIGKILL) for key in workers if key not in sent}
            self._record(torn_down, tree, reason=self.stop_reason or "stopped", source="namespace teardown")
            if not workers and self.main in sent:
                # Stopped before bubblewrap started the command: bubblewrap stands for it.
                self._record(
                    {self.main: sent[self.main]}, tree, reason=self.stop_reason or "stopped", stand_in=True
                )

    def _stop_through_init(self) -> None:
        """Landlock mode: the init stops its tree, which it alone sees whole (a daemon that left
        its session and renamed itself is still its descendant). SIGTERM asks it to stop;
        SIGUSR1 when the grace (perhaps cut by the scope's budget) is over, to SIGKILL now; a
        SIGKILL of the init itself only if it did not end by then (its tree is then reparented
        to the task process, a subreaper, and found by the descendant reaper)."""
        grace = self._grace()
        self.final_signal = signal.SIGTERM
        command = command_line(self.main.pid)
        delivered = send_signal(self.main, signal.SIGTERM if grace > 0 else signal.SIGUSR1)
        if not wait_gone([self.main], grace):
            send_signal(self.main, signal.SIGUSR1)
            if not wait_gone([self.main], KILL_WAIT + STOP_SLACK):
                log.warning(
                    "sandbox %s: command %s: its init still ran %.1f s after the kill; killing it",
                    self.owner.id,
                    self.id,
                    KILL_WAIT + STOP_SLACK,
                )
                send_signal(self.main, signal.SIGKILL)
        reason = self.stop_reason or "stopped"
        if self._record_report(reason) == 0 and delivered:
            # Stopped before the init started the command (a signal at its start ends it): the
            # init stands for the command.
            self._record({self.main: self.final_signal}, {self.main: command}, reason=reason, stand_in=True)

    def _record_report(self, reason: str) -> int | None:
        """Record what the init signalled, once (the command's end and a stop may both ask);
        how many processes that was (``None``: recorded already, or no report)."""
        with self.lock:
            if self.report_fd is None or self.report_read:
                return None
            self.report_read = True
        size = os.fstat(self.report_fd).st_size
        kills = parse_report(os.pread(self.report_fd, size, 0))
        if any(kill.signal == signal.SIGKILL for kill in kills):
            self.final_signal = signal.SIGKILL
        sent = {ProcKey(k.pid, k.start): k.signal for k in kills}
        self._record(sent, {ProcKey(k.pid, k.start): k.command for k in kills}, reason=reason)
        return len(kills)

    def _kill_everything(self, tree: dict[ProcKey, str]) -> dict[ProcKey, int]:
        # Namespace init first: its death makes the kernel SIGKILL the whole namespace at once.
        # Whatever runs now dies of this SIGKILL, even if the kernel or the group signal gets
        # to it before its own kill() does: that is what the record says.
        tree.update(self._tree())
        alive = [key for key in sorted(tree, key=lambda k: k not in self.infra) if is_running(key)]
        for key in alive:
            send_signal(key, signal.SIGKILL)
        self._signal_group(signal.SIGKILL)
        wait_gone(tree, KILL_WAIT)
        return dict.fromkeys(alive, int(signal.SIGKILL))

    def _signal_group(self, sig: int) -> None:
        # The main process is the group leader; while it is unreaped its pid (the pgid) cannot
        # be recycled, so the group signal cannot reach a stranger.
        if not self._own_session or self.popen.returncode is not None:
            return
        leader = read_proc(self.main.pid)
        if leader is None or leader.start != self.main.start:
            return  # reaped behind our back (e.g. by the descendant reaper): the id is not ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.main.pid, sig)

    @property
    def _own_session(self) -> bool:
        """The command's main process leads its own session and group (process-group and
        landlock modes); in namespace mode the group is bubblewrap's, outside the namespace."""
        return self.mode != "namespace"

    def _is_outer_bwrap(self, key: ProcKey) -> bool:
        return self.mode == "namespace" and key == self.main

    def _record(
        self,
        sent: Mapping[ProcKey, int],
        tree: Mapping[ProcKey, str],
        reason: str,
        source: str = "sandbox",
        stand_in: bool = False,
    ) -> None:
        """One record per process in ``sent``; a wrapper (bubblewrap) only as the ``stand_in``
        for a command it had not started yet."""
        scope = self.owner.scope
        for key, sig in sent.items():
            if not stand_in and self.mode == "namespace" and (key in self.infra or key == self.main):
                continue  # bubblewrap's own processes are plumbing, not the command's work
            entry = KillRecord(
                source=source,
                pid=key.pid,
                command_id=self.id,
                signal=int(sig),
                exit_code=-int(sig) if key == self.main else None,
                mode=self.mode,
                reason=reason,
                command=tree.get(key, ""),
                sandbox=self.owner.id,
                at=round(time.time(), 3),
            )
            log.debug("sandbox %s killed %s", self.owner.id, entry)
            if scope is not None:
                scope.record_killed(entry)


def _has_exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the process ended, *without* reaping it.

    An unreaped zombie keeps its pid, which is also its process group id, from being recycled:
    the group can still be signalled safely while the command's leftovers are cleaned up.
    """
    if proc.returncode is not None:
        return True
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped by someone else


def kill_orphaned_commands() -> list[ProcKey]:
    """SIGKILL the processes of commands whose task process is gone: a SIGKILLed task could not
    stop them. Found by ``OWNER_VAR`` in their initial environment, naming an owner in this
    pid namespace that is gone for sure ([`owner_gone`][cancellable_agents.procs._owner.owner_gone]; another
    namespace's is never
    touched). Returns the processes killed. A command that re-executes itself with a scrubbed
    environment is not found: only a cgroup holds such a process (its orphan is killed whole)."""
    needle = f"{OWNER_VAR}=".encode()
    verdicts: dict[bytes, bool] = {}
    killed = []
    for pid in all_pids():
        tag = _owner_of(pid, needle)
        if tag is None or pid == os.getpid():
            continue
        if tag not in verdicts:
            verdicts[tag] = owner_gone(tag.decode("ascii", "replace"))
        info = read_proc(pid)
        if verdicts[tag] and info is not None and not info.exited:
            key = ProcKey(pid, info.start)
            if send_signal(key, signal.SIGKILL):
                killed.append(key)
    if killed:
        log.info(
            "LocalSandbox: killed %d process(es) left running by sandbox commands of tasks that were "
            "SIGKILLed: %s",
            len(killed),
            ", ".join(str(k.pid) for k in killed),
        )
    return killed


def _owner_of(pid: int, needle: bytes) -> bytes | None:
    """The owner tag in ``pid``'s initial environment, if it has one."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(needle):
            return entry[len(needle) :]
    return None
