"""The agent's side of a sandbox: ``run_shell``, ``run_python`` and file tools on any backend, as
a pydantic-ai toolset ([`SandboxTools`][]; DAG files describe it with ``SandboxToolset``).

Generic: the local backend ([`LocalSandbox`][], with bubblewrap, seccomp, Landlock and cgroups
code under it) is imported only when this toolset makes one, so a task with another backend never
loads it (``tests/unit/test_run_time_modules.py`` holds that).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic_ai import ModelRetry
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents.core._shield import wait_shielded
from cancellable_agents.core._workers import JobThread
from cancellable_agents.core.scope import current_cancellation
from cancellable_agents.run.tool_calls import current_tool_call
from cancellable_agents.toolsets.sandbox._attach import SandboxAttachment, attach_sandbox
from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.limits import Limits
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    Sandbox,
    SandboxFiles,
    SandboxPathError,
)
from cancellable_agents.toolsets.sandbox.sandbox_toolset import refuse_local_options

if TYPE_CHECKING:
    from cancellable_agents.toolsets.sandbox.local._isolation import Isolation, Profile

__all__ = ["SandboxTools"]

T = TypeVar("T")

#: What a signal that ended a command means, in words the model can act on.
_SIGNAL_MEANING = {
    int(signal.SIGXFSZ): "file size limit exceeded (a file grew past the sandbox's limit)",
    int(signal.SIGXCPU): "CPU time limit exceeded",
    int(signal.SIGKILL): "killed (SIGKILL): out of memory, or past the hard CPU time limit",
    int(signal.SIGSEGV): "crashed (SIGSEGV); a memory limit makes allocations fail",
}
#: A SIGKILL where the sandbox counts its memory limit (a cgroup): which one it was.
_OUT_OF_MEMORY = (
    "killed (SIGKILL): out of memory, the sandbox's memory limit (all its commands and /tmp together)"
)
_SIGKILL_NOT_MEMORY = (
    "killed (SIGKILL): past the hard CPU time limit, or by another process (not out of memory)"
)


class SandboxTools(FunctionToolset[Any]):
    """Shell, Python and file tools for a pydantic-ai agent, run in any [`Sandbox`][] backend: the
    toolset a [`SandboxToolset`][cancellable_agents.toolsets.sandbox.sandbox_toolset.SandboxToolset]
    makes when the task runs (its arguments are this class's).

    ``Agent(model, toolsets=[SandboxTools()])``. Without ``sandbox`` a [`LocalSandbox`][]
    (``isolation``, ``profile``, ``network``: ``True``, ``False`` or an egress allowlist,
    ``limits``, ``workdir``, ``env``, ``output_limit``) is created on first use and destroyed when
    the toolset is exited. A sandbox passed in is the caller's: the toolset never destroys it, and
    refuses those local options (``ConfigurationError``: set them on the backend instead). A kill
    destroys any backend attached to the task's scope, this one included (the ownership rule, in
    [`protocol`][cancellable_agents.toolsets.sandbox.protocol]). Either way, every backend is
    attached to the run's [`current_cancellation`][] on first use ([`attach_sandbox`][]: the same
    attachment where it is attached to that scope already) and its commands are started through that
    attachment, so a kill stops them, one that races the kill included; the toolset lets go of the
    attachment when it is exited. Commands run at most ``command_timeout`` seconds (a tool call may
    ask for less).
    """

    #: The workspace is created per try and gone on the next: a durable run resumed in a later
    #: try is told so (``cancellable_agents.durable._fingerprint.WORKSPACE_SURVIVES_A_RETRY``).
    workspace_survives_a_retry: ClassVar[bool] = False

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        isolation: Isolation = "auto",
        profile: Profile = "boundary",
        network: bool | EgressPolicy | Sequence[str] = False,
        limits: Limits | None = None,
        command_timeout: float = 60,
        output_limit: int | None = None,
        id: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        refuse_local_options(
            sandbox,
            isolation=isolation,
            profile=profile,
            network=network,
            limits=limits,
            output_limit=output_limit,
            workdir=workdir,
            env=env,
        )
        super().__init__(id=id)
        self._workdir = workdir
        self._env = env
        self._sandbox = sandbox
        self._owned = False
        self._isolation = isolation
        self._profile: Profile = profile
        self._network = EgressPolicy.coerce(network)
        self._limits = limits
        self._attachment: SandboxAttachment | None = None  # guarded by _lock
        self.command_timeout = command_timeout
        self.output_limit = output_limit
        self._lock = threading.Lock()
        self._entered = 0
        self.add_function(self.run_shell, name="run_shell")
        self.add_function(self.run_python, name="run_python")
        if sandbox is None or isinstance(sandbox, SandboxFiles):
            self.add_function(self.read_file, name="read_file")
            self.add_function(self.write_file, name="write_file")
            self.add_function(self.list_files, name="list_files")

    @property
    def sandbox(self) -> Sandbox | None:
        """The sandbox in use (``None`` until a lazily created one is first needed)."""
        return self._sandbox

    def _get_sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = self._local_sandbox()
                self._owned = True
            return self._sandbox

    def _local_sandbox(self) -> Sandbox:
        """The toolset's own [`LocalSandbox`][], imported only now: a task with another
        backend never loads the local one (its boundary code is most of the sandbox package)."""
        from cancellable_agents.toolsets.sandbox.local._sandbox import LocalSandbox

        options: dict[str, Any] = {} if self.output_limit is None else {"output_limit": self.output_limit}
        return LocalSandbox(
            self._workdir,
            env=self._env,
            isolation=self._isolation,
            profile=self._profile,
            network=self._network,
            limits=self._limits,
            **options,
        )

    def _attached(self, sandbox: Sandbox) -> SandboxAttachment | None:
        """The backend's attachment to the run's scope (``None`` outside a run); the one it had
        for an earlier run's scope is let go."""
        scope = current_cancellation()
        with self._lock:
            if self._attachment is not None and self._attachment.scope is scope:
                return self._attachment
            if self._attachment is not None:
                self._attachment.detach()
            self._attachment = None if scope is None else attach_sandbox(sandbox, scope)
            return self._attachment

    async def __aenter__(self) -> SandboxTools:
        self._entered += 1
        return self

    async def __aexit__(self, *args: Any) -> bool | None:
        self._entered = max(0, self._entered - 1)
        if self._entered:
            return None
        with self._lock:
            sandbox = self._sandbox if self._owned else None
            if sandbox is not None:
                self._sandbox, self._owned = None, False
            attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.detach()  # the caller's backend: stays alive, no longer tied to this run
        if sandbox is not None:
            await wait_shielded(asyncio.to_thread(sandbox.destroy), "the sandbox's teardown")
        return None

    def _timeout(self, requested: float | None) -> float:
        if requested is None or requested <= 0:
            return self.command_timeout
        return min(requested, self.command_timeout)

    async def _execute(
        self, command: str | Sequence[str], timeout: float | None, stdin: str | None = None
    ) -> dict[str, Any]:
        sandbox = self._get_sandbox()
        limit = self._timeout(timeout)
        call = current_tool_call()
        # The command can dedupe its side effects by its tool call's key (no shell needed).
        env = call.env() if call is not None else None
        result = await _run_on_backend(self._attached(sandbox) or sandbox, command, limit, stdin, env)
        return _for_model(result, limit)

    async def run_shell(self, command: str, timeout: float | None = None) -> dict[str, Any]:
        """Run a shell command (``/bin/sh -c``) in the sandbox's working directory.

        Args:
            command: The shell command line.
            timeout: Seconds before the command is killed (capped by the toolset's limit).

        Returns:
            exit_code, stdout and stderr (and timed_out / truncated when that happened).
        """
        return await self._execute(command, timeout)

    async def run_python(self, code: str, timeout: float | None = None) -> dict[str, Any]:
        """Run a Python program in the sandbox's working directory.

        Args:
            code: The program's source code.
            timeout: Seconds before the program is killed (capped by the toolset's limit).

        Returns:
            exit_code, stdout and stderr (and timed_out / truncated when that happened).
        """
        python = self._get_sandbox().capabilities.python
        return await self._execute([python, "-"], timeout, stdin=code)

    async def read_file(self, path: str) -> str:
        """Read a text file from the sandbox's working directory.

        Args:
            path: Path relative to the working directory.
        """
        return await self._files(lambda files: files.read_file(path))

    async def write_file(self, path: str, content: str) -> str:
        """Write a text file in the sandbox's working directory (parent folders are created).

        Args:
            path: Path relative to the working directory.
            content: The full new content of the file.
        """
        written = await self._files(lambda files: files.write_file(path, content))
        return f"wrote {written} bytes to {path}"

    async def list_files(self, path: str = ".") -> list[str]:
        """List a folder of the sandbox's working directory; folders end with '/'.

        Control characters and backslashes in names are shown escaped (\\n, \\x1b, \\\\). A long
        listing is cut: its last entry says how many names were left out (use run_shell to
        see them, e.g. with find or ls piped to head).

        Args:
            path: Folder relative to the working directory.
        """
        return await self._files(lambda files: files.list_files(path))

    async def _files(self, action: Callable[[SandboxFiles], T]) -> T:
        sandbox = self._get_sandbox()
        if not isinstance(sandbox, SandboxFiles):
            raise ModelRetry("this sandbox has no file access; use run_shell instead")
        try:
            return await _on_daemon_thread(functools.partial(action, sandbox))
        except SandboxPathError as exc:
            raise ModelRetry(str(exc)) from exc
        except FileNotFoundError as exc:
            raise ModelRetry(f"no such file or folder: {exc.filename}") from exc
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise ModelRetry(f"{exc.strerror}: {exc.filename}") from exc


async def _run_on_backend(
    sandbox: Sandbox | SandboxAttachment,
    command: str | Sequence[str],
    timeout: float,
    stdin: str | None,
    env: Mapping[str, str] | None,
) -> CommandResult:
    """Run on any backend (through its attachment, when it has one) without blocking the loop;
    stop the command on cancel."""
    command_id = await _on_daemon_thread(
        functools.partial(sandbox.start, command, timeout=timeout, stdin=stdin, env=env)
    )
    try:
        return await _on_daemon_thread(functools.partial(sandbox.wait, command_id, None))
    except asyncio.CancelledError:
        stop = _on_daemon_thread(functools.partial(sandbox.stop, command_id))
        await wait_shielded(stop, f"the stop of command {command_id}")
        raise


async def _on_daemon_thread(call: Callable[[], T]) -> T:
    """``asyncio.to_thread`` on a daemon thread, for every call into a backend. A cancelled tool
    leaves its backend call behind; if the backend never answers it (a stalled connection), a
    thread of asyncio's default executor would hold the task process at exit (they are joined
    then) until SIGKILL."""
    worker = JobThread("cancellable-agents-sandbox-call")
    future = worker.submit(functools.partial(contextvars.copy_context().run, call))
    worker.stop()  # the thread ends once this call returns
    return await asyncio.wrap_future(future)


def _for_model(result: CommandResult, timeout: float) -> dict[str, Any]:
    answer: dict[str, Any] = {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
    if result.timed_out:
        answer["timed_out"] = f"killed after {timeout:g}s"
    elif result.limit_exceeded:
        answer["stopped"] = f"killed by the sandbox: its {result.limit_exceeded} limit was exceeded"
    elif result.stopped:
        answer["stopped"] = "stopped by the sandbox (the task is being cancelled)"
    elif (meaning := _killed_by(result)) is not None:
        answer["killed_by"] = meaning
    if result.memory_limit_kills and answer.get("killed_by") != _OUT_OF_MEMORY:
        answer["memory_limit"] = (
            f"the sandbox's memory limit ended {result.memory_limit_kills} of its processes (SIGKILL)"
        )
    if result.process_limit_hits:
        answer["process_limit"] = (
            f"{result.process_limit_hits} fork(s) refused at the sandbox's process limit"
        )
    if result.stdout_truncated or result.stderr_truncated:
        answer["truncated"] = True
    return answer


def _killed_by(result: CommandResult) -> str | None:
    """The signal in words; a SIGKILL is told apart where the sandbox counted its memory limit."""
    signum = _signal_of(result.exit_code)
    if signum != signal.SIGKILL or result.memory_limit_kills is None:
        return _SIGNAL_MEANING.get(signum)
    return _OUT_OF_MEMORY if result.memory_limit_kills else _SIGKILL_NOT_MEMORY


def _signal_of(exit_code: int) -> int:
    """The signal that ended a command: ``-N`` (Popen) or ``128 + N`` (a shell, bubblewrap)."""
    if exit_code < 0:
        return -exit_code
    return exit_code - 128 if 128 < exit_code < 160 else 0
