"""How a cancelled scope releases what was registered with it: in phases, concurrently, in budget.

``Phase.IN_FLIGHT`` resources (running commands, child runs, requests) are all released at once
and waited for before any ``Phase.SERVERS`` resource (MCP stdio servers, closed once the calls
they serve ended), and those before any ``Phase.TEARDOWN`` resource (toolsets, clients, working
directories, the descendant reaper), so nothing is torn down under work that is still running.
Each release runs on a daemon thread of its own; one that does not return within the scope's
remaining budget is named as a straggler and left behind, so a stuck cleanup can never hold
the unwind past the budget. The provider's own cleanups that return within the budget by
themselves (``inline``) run on the unwinding thread instead: on a machine whose every core is
busy (an eviction storm), each thread started and joined costs two waits for a CPU, tens of
milliseconds each.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DEFAULT_BUDGET", "Cleanup", "Phase", "Resource"]


class ReleasingScope(Protocol):
    """What releasing needs of the scope it releases for (``TaskCancellation`` is one): its
    clock and remaining budget, and where to record what happened."""

    name: str

    def now(self) -> float: ...

    def remaining(self) -> float: ...

    def record(self, event: str, **detail: Any) -> Any: ...

    def note_straggler(self, name: str, thread: threading.Thread | None = None) -> None: ...


#: Airflow gives a killed task 5 s before SIGKILL; keep a margin for logging and exit.
DEFAULT_BUDGET = 4.0

log = logging.getLogger(__name__)

Cleanup = Callable[[], Any] | Callable[[], Awaitable[Any]]


class Phase(enum.IntEnum):
    """When a registered resource is released during an unwind. Lower phases go first."""

    IN_FLIGHT = 0
    """Work that is running: commands, child runs, requests. Stopped before any teardown."""
    SERVERS = 1
    """Processes the in-flight work ran in and that must first hear it was cancelled (MCP stdio
    servers): closed the protocol's way once that work stopped, before any teardown (the
    descendant reaper) kills what is left."""
    TEARDOWN = 2
    """Things that hold in-flight work: toolsets, clients, working directories."""


@dataclass
class Resource:
    """One registered cleanup. ``loop``: the event loop it was registered from (async cleanups
    run there), if any. ``inline``: the cleanup returns within the scope's budget by itself, so
    it needs no thread of its own to be left behind on."""

    name: str
    cleanup: Cleanup
    phase: Phase
    loop: asyncio.AbstractEventLoop | None
    inline: bool = False
    released: bool = False  # guarded by the owning scope's _lock; claimed once


def release_phases(scope: ReleasingScope, resources: Iterable[Resource]) -> None:
    """Release ``resources`` phase by phase; within a phase concurrently, never past the budget."""
    pending = list(resources)
    for phase in Phase:
        release_together(scope, [r for r in pending if r.phase is phase])


def release_together(scope: ReleasingScope, resources: list[Resource]) -> None:
    """Release ``resources`` concurrently and wait for them until the scope's budget runs out;
    the ``inline`` ones on this thread, while the others run on threads of their own."""
    workers = []
    for resource in (r for r in resources if not r.inline):
        worker = threading.Thread(
            target=_release_one, args=(scope, resource), name=f"release-{resource.name}", daemon=True
        )
        worker.start()
        workers.append((resource, worker))
    for resource in (r for r in resources if r.inline):
        _release_one(scope, resource)
    for resource, worker in workers:
        worker.join(scope.remaining())
        if worker.is_alive():
            scope.note_straggler(f"resource {resource.name!r}", worker)


def _release_one(scope: ReleasingScope, resource: Resource) -> None:
    started = scope.now()
    try:
        result = resource.cleanup()
        if inspect.isawaitable(result):
            _await(result, resource.loop, scope.remaining())
    except Exception as exc:
        scope.record("release_failed", resource=resource.name, error=repr(exc))
        log.warning("%s: releasing %s failed: %r", scope.name, resource.name, exc)
        return
    scope.record("released", resource=resource.name, took_ms=round((scope.now() - started) * 1000, 1))


def _await(awaitable: Awaitable[Any], loop: asyncio.AbstractEventLoop | None, timeout: float) -> None:
    """Run an async cleanup on the loop it came from (still running), else on a loop of its own."""

    async def run() -> Any:
        return await awaitable

    if loop is not None and loop.is_running():
        asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)
    else:
        asyncio.run(run())
