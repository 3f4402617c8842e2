"""Waiting for a local command's result: ``wait``, ``run`` and ``arun`` of
[`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox].

The sandbox's result side, apart from how commands are started and stopped: a mixin of
``LocalSandbox`` that reads its registry of commands (``_commands``, each a
[`CommandTree`][] whose watcher fills the
result) and starts and stops through the sandbox's own ``start`` and ``stop``. ``arun`` hands the
result to an event loop without a thread per wait. This module imports no Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Protocol

from cancellable_agents.core._shield import wait_shielded
from cancellable_agents.toolsets.sandbox.local._command import CommandTree
from cancellable_agents.toolsets.sandbox.protocol import CommandResult

__all__ = ["CommandResults"]


class _Runs(Protocol):
    """What ``run`` and ``arun`` use of the sandbox they are part of."""

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str: ...

    def stop(self, command_id: str) -> None: ...

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult: ...

    def _get(self, command_id: str) -> CommandTree: ...

    @staticmethod
    def _result_future(cmd: CommandTree) -> asyncio.Future[CommandResult]: ...


class CommandResults:
    """``wait``, ``run`` and ``arun`` over a sandbox's commands (mixed into ``LocalSandbox``)."""

    id: str
    _commands: dict[str, CommandTree]

    def _get(self, command_id: str) -> CommandTree:
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
        self: _Runs,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Start ``command`` and wait for it. Interrupted (e.g. ``KeyboardInterrupt``), it stops
        the command before re-raising."""
        command_id = self.start(command, timeout=timeout, stdin=stdin, env=env)
        try:
            return self.wait(command_id)
        except BaseException:
            self.stop(command_id)
            raise

    async def arun(
        self: _Runs,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Like [`run`][] without blocking the event loop. On ``CancelledError`` the command
        is stopped (its whole tree, on a thread) before the error propagates."""
        command_id = self.start(command, timeout=timeout, stdin=stdin, env=env)
        try:
            return await self._result_future(self._get(command_id))
        except asyncio.CancelledError:
            await wait_shielded(asyncio.to_thread(self.stop, command_id), f"the stop of command {command_id}")
            raise

    @staticmethod
    def _result_future(cmd: CommandTree) -> asyncio.Future[CommandResult]:
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
