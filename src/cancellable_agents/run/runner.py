"""Run a pydantic-ai agent under a [`TaskCancellation`][] scope.

pydantic-ai cancels a run when its token fires, but on its own it tears toolsets down before
in-flight tools see ``CancelledError``, and it stops *waiting* for sync tools without stopping
them. This module adds what the scope needs around ``Agent.run_sync`` (and, for sub-agents, around
``await Agent.run``): in-flight tool tasks are cancelled before any toolset teardown, sync tools
run on tracked threads so one that ignores cancellation is named, child runs that are still
tearing down are awaited after the run's own teardown (so nested teardowns overlap instead of
adding up), and the outcome is settled exactly once. Airflow-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.agent import AbstractAgent
from pydantic_ai.exceptions import RunCancelled, RunTimedOut, UnexpectedModelBehavior

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import Outcome, Phase, ResourceHandle, TaskCancellation
from cancellable_agents.durable._pauses import AwaitingApproval
from cancellable_agents.run import _blocking_requests as blocking_requests
from cancellable_agents.run.tool_calls import RunIdentity, run_identity

if TYPE_CHECKING:
    from cancellable_agents.core.wind_down import WindDown, WindDownReport
    from cancellable_agents.durable._journal import Journal
    from cancellable_agents.run._final_request import WindDownState

from cancellable_agents.run._tracker import (
    RunTracker,
    ToolThreadExecutor,
    report_stragglers,
    run_capabilities,
)

log = logging.getLogger(__name__)

#: The wind-down of the run whose tools are executing in this context: a sub-agent started by one
#: of them winds down at the same instant, so it answers its parent before the parent's final
#: request. Tool tasks and sync tools' threads run in copies of the run's context, so they see it.
_active_wind_down: contextvars.ContextVar[WindDownState | None] = contextvars.ContextVar(
    "cancellable_agents_wind_down", default=None
)


@dataclass
class _ScopedRun:
    """What the sync and async runners share: refuse, track, settle a cancel, build the error."""

    scope: TaskCancellation
    tracker: RunTracker
    handle: ResourceHandle
    kwargs: dict[str, Any]

    @classmethod
    def start(
        cls,
        scope: TaskCancellation,
        tracker: RunTracker | None,
        run_kwargs: dict[str, Any],
        identity: RunIdentity | None = None,
    ) -> _ScopedRun:
        """Refuse a cancelled scope (no model request), else register the run's in-flight tools;
        its tool calls' keys derive from ``identity`` (see [`run_identity`][])."""
        if scope.cancelled:
            scope.record("run_refused", reason="cancelled before the run started")
            scope.settle(Outcome.CANCELLED)
            raise scope.cancelled_error("cancelled before the run started; no model request was made")
        if "botocore" in sys.modules:  # a Bedrock model was built: its blocking requests are watched
            blocking_requests.watch_botocore()
        tracker = tracker if tracker is not None else RunTracker(scope)
        tracker.identity = run_identity(identity)
        handle = scope.register(
            tracker.cancel_tool_tasks, name="in-flight tools", phase=Phase.IN_FLIGHT, inline=True
        )
        capabilities = run_capabilities(tracker, list(run_kwargs.pop("capabilities", None) or []))
        scope.record("run_started")
        kwargs = {"cancellation_token": scope.token, "capabilities": capabilities, **run_kwargs}
        return cls(scope, tracker, handle, kwargs)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The scope as [`current_cancellation`][], and sync tools on tracked threads.

        The threads are closed when the run ends, before stragglers are looked for.
        """
        executor = ToolThreadExecutor(self.tracker)
        try:
            with self.scope.activate(), Agent.using_thread_executor(executor):
                yield
        finally:
            executor.close()

    def end(self, exc: BaseException | None, *, wound_down: bool = False) -> bool:
        """Record how the run ended; return whether it ends cancelled (then settled ``CANCELLED``).

        Settling ``COMPLETED`` (or ``FAILED``) is left to the scope's owner (the execute guard, a
        delegation), whose unit of work may hold several runs. A ``wound_down`` run whose model
        kept calling tools it was no longer offered until pydantic-ai gave up
        (``UnexpectedModelBehavior``) has no answer: it ends as the deadline would have ended
        it, cancelled as ``timeout``, only sooner.
        """
        self.handle.unregister()
        scope = self.scope
        if exc is None:
            if not scope.cancelled:
                scope.record("run_completed")
                return False
            scope.record("result_discarded", reason="cancelled before the result was accepted")
            scope.settle(Outcome.CANCELLED)
            return True
        gave_up = wound_down and isinstance(exc, UnexpectedModelBehavior)
        if isinstance(exc, RunTimedOut):
            scope.cancel(CancelCause.TIMEOUT, detail="the run's deadline passed")
        elif gave_up:
            scope.cancel(CancelCause.TIMEOUT, detail=f"wound down, but the model gave no final answer: {exc}")
        elif isinstance(exc, TaskCancelled):
            # A sub-agent's (or a tool's) cancellation escaped as an exception: it cancels this run
            # too, with the same cause, instead of counting as an ordinary failure.
            scope.cancel(exc.cause, detail=f"cancellation raised inside the run: {exc}")
        elif isinstance(exc, asyncio.CancelledError):
            scope.cancel(CancelCause.UNKNOWN, detail="the asyncio task running the agent was cancelled")
        if gave_up or isinstance(exc, (RunCancelled, TaskCancelled, asyncio.CancelledError)):
            scope.record("run_unwound")
            scope.settle(Outcome.CANCELLED)
            return True
        scope.record("run_unwound", error=True)
        return False

    def error(self, exc: BaseException | None, result: Any = None) -> TaskCancelled:
        """The [`TaskCancelled`][] for a run that ended cancelled.

        The transcript and usage come from the run's ``RunCancelled``, from a sub-agent's
        ``TaskCancelled`` that escaped it, or from the discarded result.
        """
        if exc is None:
            return self.scope.cancelled_error(
                "cancelled after the result arrived; the result is discarded", source=result
            )
        source = exc if isinstance(exc, (RunCancelled, TaskCancelled)) else None
        return self.scope.cancelled_error("the run was cancelled", source=source)


def run_agent_in_scope(
    scope: TaskCancellation,
    agent: Agent[Any, Any],
    user_prompt: Any = None,
    *,
    journal: Journal | None = None,
    on_cancelled: Callable[[TaskCancelled], None] | None = None,
    identity: RunIdentity | None = None,
    wind_down: WindDown | None = None,
    on_wound_down: Callable[[WindDownReport], None] | None = None,
    **run_kwargs: Any,
) -> Any:
    """Run ``agent`` synchronously under ``scope`` and return its ``AgentRunResult``.

    Raises [`TaskCancelled`][] if the scope was cancelled before, during or after the run
    (a result that arrives after the cancel does not count), or if the run's own ``timeout=``
    expired (cause ``TIMEOUT``). A cancelled scope never makes a model request. Settling the
    scope as ``COMPLETED`` is left to its owner, whose unit of work may hold several runs.

    ``journal`` (``durable=True``, opened by the caller): attached before the run, appended to
    after each step, and ended here as the run ends (see `_run_journaled`). A journaled
    run whose model calls a tool that requires approval stops there and raises
    [`AwaitingApproval`][cancellable_agents.durable._pauses.AwaitingApproval] instead of returning.
    ``on_cancelled``: called with the [`TaskCancelled`][] before it is raised (an operator
    logs its kill record there), before the journal's end is written. ``identity``: who the run
    is (task instance, run key, try), from which its tool calls' idempotency keys derive
    ([`cancellable_agents.run.tool_calls`][]); a journaled run's transcript may begin in an
    earlier try, which the journal knows.

    ``wind_down`` ([`WindDown`][cancellable_agents.core.wind_down.WindDown]): near the run's deadline
    (its ``timeout=``) or, with ``budget=True``, at its ``usage_limits``, the next request is the
    last, tool-less one, and its answer is the result; ``on_wound_down`` is then called with the
    [`WindDownReport`][cancellable_agents.core.wind_down.WindDownReport] before the result is
    returned. With ``on_wind_down="fail"`` the run instead ends cancelled as ``timeout``, the
    wound-down answer in the error's transcript.
    """
    winding = _WindingDown.start(scope, wind_down, run_kwargs)
    if journal is None:
        try:
            result = _run_scoped(scope, agent, user_prompt, run_kwargs, identity, winding)
        except TaskCancelled as exc:
            if on_cancelled is not None:
                on_cancelled(exc)
            raise
        winding.report_to(on_wound_down)
        return result
    return _run_journaled(
        scope, agent, user_prompt, journal, on_cancelled, run_kwargs, identity, winding, on_wound_down
    )


def _run_journaled(
    scope: TaskCancellation,
    agent: Agent[Any, Any],
    user_prompt: Any,
    journal: Journal,
    on_cancelled: Callable[[TaskCancelled], None] | None,
    run_kwargs: dict[str, Any],
    identity: RunIdentity | None,
    winding: _WindingDown,
    on_wound_down: Callable[[WindDownReport], None] | None,
) -> Any:
    """A durable run, its journal's whole life in order: attach, each step, end.

    All on this (the main) thread, never from a signal handler: the store may be an API call.
    A cancelled run's end is written last, after ``on_cancelled``, because the store may answer
    seconds later and the task is SIGKILLed 5 s after the SIGTERM: the kill record comes first.
    A run that ends asking for approval (output ``DeferredToolRequests``) is recorded as stopped
    there and raises [`AwaitingApproval`][] (so is a record still stopped there, from attach).
    """
    try:
        if not scope.cancelled:  # a cancelled scope makes no request: nothing to take over
            user_prompt, run_kwargs = journal.attach(agent, user_prompt, run_kwargs)
        # The calls of a resumed transcript keep the keys they had in the try it began in.
        identity = (identity or RunIdentity()).durable_run(journal.run_key, journal.origin_try)
        result = _run_scoped(scope, agent, user_prompt, run_kwargs, identity, winding)
    except TaskCancelled as exc:
        journal.cancelled(exc)  # touches no store: its facts into the kill record
        if on_cancelled is not None:
            on_cancelled(exc)
        journal.write_end()
        raise
    except BaseException:
        journal.detach()
        raise
    if isinstance(result.output, DeferredToolRequests):
        raise AwaitingApproval(journal.awaiting_approval(result))
    journal.completed(result, wound_down=winding.report())
    winding.report_to(on_wound_down)
    return result


def _run_scoped(
    scope: TaskCancellation,
    agent: Agent[Any, Any],
    user_prompt: Any,
    run_kwargs: dict[str, Any],
    identity: RunIdentity | None,
    winding: _WindingDown | None = None,
) -> Any:
    """[`run_agent_in_scope`][] without a journal: the run itself."""
    run = _ScopedRun.start(scope, None, run_kwargs, identity)
    try:
        with run.context(), _winding_context(winding):
            result = agent.run_sync(user_prompt, **run.kwargs)
    except BaseException as exc:
        cancelled = run.end(exc, wound_down=winding is not None and winding.report() is not None)
        report_stragglers(scope, run.tracker)
        if cancelled:
            raise run.error(exc) from exc
        raise
    if winding is not None:
        winding.settle(result)
    if run.end(None):
        report_stragglers(scope, run.tracker)
        raise run.error(None, result)
    return result


#: How much of a failed wind-down's answer (``on_wind_down="fail"``) the record's detail keeps; the
#: error's transcript (``TaskCancelled.all_messages()``) has all of it.
PARTIAL_ANSWER_CHARS = 500


@dataclass
class _WindingDown:
    """A run's wind-down, from its options to its report (nothing when ``wind_down`` is off)."""

    scope: TaskCancellation
    state: WindDownState | None = None

    @classmethod
    def start(
        cls, scope: TaskCancellation, options: WindDown | None, run_kwargs: dict[str, Any]
    ) -> _WindingDown:
        """Add the [`WindDownCapability`][] to ``run_kwargs`` when ``options`` wind anything down.

        The deadline is the run's own ``timeout=`` (seconds from now): the wind-down starts
        ``options.seconds`` before it, or at once when less than that is left (work before the
        run, such as an earlier run of the same task, used the window up).
        """
        if options is None or not options.active:
            return cls(scope)
        from cancellable_agents.run._final_request import WindDownCapability, WindDownState

        timeout = run_kwargs.get("timeout")
        now = scope.now()
        deadline_at = now + float(timeout) if timeout is not None else None
        start_at = None
        if options.on_deadline and deadline_at is not None:
            start_at = max(now, deadline_at - float(options.seconds or 0.0))

        def started(report: WindDownReport) -> None:
            scope.record("wind_down_started", **report.as_dict())

        state = WindDownState(options, start_at, deadline_at, scope.now, now, on_start=started)
        run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), WindDownCapability(state)]
        return cls(scope, state)

    @classmethod
    def start_child(cls, scope: TaskCancellation, run_kwargs: dict[str, Any]) -> _WindingDown:
        """A sub-agent's wind-down: its parent's deadline window, from the same instant, so the
        child answers (its best answer is its delegation's result) before its parent's final
        request. The budget stays the parent's own: a child's limits are its run's."""
        parent = _active_wind_down.get()
        if parent is None or parent.start_at is None:
            return cls(scope)
        from dataclasses import replace

        from cancellable_agents.run._final_request import WindDownCapability, WindDownState

        options = replace(parent.options, budget=False, on_wind_down="answer")

        def started(report: WindDownReport) -> None:
            scope.record("wind_down_started", parent=True, **report.as_dict())

        state = WindDownState(
            options, parent.start_at, parent.deadline_at, parent.clock, parent.clock(), on_start=started
        )
        run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), WindDownCapability(state)]
        return cls(scope, state)

    def report(self) -> WindDownReport | None:
        """How the run wound down, or ``None`` if it did not."""
        if self.state is None:
            return None
        with self.state.lock:
            return self.state.report

    def settle(self, result: Any) -> None:
        """The run returned ``result``: record a wind-down's end; with ``on_wind_down="fail"`` cancel
        the scope as ``timeout`` first, so the answer is discarded into the error's transcript and
        its start (``PARTIAL_ANSWER_CHARS``) into the record's detail."""
        report = self.report()
        if report is None or self.state is None:
            return
        self.scope.record("run_wound_down", **report.as_dict())
        if self.state.options.on_wind_down == "fail":
            answer = str(getattr(result, "output", ""))
            if len(answer) > PARTIAL_ANSWER_CHARS:
                answer = answer[:PARTIAL_ANSWER_CHARS] + "..."
            self.scope.cancel(
                CancelCause.TIMEOUT,
                detail=f"{report.summary()}; on_wind_down='fail', the partial answer: {answer!r}",
            )

    def report_to(self, on_wound_down: Callable[[WindDownReport], None] | None) -> None:
        """Hand a completed run's wind-down report to its owner (the log line, the metrics)."""
        report = self.report()
        if report is not None and on_wound_down is not None:
            on_wound_down(report)


@contextlib.contextmanager
def _winding_context(winding: _WindingDown | None) -> Iterator[None]:
    """The run's wind-down as the one its tools' sub-agents follow (``_active_wind_down``)."""
    if winding is None or winding.state is None:
        yield
        return
    token = _active_wind_down.set(winding.state)
    try:
        yield
    finally:
        _active_wind_down.reset(token)


async def run_agent_in_scope_async(
    scope: TaskCancellation,
    agent: AbstractAgent[Any, Any],
    user_prompt: Any = None,
    *,
    tracker: RunTracker | None = None,
    **run_kwargs: Any,
) -> Any:
    """``await agent.run(...)`` under ``scope``; the async counterpart of [`run_agent_in_scope`][].

    Same contract: refuses a cancelled scope, raises [`TaskCancelled`][] with the partial
    transcript and usage, leaves settling ``COMPLETED`` to the scope's owner. Used for
    sub-agents, which run on their parent's event loop or on a loop of their own in a thread.
    ``tracker`` (optional) lets the caller watch the run's ``in_flight_stopped``. An external
    ``CancelledError`` propagates as itself (after the scope was cancelled and settled), never
    as a result. Blocking waits (straggler grace, an undecided cause) run off the event loop.
    Started by a tool of a run that winds down before its deadline, the run winds down at the
    same instant (``_WindingDown.start_child``): its answer reaches the parent before the
    parent's own final request.
    """
    winding = _WindingDown.start_child(scope, run_kwargs)
    run = _ScopedRun.start(scope, tracker, run_kwargs)
    try:
        with run.context(), _winding_context(winding):
            result = await agent.run(user_prompt, **run.kwargs)
    except BaseException as exc:
        cancelled = run.end(exc, wound_down=winding.report() is not None)
        await _off_loop(report_stragglers, scope, run.tracker, needed=_may_join_threads(scope, run))
        if cancelled and not isinstance(exc, asyncio.CancelledError):
            raise await _off_loop(run.error, exc, needed=scope.cause is None) from exc
        raise
    winding.settle(result)
    if run.end(None):
        await _off_loop(report_stragglers, scope, run.tracker, needed=_may_join_threads(scope, run))
        raise await _off_loop(run.error, None, result, needed=scope.cause is None)
    return result


def _may_join_threads(scope: TaskCancellation, run: _ScopedRun) -> bool:
    """Whether `report_stragglers` may block: only a cancelled run's live tool threads wait."""
    return scope.cancelled and bool(run.tracker.live_threads())


async def _off_loop(fn: Callable[..., Any], *args: Any, needed: bool) -> Any:
    """Call ``fn`` on a worker thread when it may block (``needed``), else inline."""
    if needed:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
