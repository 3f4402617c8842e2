"""What a sandbox backend is: the [`Sandbox`][] protocol, its capabilities, result and errors.

Any backend (the local one, a container, a remote API) implements [`Sandbox`][] and declares what it
does beyond it in one typed value, [`SandboxCapabilities`][] (who writes the kill records, whether
``stop_all`` stops everything at once, the interpreter ``run_python`` uses): nothing is read off a
backend by ``getattr``. Two more optional capabilities are protocols of their own, checked with
``isinstance``: file access ([`SandboxFiles`][]) and a ``start`` that goes through the backend's own
attachment ([`ScopedSandbox`][]).
[`attach_sandbox`][cancellable_agents.toolsets.sandbox._attach.attach_sandbox] ties any backend to a
task's scope (a backend never needs to know its scope otherwise; one that writes its own kill
records finds it with [`attachment_of`][cancellable_agents.toolsets.sandbox._attach.attachment_of]),
and [`SandboxToolset`][cancellable_agents.toolsets.sandbox.sandbox_toolset.SandboxToolset] gives any
of them to an agent. ``cancellable_agents.testing.sandbox_conformance`` is the contract as tests,
for any backend.

Ownership, stated once (the toolset,
[`attach_sandbox`][cancellable_agents.toolsets.sandbox._attach.attach_sandbox] and the docs follow
it):

- **on a kill**, every backend attached to the task's scope is stopped (``Phase.IN_FLIGHT``) and
  then destroyed (``Phase.TEARDOWN``), within the budget, whoever made it: the task is ending, and
  nothing it started may outlive it;
- **without a kill**, whoever made the backend destroys it: ``SandboxToolset`` destroys the
  ``LocalSandbox`` it made when it is exited, and never a backend passed in with ``sandbox=``,
  which is the caller's (an attachment's ``detach`` lets go without stopping anything).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from cancellable_agents.core.exceptions import CancellableAgentsError, ConfigurationError

__all__ = [
    "CommandResult",
    "Sandbox",
    "SandboxCapabilities",
    "SandboxClosed",
    "SandboxError",
    "SandboxFiles",
    "SandboxPathError",
    "SandboxUnavailable",
    "ScopedSandbox",
    "command_env",
    "require_sandbox",
]


class SandboxError(CancellableAgentsError, RuntimeError):
    """Base class of the sandbox's errors (a [`CancellableAgentsError`][])."""


class SandboxUnavailable(SandboxError):
    """The requested isolation cannot be provided on this machine."""


class SandboxClosed(SandboxError):
    """The sandbox was destroyed; it starts no more commands."""


class SandboxPathError(SandboxError, ValueError):
    """A file path points outside the sandbox's working directory."""


@dataclass(frozen=True)
class CommandResult:
    """How a command ended.

    ``exit_code`` is the main process's exit status (negative signal number when a signal
    ended it). A command the sandbox stopped (``stop``, timeout, cancel) has ``stopped=True``
    and ``exit_code == -signal`` of the last signal it needed, whatever it exited with:
    a stopped command never reads as a success. In namespace mode a command killed by a
    signal it did not get from the sandbox reports ``128 + signal`` (bubblewrap's convention).
    ``memory_limit_kills`` and ``process_limit_hits`` count the sandbox's totals enforced while
    the command ran (commands running beside it share the counts); ``None`` where the backend
    has no per-sandbox totals to count. ``limit_exceeded`` names the sandbox total (a
    ``Limits`` field: ``"max_processes"``, ``"memory_bytes"``, ``"workdir_bytes"``,
    ``"tmp_bytes"``) at which the sandbox SIGKILLed the command, where it counts the totals itself
    (no cgroup); such a command is ``stopped``.
    """

    command_id: str
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    stopped: bool = False
    duration: float = 0.0
    memory_limit_kills: int | None = None
    process_limit_hits: int | None = None
    limit_exceeded: str | None = None

    @property
    def ok(self) -> bool:
        """Ended on its own with exit code 0."""
        return self.exit_code == 0 and not self.stopped

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SandboxCapabilities:
    """What a backend does beyond the [`Sandbox`][] protocol, declared (the defaults: nothing).

    Each field has one effect, and nothing else about a backend is read by name:

    - ``records_kills``: the backend writes its own kill records (one
      [`KillRecord`][cancellable_agents.core.timeline.KillRecord] per process, with pids, as
      [`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox] does) on the
      scope of its attachment, whoever attached it
      ([`attachment_of`][cancellable_agents.toolsets.sandbox._attach.attachment_of]); the attachment
      then writes none. ``False``: the attachment writes one record per command it stopped (no pid).
    - ``stops_all_at_once``: ``stop_all`` stops every running command concurrently, so N commands
      cost one grace; on a kill the attachment then calls ``stop_all`` alone. ``False``: the
      attachment first stops each command it started, each on a thread of its own, then calls
      ``stop_all``. (An attachment that writes the records stops each command itself either way:
      it records what it stopped.)
    - ``python``: the program that runs Python code inside the backend (``run_python`` starts
      ``[python, "-"]`` with the code on stdin).
    """

    records_kills: bool = False
    stops_all_at_once: bool = False
    python: str = "python3"


def command_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """A command's ``env=`` checked: names and values are strings, a name is non-empty and has no
    ``=`` or NUL (which no environment can hold). [`ConfigurationError`][] names the fix."""
    checked: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigurationError(
                f"env= names must be non-empty strings without '=' or NUL, got {name!r}; "
                "fix the variable's name"
            )
        if not isinstance(value, str) or "\0" in value:
            raise ConfigurationError(
                f"env={{{name!r}: ...}} must be a string without NUL, got {value!r}; "
                "pass str(value) (an environment holds only strings)"
            )
        checked[name] = value
    return checked


@runtime_checkable
class Sandbox(Protocol):
    """What [`SandboxToolset`][cancellable_agents.toolsets.sandbox.sandbox_toolset.SandboxToolset]
    and the cancellation scope need from a sandbox backend.

    - ``start`` returns an id as soon as the command runs; ``wait`` blocks for its result (raises
      ``TimeoutError`` after ``timeout``, ``KeyError`` for an unknown id). A string command is a
      shell command line (``/bin/sh -c``); a sequence is an argv, run without a shell, so a
      backend with no shell runs it. ``env`` is set for that command alone, on top of the
      backend's own environment (its values win); no shell is needed to set it. ``stdin`` is fed
      to the command (then closed). ``timeout`` is enforced by the backend: past it the command
      is stopped and its result has ``timed_out=True`` (and ``stopped=True``). After
      ``destroy``, ``start`` raises [`SandboxClosed`][].
    - ``stop``, ``stop_all`` and ``destroy`` must be idempotent, thread-safe and bounded in time:
      they are called from the scope's unwind thread within the task's grace budget, possibly
      while another thread is inside ``start``. ``stop_all`` stops every command whose ``start``
      has returned. A stopped command's result has ``stopped=True``.
    - A backend whose processes live elsewhere (a container, a remote API) cannot rely on this
      process surviving: on a SIGKILL of the task nothing here runs, so it must end orphaned
      commands itself (a TTL or a lease the backend renews while the task lives).
    - ``capabilities`` declares what it does beyond this ([`SandboxCapabilities`][]; a class
      attribute ``capabilities = SandboxCapabilities()`` declares nothing more).
    - Who destroys it: see this module's docstring (a kill destroys every attached backend).
    """

    @property
    def capabilities(self) -> SandboxCapabilities: ...

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str: ...

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult: ...

    def stop(self, command_id: str) -> None: ...

    def stop_all(self) -> None: ...

    def destroy(self) -> None: ...


@runtime_checkable
class SandboxFiles(Protocol):
    """File access confined to a sandbox's working directory (enables the file tools)."""

    def read_file(self, path: str) -> str: ...

    def write_file(self, path: str, content: str) -> int: ...

    def list_files(self, path: str = ".") -> list[str]: ...


@runtime_checkable
class ScopedSandbox(Sandbox, Protocol):
    """A backend whose own ``start`` goes through its attachment
    ([`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox]).

    Such a backend attaches itself (``attach_sandbox``) to the scope it is given or finds, and its
    ``start`` is
    [`SandboxAttachment.start`][cancellable_agents.toolsets.sandbox._attach.SandboxAttachment.start],
    so the one start-race guard covers its direct callers too. The attachment starts its commands
    with ``launch``: the unguarded start, which nothing else calls.
    """

    def launch(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str: ...


def require_sandbox(backend: object) -> None:
    """Refuse, naming the fix, what does not implement the [`Sandbox`][] protocol (a backend
    written before ``env=`` and ``capabilities`` were declared, say)."""
    if isinstance(backend, Sandbox):
        return
    wanted = ("capabilities", "start", "wait", "stop", "stop_all", "destroy")
    missing = [name for name in wanted if not hasattr(backend, name)]
    raise ConfigurationError(
        f"{type(backend).__name__} is not a Sandbox backend (missing: {', '.join(missing) or 'none'}). "
        "Fix: implement cancellable_agents.toolsets.sandbox.Sandbox: start(command, *, timeout, "
        "stdin, env), wait, stop, stop_all, destroy, and declare `capabilities = "
        "SandboxCapabilities()` (the defaults declare nothing beyond the protocol)."
    )
