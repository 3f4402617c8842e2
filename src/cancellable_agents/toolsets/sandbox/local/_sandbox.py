"""The local backend: commands run as process trees on this host that a cancel really stops.

[`LocalSandbox`][] gives one task a working directory and a command runner. Every command is a
*process tree*: stopping it (``stop``, a per-command timeout, or the task being cancelled) sends
SIGTERM to the whole tree, waits ``stop_grace`` (never past the scope's budget), SIGKILLs what is
left, reaps it and records each kill on the task's
[`TaskCancellation`][cancellable_agents.core.scope.TaskCancellation]. When a command's main
process ends, whatever it left running in the background is killed too: a command never
outlives itself.

Isolation modes (``isolation=``: ``"namespace"``, ``"landlock"``, ``"process-group"``,
``"auto"``) are described in [`isolation`][cancellable_agents.toolsets.sandbox.local._isolation].
Commands get the environment by allowlist in every mode (``PATH``, the locale, ``TERM``, ``TZ``,
``HOME`` = the workdir, and what ``env=`` passes; see
[`env`][cancellable_agents.toolsets.sandbox.local._env]). The file tools open paths below the
workdir without following symlinks, so a command swapping folders under them cannot redirect
them ([`files`][cancellable_agents.toolsets.sandbox.local._files]).

The sandbox reaches its scope one way, as any backend: the attachment
[`attach_sandbox`][cancellable_agents.toolsets.sandbox._attach.attach_sandbox] gave it; its
commands and its egress proxy read the scope there. This module is the sandbox's life:
``__init__``, starting, stopping, destroying, whose parts share its state (workdir, mode,
profile, commands, attachment). Beside it, mixed into the class, each idea on its own: the
boundary's set-up at creation ([`provision`][cancellable_agents.toolsets.sandbox.local._provision]),
the results (``wait``, ``run``, ``arun``: [`results`][cancellable_agents.toolsets.sandbox.local._results]),
the file tools and the egress proxy's start (``boundary._egress_proxy``); so do the Landlock
rules (``boundary._landlock``) and spawning (``_spawn``). This module imports no Airflow.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from cancellable_agents.core._once import Once
from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.procs._owner import owner_tag
from cancellable_agents.procs._proc import ProcKey, read_proc
from cancellable_agents.toolsets.sandbox._attach import SandboxAttachment, attach_sandbox, attachment_of
from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.limits import Limits
from cancellable_agents.toolsets.sandbox.local._command import (
    OWNER_VAR,
    CommandTree,
    kill_orphaned_commands,
    stop_bound,
)
from cancellable_agents.toolsets.sandbox.local._env import scrubbed_environment
from cancellable_agents.toolsets.sandbox.local._files import WorkdirFileTools
from cancellable_agents.toolsets.sandbox.local._isolation import (
    Isolation,
    Mode,
    Profile,
    choose_mode,
    enforceable_egress,
    warn_no_boundary,
)
from cancellable_agents.toolsets.sandbox.local._provision import BoundaryProvision
from cancellable_agents.toolsets.sandbox.local._provision import absolute_path as _absolute
from cancellable_agents.toolsets.sandbox.local._results import CommandResults
from cancellable_agents.toolsets.sandbox.local._spawn import BoundedReader, feed_stdin, start_process
from cancellable_agents.toolsets.sandbox.local._totals import LimitBreach, TotalsWatcher
from cancellable_agents.toolsets.sandbox.local._workdirs import prepare_workdir, remove_workdir
from cancellable_agents.toolsets.sandbox.local.boundary import _landlock as landlock
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import (
    boundary_argv,
    bwrap_support,
    host_argv,
    interpreter_paths,
)
from cancellable_agents.toolsets.sandbox.local.boundary._cgroups import SandboxCgroup
from cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy import (
    EgressProxy,
    SandboxEgress,
    forwarder_argv,
    proxy_env,
)
from cancellable_agents.toolsets.sandbox.local.boundary._quotas import (
    limits_prefix,
    prlimit_path,
)
from cancellable_agents.toolsets.sandbox.local.boundary._seccomp import (
    SocketRule,
    command_filter,
    warn_if_missing,
)
from cancellable_agents.toolsets.sandbox.protocol import (
    SandboxCapabilities,
    SandboxClosed,
    command_env,
)

__all__ = ["COMMAND_TAG", "DEFAULT_OUTPUT_LIMIT", "LocalSandbox"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_OUTPUT_LIMIT = 64 * 1024
#: Finished commands whose results stay available to ``wait`` (oldest are forgotten first).
KEEP_RESULTS = 256
#: Environment variable carrying ``<sandbox id>:<command id>`` into every command's tree.
COMMAND_TAG = "CANCELLABLE_AGENTS_COMMAND"
#: The first landlock sandbox of a task process kills what SIGKILLed tasks' commands left.
_orphans_swept = Once()
#: The ``env=`` of the command this thread is starting:
#: [`LocalSandbox.launch`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox.launch] sets it
#: around the spawn, and
#: ``LocalSandbox._explicit_env``
#: adds it to the sandbox's own.
_starting_env: ContextVar[Mapping[str, str] | None] = ContextVar("_starting_env", default=None)


# -- the sandbox ----------------------------------------------------------------------------


class LocalSandbox(BoundaryProvision, CommandResults, WorkdirFileTools, SandboxEgress):
    r"""A per-task working directory and a runner whose commands a cancel really stops.

    ``workdir`` defaults to a fresh temporary directory; it is created if missing and removed
    by ``destroy`` only if this sandbox created it. ``env`` is passed to commands on top of
    the allowlisted environment (so what the DAG author hands over explicitly does reach them).
    With a ``scope`` (or the [`current_cancellation`][cancellable_agents.core.scope.current_cancellation]
    found at creation or first use) the
    sandbox attaches itself to it
    ([`attach_sandbox`][cancellable_agents.toolsets.sandbox._attach.attach_sandbox], as any backend): a
    cancel stops all
    commands (``Phase.IN_FLIGHT``) before destroying the sandbox (``Phase.TEARDOWN``), inside the
    scope's budget, and ``start`` goes through that attachment (race-free against the cancel).

    Namespace mode, ``profile="boundary"`` (default): commands see the system folders, the
    interpreter, ``read_only_paths``, ``writable_paths`` and the workdir (read-write, also their
    ``HOME``) and nothing else; no network, except through the egress proxy to the hosts of an
    allowlist (``network=["pypi.org", ...]`` or an
    [`EgressPolicy`][cancellable_agents.toolsets.sandbox.egress_policy.EgressPolicy], see
    [`egress_proxy`][cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy]), or the host's
    network with ``network=True`` (no boundary for the network); ``limits`` (a
    [`Limits`][cancellable_agents.toolsets.sandbox.limits.Limits],
    defaults when ``None``). On a root worker the workdir is handed to the
    sandbox's own uid, and ``writable_paths`` must be writable by it. ``profile="host"``: the
    old view (whole host read-only, host network, no limits), for commands that need it.

    Landlock mode (``isolation="landlock"``): the same view of the files without namespaces,
    enforced by the kernel's Landlock on each command (plus a private tmp, ``TMPDIR``), no
    network (``network=True``: the host's; no egress allowlist yet), limits as in namespace mode
    where the worker has a cgroup, else per process (no process count); see
    [`landlock`][cancellable_agents.toolsets.sandbox.local.boundary._landlock]. Each command runs under
    its own init, a subreaper outside the Landlock domain, so nothing it starts outlives it
    ([`command_init`][cancellable_agents.toolsets.sandbox.local.boundary._command_init]). Commands create no
    unix socket but connected ``socketpair``\ s: with ``unix_sockets=True`` they may, and then
    ``connect()`` reaches **every named unix socket the worker's user can open** (Docker's,
    D-Bus's, other tools' control sockets), since nothing hides them in this mode; opt in only for
    commands you trust with that. (Namespace mode shows no socket of the host's: the option
    changes nothing there.)
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        isolation: Isolation = "auto",
        profile: Profile = "boundary",
        network: bool | EgressPolicy | Iterable[str] = False,
        read_only_paths: Iterable[str | os.PathLike[str]] = (),
        writable_paths: Iterable[str | os.PathLike[str]] = (),
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
        stop_grace: float = 1.0,
        scope: TaskCancellation | None = None,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        python: str | None = None,
        unix_sockets: bool = False,
    ) -> None:
        if stop_grace < 0:
            raise ConfigurationError(f"stop_grace must be >= 0 seconds, got {stop_grace!r}")
        if output_limit <= 0:
            raise ConfigurationError(f"output_limit must be a positive number of bytes, got {output_limit!r}")
        self.mode: Mode = choose_mode(isolation, profile)
        self.profile: Profile = profile
        policy = EgressPolicy.coerce(network)
        self.network = policy is True
        self.unix_sockets = unix_sockets
        self.egress = enforceable_egress(policy, self.mode, profile)
        self._proxy: EgressProxy | None = None
        self.limits = limits if limits is not None else Limits()
        self.id = uuid.uuid4().hex[:8]
        self.workdir, self._owns_workdir = prepare_workdir(workdir)
        if self._owns_workdir:
            # A sandbox nobody destroyed still does not leave its directory behind at exit.
            weakref.finalize(self, remove_workdir, self.workdir)
        self.stop_grace = stop_grace
        self.output_limit = output_limit
        self.python = python or sys.executable or "python3"
        self._env = command_env(env)
        read_only_paths, writable_paths = tuple(read_only_paths), tuple(writable_paths)
        self._commands: dict[str, CommandTree] = {}
        self._lock = threading.Lock()
        self._destroyed = False
        # Its own attachment, the one home of its scope (set once, under _lock).
        self._attachment: SandboxAttachment | None = None
        self.cgroup: SandboxCgroup | None = None
        self._boundary = self._boundary_profile(read_only_paths, writable_paths)
        # Landlock mode: the ruleset, the private tmp and the limits prlimit sets.
        self._landlock: landlock.LandlockRuleset | None = None
        self._owner_tag: str | None = None
        self._tmp: Path | None = None
        self._command_limits = replace(self.limits, max_processes=None)
        if self.mode == "landlock":
            self._landlock_boundary(read_only_paths, writable_paths)
        self._totals = self._totals_watcher()
        log.info(
            "LocalSandbox %s: isolation=%s, workdir=%s%s", self.id, self.mode, self.workdir, self._described()
        )
        self._attach(scope or current_cancellation())

    def _landlock_boundary(
        self, read_only: Iterable[str | os.PathLike[str]], writable: Iterable[str | os.PathLike[str]]
    ) -> None:
        """The ruleset (built once, closed by ``destroy``), the private tmp and the limits;
        at the first landlock sandbox of this process, the sweep of what SIGKILLed tasks left."""
        support = landlock.landlock_support()
        if _orphans_swept.first():
            kill_orphaned_commands()
        self._owner_tag = owner_tag()
        warn_if_missing()
        landlock.warn_if_missing(support)
        self._command_limits = self._sandbox_limits()
        if self.cgroup is None:
            # RLIMIT_NPROC counts every process of the worker's uid: not this sandbox's count.
            self._command_limits = replace(self._command_limits, max_processes=None)
        self._tmp = self._private_tmp()
        # The rules come last: a rule is on an inode, and a tmpfs mounted on the workdir or the
        # tmp after it (by _sandbox_limits, _private_tmp) would hide the folder it names.
        shown = landlock.readable_paths(interpreter_paths(self.python), [_absolute(p) for p in read_only])
        rw = [*(_absolute(p) for p in writable), str(self.workdir), str(self._tmp)]
        self._landlock = landlock.LandlockRuleset.build(
            support, readable=shown, writable=rw, network=self.network
        )
        weakref.finalize(self, self._landlock.close)

    def _totals_watcher(self) -> TotalsWatcher:
        """The sandbox's totals the kernel does not keep (no cgroup, no tmpfs), counted over its
        commands' trees ([`totals`][cancellable_agents.toolsets.sandbox.local._totals]); boundary
        modes only (process-group mode cannot see a detached process as its command's)."""
        counted = self.cgroup is None and (self._boundary is not None or self._landlock is not None)
        folders: dict[str, tuple[Path, int]] = {}
        if self._boundary is not None or self._landlock is not None:
            bound = self.limits.workdir_bytes
            if bound is not None and self._owns_workdir and not os.path.ismount(self.workdir):
                folders["workdir_bytes"] = (self.workdir, bound)
            if self.limits.tmp_bytes is not None and self._tmp is not None and not os.path.ismount(self._tmp):
                folders["tmp_bytes"] = (self._tmp, self.limits.tmp_bytes)
        return TotalsWatcher(
            max_processes=self.limits.max_processes if counted else None,
            memory_bytes=self.limits.memory_bytes if counted else None,
            folders=folders,
            roots=self._running_roots,
            on_breach=self._kill_at_limit,
        )

    def _running_roots(self) -> list[int]:
        with self._lock:
            return [
                c.popen.pid for c in self._commands.values() if c.stop_reason is None and not c.done.is_set()
            ]

    def _kill_at_limit(self, breach: LimitBreach) -> None:
        """A total past its limit: SIGKILL every running command (each names the limit)."""
        with self._lock:
            running = [c for c in self._commands.values() if c.stop_reason is None and not c.done.is_set()]
        if not running:
            return
        log.warning(
            "sandbox %s: %s; killing its %d running command(s)", self.id, breach.describe(), len(running)
        )
        workers = [
            threading.Thread(target=cmd.kill_at_limit, args=(breach,), name=f"limit-{cmd.id}", daemon=True)
            for cmd in running
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(stop_bound(0.0))

    def _described(self) -> str:
        """The boundary, for the start log line."""
        if self.mode == "namespace":
            return f" (bubblewrap, profile={self.profile}, network={self.egress or self.network})"
        if self._landlock is None:
            return ""
        support = self._landlock.support
        missing = "; ".join(support.missing()) or "none"
        return f" (Landlock ABI {support.abi}, network={self.network}, tmp={self._tmp}, missing: {missing})"

    def _record_detail(self) -> dict[str, object]:
        """What the timeline's ``sandbox_attached`` event says of the boundary beyond the mode."""
        if self._landlock is None:
            return {}
        support = self._landlock.support
        return {"landlock_abi": support.abi, "missing_protections": list(support.missing())}

    def _boundary_env(self, env: dict[str, str]) -> None:
        """``python`` on PATH is the sandbox's interpreter (a PATH entry such as a pyenv shim
        folder is not visible)."""
        if "PATH" not in self._explicit_env:
            bindir = os.path.dirname(os.path.abspath(self.python))
            env["PATH"] = os.pathsep.join([bindir, env.get("PATH") or os.defpath])

    @property
    def capabilities(self) -> SandboxCapabilities:
        """Kills are recorded here, per process with pids; ``stop_all`` stops every command at
        once; ``run_python`` uses this sandbox's interpreter."""
        return SandboxCapabilities(records_kills=True, stops_all_at_once=True, python=self.python)

    # -- scope ---------------------------------------------------------------------------

    @property
    def scope(self) -> TaskCancellation | None:
        """The scope its kills are recorded on: its own attachment's, else that of an attachment
        someone else made for it (``attach_sandbox(sandbox, scope)``); ``None`` while unattached."""
        attachment = self._attachment or attachment_of(self)
        return None if attachment is None else attachment.scope

    def _attached(self) -> SandboxAttachment | None:
        """The sandbox's attachment; at first use, to the run's scope, if there is one."""
        return self._attachment or self._attach(current_cancellation())

    def _attach(self, scope: TaskCancellation | None) -> SandboxAttachment | None:
        """Attach to ``scope`` through
        [`attach_sandbox`][cancellable_agents.toolsets.sandbox._attach.attach_sandbox] (once: the first scope
        stays)."""
        if self.mode == "process-group":
            warn_no_boundary(scope)
        with self._lock:
            if scope is None or self._attachment is not None or self._destroyed:
                return self._attachment
            # Under the lock: two first uses at once attach once (a cancelled scope's release runs
            # on a thread of its own, so it waits for this lock instead of deadlocking on it).
            self._attachment = attach_sandbox(
                self,
                scope,
                name=self.id,
                mode=self.mode,
                profile=self.profile,
                workdir=str(self.workdir),
                **self._record_detail(),
            )
            return self._attachment

    # -- starting ------------------------------------------------------------------------

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Start ``command`` (an argv list, or a string run by ``/bin/sh -c``); return its id.
        ``env`` is added to this command's environment (on top of the sandbox's ``env=``; wins).

        Attached, through the attachment
        ([`SandboxAttachment.start`][cancellable_agents.toolsets.sandbox._attach.SandboxAttachment.start]):
        ``TaskCancelled`` if
        the scope was already cancelled (no command starts after a kill), and a start racing the
        cancel is stopped. Raises
        [`SandboxClosed`][cancellable_agents.toolsets.sandbox.protocol.SandboxClosed] after ``destroy``.
        """
        attachment = self._attached()
        if attachment is None:
            return self.launch(command, timeout=timeout, stdin=stdin, env=env)
        return attachment.start(command, timeout=timeout, stdin=stdin, env=env)

    def launch(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Start ``command`` unguarded: what ``start`` and any attachment of this sandbox
        call (``ScopedSandbox``); nothing else should. Attaches at first use, as ``start``.
        ``env`` reaches the spawn through ``_starting_env`` (this thread's, so concurrent
        starts never see each other's)."""
        token = _starting_env.set(command_env(env))
        try:
            return self._launch_command(command, timeout=timeout, stdin=stdin)
        finally:
            _starting_env.reset(token)

    @property
    def _explicit_env(self) -> dict[str, str]:
        """What the DAG author hands the command explicitly: the sandbox's ``env=``, then the
        ``env=`` of the command being started on this thread (which wins)."""
        return {**self._env, **(_starting_env.get() or {})}

    def _launch_command(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> str:
        """The spawn of ``launch``, with the command's ``env=`` in ``_explicit_env``."""
        self._attached()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        command_id = uuid.uuid4().hex[:12]
        tag = f"{self.id}:{command_id}"
        env = scrubbed_environment(os.environ, self._explicit_env, home=str(self.workdir))
        if self._boundary is not None or self._landlock is not None:
            self._boundary_env(env)
        if self._tmp is not None and "TMPDIR" not in self._explicit_env:
            env["TMPDIR"] = str(self._tmp)
        if self._owner_tag is not None:
            env[OWNER_VAR] = self._owner_tag
        if self._proxy is not None:
            env.update({k: v for k, v in proxy_env().items() if k not in self._explicit_env})
        env[COMMAND_TAG] = tag
        with self._lock:
            if self._destroyed:
                raise SandboxClosed(f"sandbox {self.id} was destroyed; it starts no more commands")
            with command_filter(
                self._boundary is not None or self._landlock is not None, self._sockets()
            ) as seccomp_fd:
                report_fd = self._kill_report()
                try:
                    wrapped = self._wrap(argv, seccomp_fd, report_fd)
                    inherited = self._inherited(seccomp_fd, report_fd)
                    cmd = self._spawn(command_id, wrapped, env, tag, timeout, stdin, inherited, report_fd)
                except BaseException:
                    if report_fd is not None:
                        os.close(report_fd)
                    raise
            self._commands[command_id] = cmd
            self._forget_old_results()
        self._totals.ensure_started()
        return command_id

    def _forget_old_results(self) -> None:
        """Keep the results of the last ``KEEP_RESULTS`` finished commands (memory stays bounded)."""
        finished = [cid for cid, c in self._commands.items() if c.done.is_set()]
        for command_id in finished[: max(0, len(finished) - KEEP_RESULTS)]:
            del self._commands[command_id]

    def _sockets(self) -> SocketRule:
        """Landlock mode: no network socket without the host's network (no namespace confines
        one), and no named unix socket unless ``unix_sockets`` (nothing hides the worker's)."""
        if self._landlock is None:
            return SocketRule.NAMESPACED
        if self.network:
            return SocketRule.NAMESPACED if self.unix_sockets else SocketRule.NO_NAMED_UNIX
        return SocketRule.UNIX_ONLY if self.unix_sockets else SocketRule.PAIRS_ONLY

    def _kill_report(self) -> int | None:
        """Landlock mode: the memfd a command's init reports its kills to (the command owns it)."""
        if self._landlock is None:
            return None
        return os.memfd_create("cancellable-agents-kill-report", os.MFD_CLOEXEC)

    def _inherited(self, seccomp_fd: int | None, report_fd: int | None = None) -> tuple[int, ...]:
        """The descriptors a command's first process inherits: its filter, the ruleset, the
        init's kill report."""
        fds = [fd for fd in (seccomp_fd, report_fd) if fd is not None]
        if self._landlock is not None:
            fds.append(self._landlock.fd)
        return tuple(fds)

    def _wrap(
        self, argv: list[str], seccomp_fd: int | None = None, report_fd: int | None = None
    ) -> list[str]:
        if self._landlock is not None:
            placement = self.cgroup.placement_prefix() if self.cgroup is not None else []
            limits = limits_prefix(prlimit_path(), self._command_limits)
            init = landlock.init_argv(
                self.python,
                self._landlock,
                seccomp_fd,
                report_fd=-1 if report_fd is None else report_fd,
                grace=self.stop_grace,
            )
            return placement + limits + init + argv
        if self.mode != "namespace":
            # Per-uid here, RLIMIT_NPROC would count every process of the worker's user.
            # (No bubblewrap probe here: its orphans would come back to a subreaper task process.)
            return limits_prefix(prlimit_path(), replace(self.limits, max_processes=None)) + argv
        support = bwrap_support()
        if self._boundary is None:
            return host_argv(support, str(self.workdir), self.python) + argv
        placement = self.cgroup.placement_prefix() if self.cgroup is not None else []
        forwarder = forwarder_argv(self.python) if self._proxy is not None else []
        return placement + boundary_argv(support, self._boundary, seccomp_fd=seccomp_fd) + forwarder + argv

    def _spawn(
        self,
        command_id: str,
        argv: list[str],
        env: dict[str, str],
        tag: str,
        timeout: float | None,
        stdin: str | bytes | None,
        pass_fds: tuple[int, ...] = (),
        report_fd: int | None = None,
    ) -> CommandTree:
        hits_before = self.cgroup.limit_hits() if self.cgroup is not None else None
        started = time.monotonic()
        proc = start_process(
            argv, cwd=self.workdir, env=env, piped_stdin=stdin is not None, pass_fds=pass_fds
        )
        info = read_proc(proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        cmd = CommandTree(
            id=command_id,
            owner=self,
            popen=proc,
            main=ProcKey(proc.pid, info.start if info else 0.0),
            mode=self.mode,
            tag=f"{COMMAND_TAG}={tag}\0".encode(),
            started=started,
            timeout=timeout,
            stdout=BoundedReader(proc.stdout, self.output_limit, f"sandbox-{command_id}-stdout"),
            stderr=BoundedReader(proc.stderr, self.output_limit, f"sandbox-{command_id}-stderr"),
            cgroup=self.cgroup,
            hits_before=hits_before,
            report_fd=report_fd,
        )
        if stdin is not None:
            feed_stdin(proc, stdin.encode() if isinstance(stdin, str) else stdin)
        cmd.watch()
        return cmd

    def descendants(self, command_id: str) -> list[int]:
        """Pids of the command's running descendants the tracker has seen (not bwrap itself)."""
        cmd = self._commands.get(command_id)
        return [] if cmd is None else cmd.descendants()

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
        cmd.terminate("stopped")

    def stop_all(self) -> None:
        """Stop every running command, concurrently, so N commands cost one grace period."""
        with self._lock:
            running = [c for c in self._commands.values() if not c.done.is_set()]
        workers = [
            threading.Thread(target=cmd.terminate, args=("stopped",), name=f"stop-{cmd.id}", daemon=True)
            for cmd in running
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(stop_bound(self.stop_grace))

    def destroy(self) -> None:
        """Stop all commands and remove the workdir if this sandbox created it. Idempotent."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
        self._totals.close()
        self.stop_all()
        if self._proxy is not None:
            self._proxy.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self._landlock is not None:
            self._landlock.close()
        if self._tmp is not None:
            remove_workdir(self._tmp)
        if self._attachment is not None:
            self._attachment.detach()
        if self._owns_workdir:
            remove_workdir(self.workdir)
        log.debug("sandbox %s destroyed", self.id)
