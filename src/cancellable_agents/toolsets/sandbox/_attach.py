"""Tie any [`Sandbox`][] backend to a task's cancellation scope: the one way a scope reaches one.

[`attach_sandbox`][] registers two resources on the scope: the backend's in-flight commands are
stopped in ``Phase.IN_FLIGHT`` (before any teardown), the backend is destroyed in
``Phase.TEARDOWN``. A backend is attached to a scope once: asking again returns the same
attachment, and each [`SandboxAttachment.detach`][] releases one ask, so the toolset letting go
of a backend does not untie it from a scope its owner tied it to.

[`SandboxAttachment.start`][] is the race-free way to start a command, and the only start-race
guard: it refuses after a cancel, counts itself as *starting* while the backend starts the command,
and a cancel that lands during that call waits (within the budget) for the id and stops it. A
backend whose own ``start`` must be guarded too
([`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox]) starts through
its attachment and gives the attachment its unguarded start ([`ScopedSandbox`][]). Kills are
recorded per command id, with no assumption of a local pid, unless the backend declares it writes
them itself
([`SandboxCapabilities`][cancellable_agents.toolsets.sandbox.protocol.SandboxCapabilities]). Who
destroys a backend, on a kill and without one, is stated once, in
[`protocol`][cancellable_agents.toolsets.sandbox.protocol].
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from cancellable_agents.core.scope import Phase, ResourceHandle, TaskCancellation
from cancellable_agents.core.timeline import KillRecord
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    Sandbox,
    ScopedSandbox,
    command_env,
    require_sandbox,
)

__all__ = ["SandboxAttachment", "attach_sandbox", "attachment_of"]

log = logging.getLogger(__name__)

#: Budget kept back, when waiting for a racing ``start``, for stopping what it started.
START_RESERVE = 0.5

_attached_lock = threading.Lock()
#: (backend, scope) ids -> their live attachment, which keeps both alive (the ids stay theirs).
_attached: weakref.WeakValueDictionary[tuple[int, int], SandboxAttachment] = weakref.WeakValueDictionary()


class SandboxAttachment:
    """One backend attached to one scope (see [`attach_sandbox`][]). Thread-safe."""

    def __init__(self, backend: Sandbox, scope: TaskCancellation, name: str) -> None:
        self.backend = backend
        self.scope = scope
        self.name = name
        capabilities = backend.capabilities
        # The attachment writes the kill records unless the backend does; it keeps the ids it
        # started (to stop each on a kill) where it records them or ``stop_all`` is not enough.
        self._records = not capabilities.records_kills
        self._tracks = self._records or not capabilities.stops_all_at_once
        # A backend whose own start comes here is started without it (or it would come back).
        self._launch = backend.launch if isinstance(backend, ScopedSandbox) else backend.start
        self._cond = threading.Condition()
        self._starting = 0  # guarded by _cond: calls inside the backend's start right now
        self._stopping = 0  # guarded by _cond: stops whose kill record is not written yet
        # guarded by _cond: id -> command text, until waited (only to write this one's records)
        self._running: dict[str, str] = {}
        self._holds = 1  # guarded by _attached_lock: attach_sandbox calls not yet detached
        self._handles: list[ResourceHandle] = []

    # -- the command path ----------------------------------------------------------------

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """The backend's start made safe against a cancel: raises ``TaskCancelled`` if the scope
        was cancelled before, and stops the new command (then raises) if it was cancelled during.
        ``env`` is checked ([`command_env`][]) and passed to the backend's start."""
        self.scope.raise_if_cancelled()
        variables = command_env(env)
        text = command if isinstance(command, str) else " ".join(command)
        with self._cond:
            self._starting += 1
        try:
            command_id = self._launch(command, timeout=timeout, stdin=stdin, env=variables)
            if self._tracks:
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
        with _attached_lock:
            self._holds = 0
            self._forget()
        self.backend.destroy()

    def detach(self) -> None:
        """Release one [`attach_sandbox`][] call; the last one unregisters from the scope
        without stopping anything (whoever owns the backend destroys it). Idempotent past zero."""
        with _attached_lock:
            self._holds = max(0, self._holds - 1)
            if self._holds == 0:
                self._forget()

    def _forget(self) -> None:
        """Untie from the scope (the caller holds ``_attached_lock``): a later attach makes anew."""
        if _attached.get(_key(self.backend, self.scope)) is self:
            del _attached[_key(self.backend, self.scope)]
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


def attachment_of(backend: Sandbox) -> SandboxAttachment | None:
    """``backend``'s live attachment (the first made, if it is attached to several scopes), or
    ``None``: where a backend that writes its own kill records
    ([`SandboxCapabilities.records_kills`][cancellable_agents.toolsets.sandbox.protocol.SandboxCapabilities])
    finds the scope to write them on, whoever attached it."""
    with _attached_lock:
        for (backend_id, _), attachment in list(_attached.items()):
            if backend_id == id(backend) and attachment.backend is backend:
                return attachment
    return None


def _key(backend: Sandbox, scope: TaskCancellation) -> tuple[int, int]:
    return id(backend), id(scope)


def attach_sandbox(
    backend: Sandbox, scope: TaskCancellation, *, name: str | None = None, **detail: Any
) -> SandboxAttachment:
    """Attach ``backend`` to ``scope``: on a cancel its commands are stopped first
    (``Phase.IN_FLIGHT``), then it is destroyed (``Phase.TEARDOWN``), inside the scope's budget.

    Start commands through the returned attachment's ``start`` (race-free against the cancel).
    A backend already attached to ``scope`` gets the same attachment back (its first ``name`` and
    ``detail`` stay); each call is released by one [`detach`][SandboxAttachment.detach]. Attaching
    after the scope was cancelled stops and destroys at once. ``detail`` goes into the
    timeline's ``sandbox_attached`` event.
    """
    require_sandbox(backend)
    label = name or f"{type(backend).__name__}@{id(backend):x}"
    with _attached_lock:
        attachment = _attached.get(_key(backend, scope))
        if attachment is not None:
            attachment._holds += 1
            return attachment
        attachment = SandboxAttachment(backend, scope, label)
        _attached[_key(backend, scope)] = attachment
        # Registered under the lock: a detach racing this call finds the handles to unregister.
        attachment._handles = [
            scope.register(
                attachment.stop_in_flight, name=f"sandbox {label} commands", phase=Phase.IN_FLIGHT
            ),
            scope.register(attachment.destroy, name=f"sandbox {label}", phase=Phase.TEARDOWN),
        ]
    scope.record("sandbox_attached", sandbox=label, backend=type(backend).__name__, **detail)
    return attachment
