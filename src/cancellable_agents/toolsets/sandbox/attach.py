"""Tie any :class:`Sandbox` backend to a task's cancellation scope.

:func:`attach_sandbox` registers two resources on the scope: the backend's in-flight commands are
stopped in ``Phase.IN_FLIGHT`` (before any teardown), the backend is destroyed in
``Phase.TEARDOWN``. :meth:`SandboxAttachment.start` is the race-free way to start a command: it
refuses after a cancel, counts itself as *starting* while the backend's ``start`` runs, and a
cancel that lands during that call waits (within the budget) for the id and stops it. Kills are
recorded per command id, with no assumption of a local pid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from cancellable_agents.core.record import KillRecord
from cancellable_agents.core.scope import Phase, ResourceHandle, TaskCancellation
from cancellable_agents.toolsets.sandbox.protocol import CommandResult, Sandbox

__all__ = ["SandboxAttachment", "attach_sandbox"]

log = logging.getLogger(__name__)

#: Budget kept back, when waiting for a racing ``start``, for stopping what it started.
START_RESERVE = 0.5


class SandboxAttachment:
    """One backend attached to one scope (see :func:`attach_sandbox`). Thread-safe."""

    def __init__(self, backend: Sandbox, scope: TaskCancellation, name: str) -> None:
        self.backend = backend
        self.scope = scope
        self.name = name
        self._records = not getattr(backend, "records_kills", False)
        self._cond = threading.Condition()
        self._starting = 0  # guarded by _cond: calls inside backend.start right now
        self._stopping = 0  # guarded by _cond: stops whose kill record is not written yet
        self._running: dict[str, str] = {}  # guarded by _cond: id -> command text, until waited
        self._handles: list[ResourceHandle] = []

    # -- the command path ----------------------------------------------------------------

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
    ) -> str:
        """``backend.start`` made safe against a cancel: raises ``TaskCancelled`` if the scope was
        cancelled before, and stops the new command (then raises) if it was cancelled during."""
        self.scope.raise_if_cancelled()
        text = command if isinstance(command, str) else " ".join(command)
        with self._cond:
            self._starting += 1
        try:
            command_id = self.backend.start(command, timeout=timeout, stdin=stdin)
            with self._cond:
                self._running[command_id] = text[:120]
            if self.scope.cancelled:
                # The IN_FLIGHT stop may have looked before this id existed: stop it here, while
                # still counted as starting, so the unwind waits for this stop and its record.
                self._stop(command_id, reason="started as the task was cancelled")
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
        self.scope.raise_if_cancelled()
        return command_id

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult:
        result = self.backend.wait(command_id, timeout)
        with self._cond:
            self._running.pop(command_id, None)
        return result

    def stop(self, command_id: str) -> None:
        self._stop(command_id, reason="stopped")

    # -- what the scope calls ------------------------------------------------------------

    def stop_in_flight(self) -> None:
        """``Phase.IN_FLIGHT``: stop every command, including one whose ``start`` is running."""
        self._stop_known()
        self.backend.stop_all()
        deadline = time.monotonic() + max(0.0, self.scope.remaining() - START_RESERVE)
        with self._cond:
            while self._starting and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            late = self._starting
        if late:
            log.warning("sandbox %s: a command's start did not return within the budget", self.name)
        self._stop_known()
        self._wait_for_stops()

    def _wait_for_stops(self) -> None:
        """Wait (within the budget) for stops begun elsewhere, e.g. by a cancelled tool call, so
        their kill records are in the scope before it reports itself released."""
        deadline = time.monotonic() + self.scope.remaining()
        with self._cond:
            while self._stopping and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def destroy(self) -> None:
        """``Phase.TEARDOWN``: destroy the backend (once; later calls return at once)."""
        for handle in self._handles:
            handle.unregister()
        self.backend.destroy()

    def detach(self) -> None:
        """Unregister from the scope without stopping anything (the caller destroys it)."""
        for handle in self._handles:
            handle.unregister()

    def _stop_known(self) -> None:
        with self._cond:
            ids = list(self._running)
        workers = [threading.Thread(target=self._stop, args=(cid, "stopped"), daemon=True) for cid in ids]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(0.1, self.scope.remaining()))

    def _stop(self, command_id: str, reason: str) -> None:
        with self._cond:
            text = self._running.pop(command_id, None)
            self._stopping += 1
        try:
            self.backend.stop(command_id)
            if text is not None and self._records:
                self.scope.record_killed(_kill_record(self.name, command_id, text, reason))
        finally:
            with self._cond:
                self._stopping -= 1
                self._cond.notify_all()


def _kill_record(sandbox: str, command_id: str, command: str, reason: str) -> KillRecord:
    """A kill record for a command whose processes this process may not see (no pid)."""
    return KillRecord(
        source="sandbox",
        sandbox=sandbox,
        command_id=command_id,
        command=command,
        reason=reason,
        at=round(time.time(), 3),
    )


def attach_sandbox(
    backend: Sandbox, scope: TaskCancellation, *, name: str | None = None, **detail: Any
) -> SandboxAttachment:
    """Attach ``backend`` to ``scope``: on a cancel its commands are stopped first
    (``Phase.IN_FLIGHT``), then it is destroyed (``Phase.TEARDOWN``), inside the scope's budget.

    Start commands through the returned attachment's ``start`` (race-free against the cancel).
    Attaching after the scope was cancelled stops and destroys at once. ``detail`` goes into the
    timeline's ``sandbox_attached`` event.
    """
    label = name or f"{type(backend).__name__}@{id(backend):x}"
    attachment = SandboxAttachment(backend, scope, label)
    attachment._handles = [
        scope.register(attachment.stop_in_flight, name=f"sandbox {label} commands", phase=Phase.IN_FLIGHT),
        scope.register(attachment.destroy, name=f"sandbox {label}", phase=Phase.TEARDOWN),
    ]
    scope.record("sandbox_attached", sandbox=label, backend=type(backend).__name__, **detail)
    return attachment
