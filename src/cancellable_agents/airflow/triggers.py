"""Triggers for deferred tool calls ([`cancellable_agents.airflow.deferral`][]).

- [`PollTrigger`][]: the common case. A tool started outside work (a Spark or dbt job, a
  batch inference, a review elsewhere); the trigger polls a status callable until it says done,
  and a user's *Mark failed* / *Clear* of the deferred task runs the optional cancel callable
  (from ``on_kill``, Airflow 3.3+), which a triggerer restart does not (``cleanup`` is not
  ``on_kill``).
- [`DeferredCallsTrigger`][]: what the task defers to. It runs the trigger of every call a
  model response deferred, at once, and fires once all have: one event whose payload holds each
  call's result by tool call id. Its ``on_kill`` and ``cleanup`` reach every call's trigger.

Both are importable by the triggerer (this module imports Airflow, pydantic-ai does not load).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

__all__ = ["DeferredCallsTrigger", "PollTrigger"]

log = logging.getLogger(__name__)


def import_callable(path: str) -> Callable[..., Any]:
    """``module.attr`` (or ``module:attr``) as the object it names."""
    module, _, name = path.replace(":", ".").rpartition(".")
    found = getattr(importlib.import_module(module), name)
    if not callable(found):
        raise TypeError(f"{path} is not callable")
    return found  # type: ignore[no-any-return]


async def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` off the triggerer's event loop unless it is a coroutine function."""
    if inspect.iscoroutinefunction(fn):
        return await fn(**kwargs)
    return await asyncio.to_thread(fn, **kwargs)


#: Stops that outlived the ``on_kill`` that started them (the loop holds tasks only weakly).
_stopping: set[asyncio.Future[Any]] = set()


async def _to_its_end(stop: Awaitable[Any]) -> None:
    """Await ``stop`` such that cancelling the awaiting ``on_kill`` does not cut it off.

    Airflow 3.3's triggerer cancels a trigger the user stopped again on every loop (~1 s) until
    the trigger has ended, ``on_kill`` included, and swallows that cancel: a stop slower than a
    loop (a remote cancel call; a thread that did not start in time on a loaded machine) was cut
    off and the outside work went on. Here the stop goes on to its end in the background.
    """
    task = asyncio.ensure_future(stop)
    _stopping.add(task)
    task.add_done_callback(_stopping.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            log.info("on_kill was cancelled again; stopping the outside work goes on to its end")
            task.add_done_callback(_log_failed_stop)
        raise


def _log_failed_stop(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("stopping the outside work failed: %r", error)


class PollTrigger(BaseTrigger):
    """Fire when outside work is done: call ``status(**kwargs)`` every ``interval`` seconds; it
    returns ``None`` while the work runs, and what it returns then (JSON) is the event's payload,
    which becomes the deferred tool call's result.

    :param status: import path of the status callable (``"my_pkg.jobs.job_status"``), sync (run
        on a thread) or ``async``; it raising ends the wait with that error (the task fails).
    :param kwargs: JSON keyword arguments for ``status`` and ``cancel`` (the job's id).
    :param interval: seconds between polls.
    :param cancel: import path of a callable that stops the outside work, called with ``kwargs``
        from ``on_kill`` (a user marked the deferred task failed or cleared it; Airflow 3.3+).
    """

    def __init__(
        self,
        status: str,
        kwargs: dict[str, Any] | None = None,
        interval: float = 5.0,
        cancel: str | None = None,
    ) -> None:
        super().__init__()
        self.status, self.kwargs, self.interval, self.cancel = (
            status,
            dict(kwargs or {}),
            float(interval),
            cancel,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"status": self.status, "kwargs": self.kwargs, "interval": self.interval, "cancel": self.cancel},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        status = import_callable(self.status)
        while True:
            result = await _call(status, self.kwargs)
            if result is not None:
                yield TriggerEvent(result)
                return
            await asyncio.sleep(self.interval)

    async def on_kill(self) -> None:
        if self.cancel is None:
            return
        log.info("stopping the outside work: %s(%s)", self.cancel, self.kwargs)
        await _to_its_end(_call(import_callable(self.cancel), self.kwargs))


class DeferredCallsTrigger(BaseTrigger):
    """Wait for every deferred call of one model response; fire once with all their results.

    :param run_key: which agent run of the task paused (its order in ``execute``).
    :param calls: per call ``{"tool_call_id", "tool", "classpath", "kwargs", "timeout_s",
        "on_timeout"}``: its trigger, how long it may wait (``None``: no limit), and what then. A
        call whose wait times out has its trigger's ``on_kill`` run (the outside work is stopped);
        with ``on_timeout="tell"`` it gets [`timed_out`][] as its result (the model is told, as an
        approval nobody answered in time is rejected); with ``"fail"`` the other calls' work is
        stopped too and the event fires at once naming it (``failed``): the task ends as timeout.
    :param deferred_at: when the task deferred (``time.time()``), so the resumed task can say how
        long the wait held no worker slot.
    """

    def __init__(self, run_key: str, calls: list[dict[str, Any]], deferred_at: float) -> None:
        super().__init__()
        self.run_key, self.calls, self.deferred_at = run_key, [dict(c) for c in calls], float(deferred_at)
        self._waiting: dict[str, BaseTrigger] = {}
        self._waits: dict[str, asyncio.Future[Any]] = {}
        self._fired = False
        self._timed_out: list[str] = []
        self._failed: dict[str, Any] | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"run_key": self.run_key, "calls": self.calls, "deferred_at": self.deferred_at},
        )

    def _triggers(self) -> dict[str, BaseTrigger]:
        if not self._waiting:
            self._waiting = {
                c["tool_call_id"]: import_callable(c["classpath"])(**(c.get("kwargs") or {}))
                for c in self.calls
            }
        return self._waiting

    async def run(self) -> AsyncIterator[TriggerEvent]:
        triggers = self._triggers()
        calls = {c["tool_call_id"]: c for c in self.calls}
        self._waits = {c: asyncio.ensure_future(self._wait(calls[c], t)) for c, t in triggers.items()}
        try:
            await asyncio.wait(self._waits.values(), return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for waiting in self._waits.values():
                waiting.cancel()  # a user's cancel, a failure: nothing goes on polling
        self._fired = True  # all fired or stopped: nothing left for on_kill to stop
        outcomes = {c: _outcome(w) for c, w in self._waits.items()}
        if self._failed is None:
            for outcome in outcomes.values():
                if isinstance(outcome, BaseException):
                    raise outcome
        # A failing timeout cancelled the other waits: they have no result.
        results = {c: o for c, o in outcomes.items() if not isinstance(o, BaseException)}
        yield TriggerEvent(
            {
                "run_key": self.run_key,
                "results": results,
                "timed_out": sorted(self._timed_out),
                "failed": self._failed,
                "deferred_at": self.deferred_at,
                "fired_at": time.time(),
            }
        )

    async def _wait(self, call: dict[str, Any], trigger: BaseTrigger) -> Any:
        """``trigger``'s first payload, or [`timed_out`][] once the call's ``timeout_s`` passed
        since the task deferred (counted from ``deferred_at``, so a triggerer restart does not
        restart the clock), its outside work stopped first."""
        call_id, timeout_s = call["tool_call_id"], call.get("timeout_s")
        if timeout_s is None:
            return await _first_event(trigger)
        remaining = self.deferred_at + timeout_s - time.time()
        try:
            return await asyncio.wait_for(_first_event(trigger), max(remaining, 0.0))
        except TimeoutError:
            log.warning("a deferred call waited %.0f s, its timeout: stopping its outside work", timeout_s)
            await _each({call_id: trigger}, "on_kill")
            self._timed_out.append(call_id)
            if call.get("on_timeout") == "fail" and self._failed is None:
                await self._end_every_wait(call)
            return timed_out(timeout_s)

    async def _end_every_wait(self, call: dict[str, Any]) -> None:
        """A call timed out whose timeout ends the task: stop the other calls' waits and work."""
        self._failed = {k: call.get(k) for k in ("tool_call_id", "tool", "timeout_s")}
        others = {
            c: t for c, t in self._waiting.items() if c != call["tool_call_id"] and not self._waits[c].done()
        }
        for call_id in others:
            self._waits[call_id].cancel()
        await _each(others, "on_kill")

    async def on_kill(self) -> None:
        """A user stopped the deferred task: stop every call's outside work still waited on."""
        if not self._fired:
            await _to_its_end(_each(self._triggers(), "on_kill"))

    async def cleanup(self) -> None:
        await _each(self._waiting, "cleanup")


def _outcome(waiting: asyncio.Future[Any]) -> Any:
    """A finished wait's result, or what ended it (its exception, or ``CancelledError``)."""
    if waiting.cancelled():
        return asyncio.CancelledError()
    return waiting.exception() or waiting.result()


def timed_out(timeout_s: float) -> dict[str, str]:
    """The result a deferred call gets when its wait timed out (what the model reads)."""
    return {"error": f"the outside work did not finish within its timeout of {timeout_s:g} s and was stopped"}


async def _first_event(trigger: BaseTrigger) -> Any:
    """The payload of ``trigger``'s first event (its run ends there)."""
    runner = trigger.run()
    try:
        async for event in runner:
            return event.payload
    finally:
        with contextlib.suppress(Exception):
            await runner.aclose()  # type: ignore[attr-defined]
    raise RuntimeError(f"{type(trigger).__name__} ended without an event")


async def _each(triggers: dict[str, BaseTrigger], method: str) -> None:
    """Call ``method`` of every trigger at once; one failing is logged, the others still run."""
    hooks = [getattr(t, method, None) for t in triggers.values()]
    outcomes = await asyncio.gather(*(h() for h in hooks if h is not None), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            log.warning("a deferred call's trigger failed in %s: %r", method, outcome)
