"""What a sandbox backend is: the :class:`Sandbox` protocol, its result type and its errors.

Any backend (the local one, a container, a remote API) implements :class:`Sandbox`; file access
is the optional :class:`SandboxFiles`. :func:`~cancellable_agents.toolsets.sandbox.attach_sandbox`
ties any of them to a task's scope (a backend never needs to know its scope otherwise;
:class:`ScopedSandbox` is for one whose own ``start`` is guarded by its attachment), and
:class:`~cancellable_agents.toolsets.sandbox.SandboxToolset` gives any of them to an agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from cancellable_agents.core.exceptions import CancellableAgentsError

__all__ = [
    "CommandResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxFiles",
    "SandboxPathError",
    "SandboxUnavailable",
    "ScopedSandbox",
]


class SandboxError(CancellableAgentsError, RuntimeError):
    """Base class of the sandbox's errors (a :class:`CancellableAgentsError`)."""


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
    :class:`Limits` field: ``"max_processes"``, ``"memory_bytes"``, ``"workdir_bytes"``,
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


@runtime_checkable
class Sandbox(Protocol):
    """What :class:`SandboxToolset` and the cancellation scope need from a sandbox backend.

    - ``start`` returns an id as soon as the command runs; ``wait`` blocks for its result (raises
      ``TimeoutError`` after ``timeout``, ``KeyError`` for an unknown id).
    - ``stop``, ``stop_all`` and ``destroy`` must be idempotent, thread-safe and bounded in time:
      they are called from the scope's unwind thread within the task's grace budget, possibly
      while another thread is inside ``start``. ``stop_all`` stops every command whose ``start``
      has returned. A stopped command's result has ``stopped=True``.
    - A backend whose processes live elsewhere (a container, a remote API) cannot rely on this
      process surviving: on a SIGKILL of the task nothing here runs, so it must end orphaned
      commands itself (a TTL or a lease the backend renews while the task lives).
    - ``records_kills = True`` (optional attribute) says the backend records its own kills on
      the scope its attachment gave it (as :class:`LocalSandbox` does, with pids); otherwise the
      attachment records one entry per command it stopped.
    """

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
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
    """A backend whose own ``start`` goes through its attachment (:class:`LocalSandbox`).

    Such a backend attaches itself (``attach_sandbox``) to the scope it is given or finds, and
    its ``start`` is :meth:`SandboxAttachment.start
    <cancellable_agents.toolsets.sandbox.attach.SandboxAttachment.start>`, so the one start-race
    guard covers its direct callers too. The attachment starts its commands with ``launch``:
    the unguarded start, which nothing else calls.
    """

    def launch(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> str: ...
