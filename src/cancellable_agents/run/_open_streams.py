"""A cancelled model stream closed down to its connection, also where the SDK leaves part of it open.

pydantic-ai closes a streamed response on a cancel by closing the SDK's outermost async iterator
(``StreamedResponse.close_stream``). An SDK whose stream is a chain of async generators (google-genai:
its response generator iterates the HTTP response's, which iterates httpx's or aiohttp's) is only
closed as far as the first link: Python does not close the generator an ``async for`` was iterating
when the loop is left by an exception, so when the kill lands between two chunks (the inner
generators suspended at a ``yield``, not in a read), the HTTP response is never released and the
request stays open until the task process exits (measured: Gemini and Vertex AI, about 1 kill in
20 in a loop, and 2 of 2 in the first per-provider measurement).

[`ClosingModel`][] wraps the model that serves each request of a run (pydantic-ai's
``get_wrapper_model`` capability hook): around a streamed request it notes every async generator
first iterated inside it (the event loop's ``firstiter`` hook, chained with asyncio's own, is told
by a context variable which request it belongs to); when the request ends with its scope cancelled,
the generators still suspended are closed, innermost first, on the run's loop, so their ``finally``
releases the HTTP response and the server sees the request closed. The timeline shows
``model_streams_closed`` (how many generators were left open). Airflow-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import weakref
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai.models import Model
from pydantic_ai.models.wrapper import WrapperModel

from cancellable_agents.core.scope import TaskCancellation

#: The generators first iterated inside the streamed request this context is part of.
_started_in: contextvars.ContextVar[list[weakref.ref[Any]] | None] = contextvars.ContextVar(
    "cancellable_agents_stream_generators", default=None
)
#: Marks our ``firstiter`` hook, so it is chained once per loop run.
_HOOKED = "_cancellable_agents_stream_hook"
#: Longest one left-open generator may take to close (its ``finally`` releases a response).
CLOSE_TIMEOUT = 0.5


def _note_generators() -> None:
    """Chain a ``firstiter`` hook that notes generators for `_started_in` (idempotent per loop
    run: asyncio installs its own hooks when a loop starts and restores the old ones when it stops)."""
    hooks = sys.get_asyncgen_hooks()
    if getattr(hooks.firstiter, _HOOKED, False):
        return
    inner = hooks.firstiter

    def firstiter(generator: Any) -> None:
        started = _started_in.get()
        if started is not None:
            started.append(weakref.ref(generator))
        if inner is not None:
            inner(generator)

    setattr(firstiter, _HOOKED, True)
    sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=hooks.finalizer)


class ClosingModel(WrapperModel):
    """``wrapped`` whose streamed requests, when their scope is cancelled, are closed to the
    connection: generators the SDK left suspended are closed as the request ends."""

    def __init__(self, wrapped: Model, scope: TaskCancellation) -> None:
        super().__init__(wrapped)
        self.scope = scope

    @contextlib.asynccontextmanager
    async def request_stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        _note_generators()
        started: list[weakref.ref[Any]] = []
        token = _started_in.set(started)
        try:
            async with self.wrapped.request_stream(*args, **kwargs) as response:
                yield response
        finally:
            with contextlib.suppress(ValueError):  # exited in another context than entered
                _started_in.reset(token)
            if self.scope.cancelled:
                await close_left_open(started, self.scope)


async def close_left_open(started: list[weakref.ref[Any]], scope: TaskCancellation) -> int:
    """Close the generators of ``started`` that are still suspended, the last started (the
    innermost) first; record how many on the scope's timeline and return it."""
    left = [g for g in (ref() for ref in reversed(started)) if g is not None and _suspended(g)]
    for generator in left:
        with contextlib.suppress(Exception):  # what a generator raises while closing is its own
            await asyncio.wait_for(
                generator.aclose(), timeout=max(0.0, min(CLOSE_TIMEOUT, scope.remaining()))
            )
    if left:
        scope.record("model_streams_closed", generators=len(left))
    return len(left)


def _suspended(generator: Any) -> bool:
    """Started, not finished, and not running (an ``aclose`` of a running one would raise)."""
    return generator.ag_frame is not None and not generator.ag_running
