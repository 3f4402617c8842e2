"""The local backend: commands run as process trees on this host that a cancel really stops.

:class:`LocalSandbox` gives one task a working directory and a command runner. Every command is
a *process tree*: stopping it (``stop``, a per-command timeout, or the task being cancelled)
sends SIGTERM to the whole tree, waits ``stop_grace`` (never past the scope's budget), SIGKILLs
what is left, reaps it and records each kill on the task's :class:`TaskCancellation`. When a
command's main process ends, whatever it left running in the background is killed too: a
command never outlives itself.

Isolation modes (``isolation=``):

``"namespace"`` (Linux with a working bubblewrap)
    Each command runs under bubblewrap in its own PID namespace: nothing it starts (``setsid``,
    double forks, daemons) can leave it, when the namespace's init dies the kernel kills every
    process in it, and ``--die-with-parent`` ends it even when the task process is SIGKILLed.
    With the default ``profile="boundary"`` it is also a boundary (see
    :mod:`~cancellable_agents.toolsets.sandbox.bwrap`): no home folders, no Airflow config, no
    network, not root, limits. ``profile="host"`` shows the whole host read-only instead.
``"process-group"`` (fallback, any POSIX)
    Each command starts a new session. A watcher thread records the pid and start time of every
    descendant every ~20 ms, so processes that later ``setsid`` or are reparented stay known.
    A stop signals the process group, every tracked process (start time checked, so a recycled
    pid is never hit) and every process that still carries the command's environment tag
    (``CANCELLABLE_AGENTS_COMMAND``). Cleanup only, **not a boundary**: the command sees what the
    task's user sees, and a SIGKILL of the task leaves commands running. Warned once per task.
``"auto"`` (default)
    Namespace mode when bubblewrap can give the chosen profile here, else process-group mode.

Secrets are kept out of commands' environment in every mode (``AIRFLOW__*``, ``AIRFLOW_CONN_*``,
``AIRFLOW_VAR_*`` and names containing ``API_KEY``, ``TOKEN``, ``SECRET`` or ``PASSWORD``).
This module imports no Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Literal, TypeVar

from cancellable_agents.core.record import KillRecord
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.core.workers import JobThread
from cancellable_agents.procs.proc import (
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
from cancellable_agents.toolsets.sandbox.attach import SandboxAttachment, attach_sandbox
from cancellable_agents.toolsets.sandbox.bwrap import (
    BoundaryProfile,
    Limits,
    boundary_argv,
    bwrap_support,
    host_argv,
    limits_prefix,
    prlimit_path,
    sandbox_uid,
    unavailable_message,
)
from cancellable_agents.toolsets.sandbox.env import scrubbed_environment
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    SandboxClosed,
    SandboxPathError,
    SandboxUnavailable,
)
from cancellable_agents.toolsets.sandbox.workdirs import new_workdir

__all__ = ["COMMAND_TAG", "DEFAULT_OUTPUT_LIMIT", "Isolation", "LocalSandbox", "Profile"]

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespace", "process-group"]
Mode = Literal["namespace", "process-group"]
Profile = Literal["boundary", "host"]
T = TypeVar("T")

DEFAULT_OUTPUT_LIMIT = 64 * 1024
#: How often a running command's process tree is scanned for new descendants.
TRACK_INTERVAL = 0.02
#: Budget kept back after the SIGTERM grace for SIGKILL, reaping and the record.
KILL_RESERVE = 0.3
#: How long to wait for SIGKILLed processes to disappear.
KILL_WAIT = 1.0
#: How long output readers may take to drain once the tree is gone.
READER_JOIN = 1.0
#: Scheduling slack on top of the parts of a stop (see ``LocalSandbox._stop_bound``).
STOP_SLACK = 2.0
#: Finished commands whose results stay available to ``wait`` (oldest are forgotten first).
KEEP_RESULTS = 256
#: Environment variable carrying ``<sandbox id>:<command id>`` into every command's tree.
COMMAND_TAG = "CANCELLABLE_AGENTS_COMMAND"


def _choose_mode(isolation: str, profile: str) -> Mode:
    if isolation not in ("auto", "namespace", "process-group"):
        raise ValueError(f"isolation must be 'auto', 'namespace' or 'process-group', got {isolation!r}")
    if profile not in ("boundary", "host"):
        raise ValueError(f"profile must be 'boundary' or 'host', got {profile!r}")
    if isolation == "process-group":
        return "process-group"
    support = bwrap_support()
    if support.usable and (profile == "host" or support.boundary):
        return "namespace"
    if isolation == "namespace":
        raise SandboxUnavailable(unavailable_message(support, profile))
    log.info(
        "LocalSandbox: no %s namespace sandbox (%s); using process-group isolation",
        profile,
        support.reason or support.boundary_reason,
    )
    return "process-group"


_warned_lock = threading.Lock()
_warned: weakref.WeakSet[TaskCancellation] = weakref.WeakSet()  # guarded by _warned_lock
_warned_unscoped = False  # guarded by _warned_lock


def _warn_no_boundary(scope: TaskCancellation | None) -> None:
    """Once per task (scope): process-group mode is cleanup, not a boundary."""
    global _warned_unscoped
    with _warned_lock:
        if scope is None:
            if _warned_unscoped:
                return
            _warned_unscoped = True
        else:
            if scope in _warned:
                return
            _warned.add(scope)
    log.warning(
        "LocalSandbox runs commands in process-group mode: this stops them on a kill but is NOT a "
        "security boundary (commands see the task's files and network and run as its user, with "
        "no limits). For a boundary install bubblewrap (`apt-get install bubblewrap`) and pass "
        "isolation='namespace' to fail instead of falling back."
    )


# -- spawning -------------------------------------------------------------------------------


class _Spawner:
    """Starts every command from one thread that lives as long as the process.

    ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the
    child exits, not the process. Sync tools run on one short-lived thread per call, so a
    command started there would be SIGKILLed (and its namespace orphaned) as the tool returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: JobThread | None = None  # guarded by _lock
        self._owner: int | None = None  # guarded by _lock: the pid the thread belongs to

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            # After a fork the thread is gone; the child gets its own.
            if self._thread is None or self._owner != os.getpid():
                self._thread = JobThread("cancellable-agents-spawner")
                self._owner = os.getpid()
            thread = self._thread
        return thread.submit(fn).result()


_spawner = _Spawner()


# -- one command ----------------------------------------------------------------------------


class _BoundedReader:
    """Drains one pipe on its own thread, keeping at most ``limit`` bytes.

    Reading on a thread means a chatty command never blocks on a full pipe; the cap means it
    never costs more than ``limit`` bytes of memory however much it writes.
    """

    def __init__(self, pipe: IO[bytes], limit: int, name: str) -> None:
        self._pipe = pipe
        self._limit = limit
        self._data = bytearray()
        self._dropped = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, 65536):
                with self._lock:
                    room = max(0, self._limit - len(self._data))
                    self._data += chunk[:room]
                    self._dropped += len(chunk) - min(room, len(chunk))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._pipe.close()

    def text(self) -> tuple[str, bool]:
        """The captured text (with a truncation marker) and whether anything was dropped."""
        with self._lock:
            text = bytes(self._data).decode("utf-8", "replace")
            dropped = self._dropped
        if dropped:
            text += f"\n[... truncated {dropped} bytes ...]"
        return text, dropped > 0


@dataclass(eq=False)
class _Command:
    id: str
    popen: subprocess.Popen[bytes]
    main: ProcKey
    mode: Mode
    tag: bytes
    started: float
    timeout: float | None
    stdout: _BoundedReader
    stderr: _BoundedReader
    tracked: dict[int, ProcKey] = field(default_factory=dict)
    infra: set[ProcKey] = field(default_factory=set)
    #: Found by a stop's sweep (group or tag) but never by the tracker: e.g. the ``(cmd &)``
    #: orphan, reparented before the tracker's first look. Ours to reap all the same.
    swept: set[ProcKey] = field(default_factory=set)
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


# -- the sandbox ----------------------------------------------------------------------------


class LocalSandbox:
    """A per-task working directory and a runner whose commands a cancel really stops.

    ``workdir`` defaults to a fresh temporary directory; it is created if missing and removed
    by :meth:`destroy` only if this sandbox created it. ``env`` is passed to commands on top of
    the scrubbed environment (so a secret the DAG author hands over explicitly does reach them).
    With a ``scope`` (or the :func:`current_cancellation` found at creation or first use), a
    cancel stops all commands (``Phase.IN_FLIGHT``) before destroying the sandbox
    (``Phase.TEARDOWN``), inside the scope's budget (through :func:`attach_sandbox`).

    Namespace mode, ``profile="boundary"`` (default): commands see the system folders, the
    interpreter, ``read_only_paths``, ``writable_paths`` and the workdir (read-write, also their
    ``HOME``) and nothing else; no network unless ``network=True``; ``limits`` (a
    :class:`Limits`, defaults when ``None``). On a root worker the workdir is handed to the
    sandbox's own uid, and ``writable_paths`` must be writable by it. ``profile="host"``: the
    old view (whole host read-only, host network, no limits), for commands that need it.
    """

    #: Kills are recorded here, per process (the attachment need not record per command).
    records_kills = True

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        isolation: Isolation = "auto",
        profile: Profile = "boundary",
        network: bool = False,
        read_only_paths: Iterable[str | os.PathLike[str]] = (),
        writable_paths: Iterable[str | os.PathLike[str]] = (),
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
        stop_grace: float = 1.0,
        scope: TaskCancellation | None = None,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        python: str | None = None,
    ) -> None:
        if stop_grace < 0:
            raise ValueError(f"stop_grace must be >= 0 seconds, got {stop_grace!r}")
        if output_limit <= 0:
            raise ValueError(f"output_limit must be a positive number of bytes, got {output_limit!r}")
        self.mode: Mode = _choose_mode(isolation, profile)
        self.profile: Profile = profile
        self.network = network
        self.limits = limits if limits is not None else Limits()
        self.id = uuid.uuid4().hex[:8]
        self.workdir, self._owns_workdir = _prepare_workdir(workdir)
        if self._owns_workdir:
            # A sandbox nobody destroyed still does not leave its directory behind at exit.
            weakref.finalize(self, shutil.rmtree, self.workdir, True)
        self.stop_grace = stop_grace
        self.output_limit = output_limit
        self.python = python or sys.executable or "python3"
        self._explicit_env = dict(env or {})
        self._commands: dict[str, _Command] = {}
        self._lock = threading.Lock()
        self._destroyed = False
        self._scope: TaskCancellation | None = None
        self._attachment: SandboxAttachment | None = None
        self._boundary = self._boundary_profile(read_only_paths, writable_paths)
        log.info(
            "LocalSandbox %s: isolation=%s, workdir=%s%s",
            self.id,
            self.mode,
            self.workdir,
            f" (bubblewrap, profile={profile}, network={network})" if self.mode == "namespace" else "",
        )
        self._attach(scope or current_cancellation())

    def _boundary_profile(
        self, read_only: Iterable[str | os.PathLike[str]], writable: Iterable[str | os.PathLike[str]]
    ) -> BoundaryProfile | None:
        if self.mode != "namespace" or self.profile != "boundary":
            return None
        uid = None if bwrap_support().user_namespace else sandbox_uid()
        if uid is not None:
            # A root worker's commands run as the sandbox's own uid: the workdir must be theirs.
            os.chown(self.workdir, uid, uid)
        return BoundaryProfile(
            workdir=str(self.workdir),
            python=self.python,
            network=self.network,
            read_only_paths=tuple(_absolute(p) for p in read_only),
            writable_paths=tuple(_absolute(p) for p in writable),
            limits=self.limits,
            uid=uid,
        )

    def _boundary_env(self, env: dict[str, str]) -> None:
        """The real HOME is not visible (the workdir stands in), and ``python`` on PATH is the
        sandbox's interpreter (a PATH entry such as a pyenv shim folder is not visible either)."""
        if "HOME" not in self._explicit_env:
            env["HOME"] = str(self.workdir)
        if "PATH" not in self._explicit_env:
            bindir = os.path.dirname(os.path.abspath(self.python))
            env["PATH"] = os.pathsep.join([bindir, env.get("PATH") or os.defpath])

    # -- scope ---------------------------------------------------------------------------

    @property
    def scope(self) -> TaskCancellation | None:
        return self._scope

    def _attach(self, scope: TaskCancellation | None) -> None:
        if self.mode == "process-group":
            _warn_no_boundary(scope)
        with self._lock:
            if scope is None or self._scope is not None or self._destroyed:
                return
            self._scope = scope
        self._attachment = attach_sandbox(
            self, scope, name=self.id, mode=self.mode, profile=self.profile, workdir=str(self.workdir)
        )

    def _grace(self) -> float:
        """SIGTERM grace: ``stop_grace``, but never past the cancelled scope's budget."""
        scope = self._scope
        if scope is None or not scope.cancelled:
            return self.stop_grace
        return max(0.0, min(self.stop_grace, scope.remaining() - KILL_RESERVE))

    # -- starting ------------------------------------------------------------------------

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> str:
        """Start ``command`` (an argv list, or a string run by ``/bin/sh -c``); return its id.

        Raises :class:`SandboxClosed` after :meth:`destroy`, and ``TaskCancelled`` if the
        attached scope was already cancelled (no command starts after a kill).
        """
        if self._scope is None:
            self._attach(current_cancellation())
        if self._scope is not None:
            self._scope.raise_if_cancelled()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        command_id = uuid.uuid4().hex[:12]
        tag = f"{self.id}:{command_id}"
        env = scrubbed_environment(os.environ, self._explicit_env)
        if self._boundary is not None:
            self._boundary_env(env)
        env[COMMAND_TAG] = tag
        with self._lock:
            if self._destroyed:
                raise SandboxClosed(f"sandbox {self.id} was destroyed; it starts no more commands")
            cmd = self._spawn(command_id, self._wrap(argv), env, tag, timeout, stdin)
            self._commands[command_id] = cmd
            self._forget_old_results()
        if self._scope is not None and self._scope.cancelled:
            # The scope's stop_all may have looked before this command existed.
            self.stop(command_id)
        return command_id

    def _forget_old_results(self) -> None:
        """Keep the results of the last ``KEEP_RESULTS`` finished commands (memory stays bounded)."""
        finished = [cid for cid, c in self._commands.items() if c.done.is_set()]
        for command_id in finished[: max(0, len(finished) - KEEP_RESULTS)]:
            del self._commands[command_id]

    def _wrap(self, argv: list[str]) -> list[str]:
        if self.mode != "namespace":
            # Per-uid here, RLIMIT_NPROC would count every process of the worker's user.
            # (No bubblewrap probe here: its orphans would come back to a subreaper task process.)
            return limits_prefix(prlimit_path(), replace(self.limits, max_processes=None)) + argv
        support = bwrap_support()
        if self._boundary is None:
            return host_argv(support, str(self.workdir), self.python) + argv
        return boundary_argv(support, self._boundary) + argv

    def _spawn(
        self,
        command_id: str,
        argv: list[str],
        env: dict[str, str],
        tag: str,
        timeout: float | None,
        stdin: str | bytes | None,
    ) -> _Command:
        def popen() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Its own session: Airflow's SIGTERM to the task's process group does not cut the
                # tree up behind the sandbox's back; the sandbox's stop is the one way it ends.
                start_new_session=True,
                close_fds=True,
            )

        started = time.monotonic()
        proc = _spawner.call(popen)
        info = read_proc(proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        cmd = _Command(
            id=command_id,
            popen=proc,
            main=ProcKey(proc.pid, info.start if info else 0.0),
            mode=self.mode,
            tag=f"{COMMAND_TAG}={tag}\0".encode(),
            started=started,
            timeout=timeout,
            stdout=_BoundedReader(proc.stdout, self.output_limit, f"sandbox-{command_id}-stdout"),
            stderr=_BoundedReader(proc.stderr, self.output_limit, f"sandbox-{command_id}-stderr"),
        )
        if stdin is not None:
            _feed_stdin(proc, stdin.encode() if isinstance(stdin, str) else stdin)
        threading.Thread(
            target=self._monitor, args=(cmd,), name=f"sandbox-{command_id}-monitor", daemon=True
        ).start()
        return cmd

    # -- watching a command --------------------------------------------------------------

    def _monitor(self, cmd: _Command) -> None:
        """Track the tree until the main process exits, enforce the timeout, then finish."""
        deadline = None if cmd.timeout is None else cmd.started + cmd.timeout
        while not _has_exited(cmd.popen):
            self._track(cmd)
            if deadline is not None and time.monotonic() >= deadline:
                deadline = None
                # Claimed here, before the main process can exit, so the result says timed_out.
                if self._claim(cmd, "timeout"):
                    threading.Thread(
                        target=self._stop_claimed, args=(cmd,), name=f"sandbox-{cmd.id}-timeout", daemon=True
                    ).start()
            if cmd.wake.wait(TRACK_INTERVAL):
                cmd.wake.clear()
        self._finish(cmd)

    def _track(self, cmd: _Command) -> None:
        main = read_proc(cmd.main.pid)
        if main is None or main.start != cmd.main.start:
            return  # reaped: its pid may already belong to a stranger
        try:
            tree = walk_descendants(cmd.popen.pid, skip=lambda info: info.start < cmd.main.start)
            outer_children = set(children_of(cmd.popen.pid)) if cmd.mode == "namespace" else set()
        except Exception as exc:  # /proc races must not kill the watcher
            log.debug("sandbox %s: scan failed: %r", self.id, exc)
            return
        with cmd.lock:
            for pid, info in tree.items():
                key = ProcKey(pid, info.start)
                if pid in outer_children:
                    cmd.infra.add(key)
                else:
                    cmd.tracked[pid] = key

    def _finish(self, cmd: _Command) -> None:
        if cmd.stop_reason is not None:
            cmd.terminated.wait(self._stop_bound())
        else:
            self._kill_leftovers(cmd)
        cmd.popen.wait()  # only now: until here its pid, the group id, could not be recycled
        self._reap_tracked(cmd)
        for reader in (cmd.stdout, cmd.stderr):
            reader.thread.join(READER_JOIN)
        result = self._result(cmd)
        with cmd.lock:
            cmd.result = result
            callbacks = list(cmd.callbacks)
            cmd.done.set()
        for callback in callbacks:
            try:
                callback(result)
            except Exception as exc:
                log.debug("sandbox %s: result callback failed: %r", self.id, exc)

    def _result(self, cmd: _Command) -> CommandResult:
        stdout, out_cut = cmd.stdout.text()
        stderr, err_cut = cmd.stderr.text()
        stopped = cmd.stop_reason is not None
        returncode = cmd.popen.returncode if cmd.popen.returncode is not None else -signal.SIGKILL
        return CommandResult(
            command_id=cmd.id,
            exit_code=-(cmd.final_signal or signal.SIGTERM) if stopped else returncode,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            timed_out=cmd.stop_reason == "timeout",
            stopped=stopped,
            duration=round(time.monotonic() - cmd.started, 4),
        )

    def _kill_leftovers(self, cmd: _Command) -> None:
        """The main process ended on its own (not yet reaped): nothing it started may outlive it."""
        if cmd.mode == "namespace":
            # The kernel empties the namespace once bwrap's init is gone; just wait for it.
            wait_gone(cmd.known(), KILL_WAIT)
        leftovers = {k: c for k, c in self._tree(cmd).items() if k != cmd.main}
        if not leftovers:
            return
        sent = {key: int(signal.SIGKILL) for key in leftovers if send_signal(key, signal.SIGKILL)}
        wait_gone(sent, KILL_WAIT)
        self._record(cmd, sent, leftovers, reason="leftover")

    def _reap_tracked(self, cmd: _Command) -> None:
        """Reap the command's processes that were reparented to us (we may be a subreaper).

        The sandbox started and stopped them, so it collects them: left as zombies, they would
        wait out the descendant reaper's owner grace, or stay until the task process exits.
        """
        keys = cmd.known() - {cmd.main}
        if cmd.mode == "namespace":
            keys |= self._orphaned_inits(cmd)
        for key in keys:
            reap_zombie(key)

    @staticmethod
    def _orphaned_inits(cmd: _Command) -> set[ProcKey]:
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
            if info is not None and info.start >= cmd.main.start and nested_pid_namespace(pid):
                inits.add(ProcKey(pid, info.start))
        wait_gone(inits, KILL_WAIT)  # emptying a namespace of a fork bomb's processes takes a while
        return inits

    # -- finding a command's processes ---------------------------------------------------

    def _tree(self, cmd: _Command) -> dict[ProcKey, str]:
        """Every running process of ``cmd``, with its command line: the tracked ones, a fresh
        walk from the main process, its process group, and anything with the command's tag."""
        self._track(cmd)
        keys = {k for k in cmd.known() if is_running(k)}
        swept = self._sweep(cmd) - keys
        with cmd.lock:
            cmd.swept |= swept
        return {key: command_line(key.pid) for key in keys | swept}

    def _sweep(self, cmd: _Command) -> set[ProcKey]:
        """Processes started after the command that are in its group or carry its tag."""
        found: set[ProcKey] = set()
        # The group id is the main pid: only meaningful while that pid cannot be recycled.
        group_alive = cmd.mode == "process-group" and cmd.popen.returncode is None
        for pid in all_pids():
            info = read_proc(pid)
            if info is None or info.exited or info.start < cmd.main.start or pid == os.getpid():
                continue
            in_group = group_alive and info.pgid == cmd.main.pid
            if in_group or environ_contains(pid, cmd.tag):
                found.add(ProcKey(pid, info.start))
        return found

    def descendants(self, command_id: str) -> list[int]:
        """Pids of the command's running descendants the tracker has seen (not bwrap itself)."""
        cmd = self._commands.get(command_id)
        if cmd is None:
            return []
        with cmd.lock:
            keys = list(cmd.tracked.values())
        return sorted(k.pid for k in keys if is_running(k))

    # -- stopping ------------------------------------------------------------------------

    def stop(self, command_id: str) -> None:
        """Stop the command's whole tree: SIGTERM, ``stop_grace``, SIGKILL, reap, record.

        Idempotent and never raises for a running, finished or unknown id. Returns once the
        tree is gone and the result recorded (bounded by the grace plus about a second).
        """
        cmd = self._commands.get(command_id)
        if cmd is None:
            log.debug("sandbox %s: stop(%r): no such command", self.id, command_id)
            return
        self._terminate(cmd, "stopped")

    def stop_all(self) -> None:
        """Stop every running command, concurrently, so N commands cost one grace period."""
        with self._lock:
            running = [c for c in self._commands.values() if not c.done.is_set()]
        workers = [
            threading.Thread(
                target=self._terminate, args=(cmd, "stopped"), name=f"stop-{cmd.id}", daemon=True
            )
            for cmd in running
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(self._stop_bound())

    def destroy(self) -> None:
        """Stop all commands and remove the workdir if this sandbox created it. Idempotent."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
        self.stop_all()
        if self._attachment is not None:
            self._attachment.detach()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        log.debug("sandbox %s destroyed", self.id)

    def _stop_bound(self) -> float:
        """The longest stopping one command can take: the SIGTERM grace, the SIGKILL wait, the
        output drain, and slack for a busy machine. Every wait for a stop is bounded by it."""
        return self.stop_grace + KILL_WAIT + READER_JOIN + STOP_SLACK

    def _terminate(self, cmd: _Command, reason: str) -> None:
        if self._claim(cmd, reason):
            self._stop_claimed(cmd)
        elif cmd.stop_reason is not None:  # someone else is stopping it: wait for them
            cmd.done.wait(self._stop_bound())

    @staticmethod
    def _claim(cmd: _Command, reason: str) -> bool:
        """Make this caller the one that stops ``cmd``; ``False`` if stopping or finished."""
        with cmd.lock:
            if cmd.stop_reason is not None or cmd.done.is_set():
                return False
            cmd.stop_reason = reason
            return True

    def _stop_claimed(self, cmd: _Command) -> None:
        try:
            self._signal_tree(cmd)
        finally:
            cmd.terminated.set()
            cmd.wake.set()
        cmd.done.wait(self._stop_bound())

    def _signal_tree(self, cmd: _Command) -> None:
        tree = self._tree(cmd)
        # Youngest first, so children are signalled before their parents: in a namespace the
        # command's exit tears everything down, and each process should get its SIGTERM first.
        workers = sorted(
            (k for k in tree if k not in cmd.infra and not self._is_outer_bwrap(cmd, k)),
            key=lambda k: (k.start, k.pid),
            reverse=True,
        )
        sent: dict[ProcKey, int] = {}
        cmd.final_signal = signal.SIGTERM
        # Freeze, signal, thaw: every process has its SIGTERM pending before any of them can
        # react to another's death (a shell exiting as its child dies, the namespace torn down
        # as the command exits) or fork something new in the middle of the stop.
        frozen = [key for key in workers if send_signal(key, signal.SIGSTOP)]
        try:
            for key in workers:
                if send_signal(key, signal.SIGTERM):
                    sent[key] = signal.SIGTERM
            self._signal_group(cmd, signal.SIGTERM)
        finally:
            for key in frozen:
                send_signal(key, signal.SIGCONT)
            self._signal_group(cmd, signal.SIGCONT)
        if not workers or not wait_gone(workers, self._grace()):
            cmd.final_signal = signal.SIGKILL
            sent.update(self._kill_everything(cmd, tree))
        # bwrap's init leaves as soon as the command does; whatever is still around goes now.
        wait_gone(tree, KILL_WAIT)
        stragglers = self._tree(cmd)
        for key in stragglers:
            if send_signal(key, signal.SIGKILL):
                sent[key] = signal.SIGKILL
        tree.update(stragglers)
        wait_gone(sent, KILL_WAIT)
        self._record(cmd, sent, tree, reason=cmd.stop_reason or "stopped")
        if cmd.mode == "namespace":
            # Running when the stop began, gone before our signal reached it: the kernel's
            # SIGKILL of the emptied namespace ended it.
            torn_down = {key: int(signal.SIGKILL) for key in workers if key not in sent}
            self._record(
                cmd, torn_down, tree, reason=cmd.stop_reason or "stopped", source="namespace teardown"
            )

    def _kill_everything(self, cmd: _Command, tree: dict[ProcKey, str]) -> dict[ProcKey, int]:
        # Namespace init first: its death makes the kernel SIGKILL the whole namespace at once.
        # Whatever runs now dies of this SIGKILL, even if the kernel or the group signal gets
        # to it before its own kill() does: that is what the record says.
        tree.update(self._tree(cmd))
        alive = [key for key in sorted(tree, key=lambda k: k not in cmd.infra) if is_running(key)]
        for key in alive:
            send_signal(key, signal.SIGKILL)
        self._signal_group(cmd, signal.SIGKILL)
        wait_gone(tree, KILL_WAIT)
        return dict.fromkeys(alive, int(signal.SIGKILL))

    def _signal_group(self, cmd: _Command, sig: int) -> None:
        # The main process is the group leader; while it is unreaped its pid (the pgid) cannot
        # be recycled, so the group signal cannot reach a stranger.
        if cmd.mode != "process-group" or cmd.popen.returncode is not None:
            return
        leader = read_proc(cmd.main.pid)
        if leader is None or leader.start != cmd.main.start:
            return  # reaped behind our back (e.g. by the descendant reaper): the id is not ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(cmd.main.pid, sig)

    @staticmethod
    def _is_outer_bwrap(cmd: _Command, key: ProcKey) -> bool:
        return cmd.mode == "namespace" and key == cmd.main

    def _record(
        self,
        cmd: _Command,
        sent: Mapping[ProcKey, int],
        tree: Mapping[ProcKey, str],
        reason: str,
        source: str = "sandbox",
    ) -> None:
        scope = self._scope
        for key, sig in sent.items():
            if cmd.mode == "namespace" and (key in cmd.infra or key == cmd.main):
                continue  # bubblewrap's own processes are plumbing, not the command's work
            entry = KillRecord(
                source=source,
                pid=key.pid,
                command_id=cmd.id,
                signal=int(sig),
                exit_code=-int(sig) if key == cmd.main else None,
                mode=cmd.mode,
                reason=reason,
                command=tree.get(key, ""),
                sandbox=self.id,
                at=round(time.time(), 3),
            )
            log.debug("sandbox %s killed %s", self.id, entry)
            if scope is not None:
                scope.record_killed(entry)

    # -- results -------------------------------------------------------------------------

    def _get(self, command_id: str) -> _Command:
        cmd = self._commands.get(command_id)
        if cmd is None:
            raise KeyError(f"sandbox {self.id} has no command {command_id!r}")
        return cmd

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult:
        """Block until the command ended; raise ``TimeoutError`` (command keeps running) after
        ``timeout`` seconds, ``KeyError`` for an unknown id."""
        cmd = self._get(command_id)
        if not cmd.done.wait(timeout):
            raise TimeoutError(f"command {command_id} still running after {timeout}s")
        assert cmd.result is not None
        return cmd.result

    def run(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> CommandResult:
        """Start ``command`` and wait for it. Interrupted (e.g. ``KeyboardInterrupt``), it stops
        the command before re-raising."""
        command_id = self.start(command, timeout=timeout, stdin=stdin)
        try:
            return self.wait(command_id)
        except BaseException:
            self.stop(command_id)
            raise

    async def arun(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> CommandResult:
        """Like :meth:`run` without blocking the event loop. On ``CancelledError`` the command
        is stopped (its whole tree, on a thread) before the error propagates."""
        command_id = self.start(command, timeout=timeout, stdin=stdin)
        try:
            return await self._result_future(self._get(command_id))
        except asyncio.CancelledError:
            await _finish_despite_cancel(asyncio.to_thread(self.stop, command_id))
            raise

    @staticmethod
    def _result_future(cmd: _Command) -> asyncio.Future[CommandResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[CommandResult] = loop.create_future()

        def deliver(result: CommandResult) -> None:
            if not future.done():
                future.set_result(result)

        def from_thread(result: CommandResult) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(deliver, result)

        cmd.add_done_callback(from_thread)
        return future

    # -- files ---------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """``path`` (relative to the workdir, or absolute inside it) with symlinks resolved.

        Raises :class:`SandboxPathError` if it points outside the workdir.
        """
        resolved = (self.workdir / path).resolve()
        if resolved != self.workdir and self.workdir not in resolved.parents:
            raise SandboxPathError(
                f"path {path!r} is outside the sandbox working directory; use a path relative to it"
            )
        return resolved

    def read_file(self, path: str) -> str:
        """The file's text (undecodable bytes replaced), capped at ``output_limit`` bytes."""
        with self.resolve(path).open("rb") as handle:
            data = handle.read(self.output_limit + 1)
        text = data[: self.output_limit].decode("utf-8", "replace")
        if len(data) > self.output_limit:
            text += f"\n[... truncated after {self.output_limit} bytes ...]"
        return text

    def write_file(self, path: str, content: str) -> int:
        """Write ``content`` (UTF-8), creating parent directories; return the bytes written."""
        target = self.resolve(path)
        created = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode("utf-8")
        target.write_bytes(data)
        self._hand_over([*created, target])
        return len(data)

    def _hand_over(self, paths: Iterable[Path]) -> None:
        """Files the task writes for a command that runs as the sandbox's own uid are its own,
        or the command could read but never change them."""
        uid = self._boundary.uid if self._boundary is not None else None
        if uid is None:
            return
        for path in paths:
            with contextlib.suppress(OSError):
                os.chown(path, uid, uid)

    def list_files(self, path: str = ".") -> list[str]:
        """Names in a directory, sorted; directories end with ``/``."""
        directory = self.resolve(path)
        return sorted(entry.name + ("/" if entry.is_dir() else "") for entry in directory.iterdir())


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


def _absolute(path: str | os.PathLike[str]) -> str:
    resolved = Path(path).resolve()
    if not resolved.exists():
        raise ValueError(f"sandbox path {str(path)!r} does not exist")
    return str(resolved)


def _prepare_workdir(workdir: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The resolved workdir and whether we created it (and so may delete it)."""
    if workdir is None:
        return new_workdir(), True
    path = Path(workdir).resolve()
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, not existed


def _feed_stdin(proc: subprocess.Popen[bytes], data: bytes) -> None:
    def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(data)
        with contextlib.suppress(OSError):
            proc.stdin.close()

    threading.Thread(target=feed, name=f"sandbox-stdin-{proc.pid}", daemon=True).start()


#: Longest a stop or teardown is awaited after a cancel outside any task scope.
_FINISH_BOUND = 5.0


async def _finish_despite_cancel(awaitable: Awaitable[T]) -> None:
    """Wait for ``awaitable`` (a stop, a teardown) even if this task is cancelled meanwhile, and
    again and again, as an anyio cancel scope does: for at most the scope's remaining budget
    after the first such cancel. Returning early would leave the stop running unwatched (its
    kill record late, "Task was destroyed but it is pending!" in the task log). A cancel that
    came in is absorbed, as before: the caller is already unwinding."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    deadline: float | None = None
    while not task.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            log.warning("a sandbox stop or teardown did not finish within the budget; left running")
            return
        try:
            await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            if deadline is None:
                scope = current_cancellation()
                deadline = loop.time() + (scope.remaining() if scope is not None else _FINISH_BOUND)
    if not task.cancelled():
        task.result()
