"""One shielded wait: finish cleanup that must not be cut short, then end cancelled all the same.

A cancelled tool must still await the work that stops what it started (a sandbox command's
stop, a sandbox's teardown, a sub-agent's hand-over): returning at once would leave that work
running unwatched, its kill record late. And it is cancelled more than once while it waits
(pydantic-ai cancels in-flight tools, the task's scope cancels them too), so one cancel absorbed
is not enough. [`wait_shielded`][] absorbs every cancel for a bounded time, then raises the
first one again, so the caller still ends cancelled.

Attribution, as in pydantic-ai's ``_cancel`` and `asyncio.timeout`: whoever cancels a task
counts it and ``uncancel()``\\ s exactly its own. This wait issues no cancel of its own, so it
uncancels nothing: every cancel it absorbed stays counted in ``Task.cancelling()`` and comes out
as ``CancelledError``, and the one who sent it (an enclosing ``asyncio.timeout``, a task group,
pydantic-ai's run) can still tell its own cancel from anyone else's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from cancellable_agents.core.scope import current_cancellation

__all__ = ["UNSCOPED_BOUND", "wait_shielded"]

log = logging.getLogger(__name__)

#: Longest the wait goes on after a cancel when no task scope (and so no budget) is around.
UNSCOPED_BOUND = 5.0
#: How long the loop's thread sleeps at each cancel absorbed after the first. A canceller that
#: re-delivers at every turn of the loop (anyio's cancel scopes do) spins it, holding the GIL, and
#: the threads doing ``work`` wait for the GIL at every system call: a sandbox stop's sweep of
#: /proc took over 5 s beside such a loop on an idle two-core machine, 0.5 s with this pause.
RESPIN_PAUSE_S = 0.001


async def wait_shielded(work: Awaitable[Any], what: str, *, timeout: float | None = None) -> None:
    """Await ``work`` to its end even if this task is cancelled meanwhile, again and again.

    Bounded: with ``timeout``, that many seconds from now; without, unbounded until the first
    cancel arrives, then the current scope's remaining budget (`UNSCOPED_BOUND` outside
    any scope), since ``work`` bounds itself and only a cancel puts a budget on the caller.
    When the bound passes first, ``work`` is left running (it is never cancelled here: a stop
    cut short would leave the very processes it was stopping) and a warning names ``what``.

    Then, if a cancel was absorbed, the first one is raised again (the caller ends cancelled,
    whatever ``work`` did); else ``work``'s exception, if it failed, propagates. Returns
    ``None`` when ``work`` finished or the ``timeout`` passed without any cancel.
    """
    loop = asyncio.get_running_loop()
    job = asyncio.ensure_future(work)
    absorbed: asyncio.CancelledError | None = None
    deadline = None if timeout is None else loop.time() + timeout
    while not job.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            log.warning("%s did not finish within the budget; left running", what)
            job.add_done_callback(_retrieve)
            break
        try:
            await asyncio.wait({job}, timeout=left)
        except asyncio.CancelledError as exc:
            if absorbed is not None:
                time.sleep(RESPIN_PAUSE_S)  # blocking on purpose: it hands ``work``'s threads the GIL
            absorbed = absorbed or exc
            if deadline is None:
                deadline = loop.time() + _budget()
    if absorbed is not None:
        if job.done():
            _retrieve(job)
        raise absorbed
    if job.done() and not job.cancelled():
        job.result()


def _budget() -> float:
    scope = current_cancellation()
    return scope.remaining() if scope is not None else UNSCOPED_BOUND


def _retrieve(job: asyncio.Future[Any]) -> None:
    """Mark the outcome of work nobody awaits any more as seen (and say how it ended)."""
    if job.cancelled():
        return
    exc = job.exception()
    if exc is not None:
        log.debug("shielded work ended with %r after its caller moved on", exc)
