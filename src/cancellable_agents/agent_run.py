"""Run a pydantic-ai agent under a :class:`TaskCancellation` scope.

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
import concurrent.futures
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.agent import AbstractAgent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import RunCancelled, RunTimedOut
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset

from cancellable_agents.cancellation import Outcome, Phase, ResourceHandle, TaskCancellation
from cancellable_agents.causes import CancelCause
from cancellable_agents.exceptions import TaskCancelled

log = logging.getLogger(__name__)

_tool_name: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cancellable_agents_tool", default=None
)
_tool_tracker: contextvars.ContextVar[RunTracker | None] = contextvars.ContextVar(
    "cancellable_agents_tool_tracker", default=None
)


def current_run_tracker() -> RunTracker | None:
    """The tracker of the run whose tool is executing in this context (``None`` outside a tool).

    Lets a tool hand work that outlives it (a cancelled sub-agent still tearing down) to its run,
    which awaits that work after its own teardown, within the budget.
    """
    return _tool_tracker.get()


@dataclass
class _ToolThread:
    tool: str
    thread: threading.Thread
    future: concurrent.futures.Future[Any]


@dataclass
class RunTracker:
    """What one run has in flight: async tool tasks and the threads running sync tools."""

    scope: TaskCancellation
    tool_tasks: dict[asyncio.Task[Any], asyncio.AbstractEventLoop] = field(default_factory=dict)
    tool_threads: list[_ToolThread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    model_requests: dict[asyncio.Task[Any], asyncio.Event] = field(default_factory=dict)
    lingering: set[asyncio.Task[Any]] = field(default_factory=set)
    in_flight_stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (on the run's loop) once a cancelled run's in-flight tools were drained, before teardown."""
    _cancelled: set[asyncio.Task[Any]] = field(default_factory=set)

    def cancel_tool_tasks(self) -> None:
        """Deliver ``CancelledError`` to every in-flight async tool, once (thread-safe).

        Once only: a second cancel would interrupt the tool's own cleanup in its ``except``.
        """
        with self.lock:
            tasks = [(t, loop) for t, loop in self.tool_tasks.items() if t not in self._cancelled]
            self._cancelled.update(t for t, _ in tasks)
        for task, loop in tasks:
            if not task.done():
                loop.call_soon_threadsafe(task.cancel)

    async def drain_tool_tasks(self) -> None:
        """Wait (within the budget) for cancelled tool tasks to finish their own cleanup."""
        with self.lock:
            tasks = [t for t in self.tool_tasks if not t.done() and t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.scope.remaining())

    async def stop_model_requests(self) -> None:
        """Cancel model requests still in flight and wait (within the budget) until they ended.

        pydantic-ai cancels a non-streaming request's task only after the toolsets tore down
        (measured); doing it here keeps the order "work stops, then teardown", also for a
        sub-agent whose parent waits for its in-flight work to stop.
        """
        current = asyncio.current_task()
        with self.lock:
            pending = [(t, ended) for t, ended in self.model_requests.items() if t is not current]
        if not pending:
            return
        for task, _ in pending:
            if not task.done():
                task.cancel()
        waiters = [asyncio.ensure_future(ended.wait()) for _, ended in pending]
        try:
            await asyncio.wait(waiters, timeout=self.scope.remaining())
        finally:
            for waiter in waiters:
                waiter.cancel()

    def linger(self, task: asyncio.Task[Any]) -> None:
        """Make this run's teardown also await ``task`` (a cancelled child run still unwinding).

        The child's in-flight work has stopped; its own teardown then overlaps this run's
        teardown instead of delaying it.
        """
        with self.lock:
            self.lingering.add(task)
        task.add_done_callback(self._forget_lingering)

    def _forget_lingering(self, task: asyncio.Task[Any]) -> None:
        with self.lock:
            self.lingering.discard(task)

    async def drain_lingering(self) -> None:
        """Wait (within the budget) for lingering child runs to finish their teardown."""
        with self.lock:
            tasks = [t for t in self.lingering if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.scope.remaining())

    def running_threads(self) -> list[_ToolThread]:
        with self.lock:
            return [t for t in self.tool_threads if not t.future.done()]


class ToolThreadExecutor(concurrent.futures.Executor):
    """Runs each sync tool call on its own daemon thread, so the call can be tracked by name.

    A daemon thread (rather than a pool) means a tool that ignores cancellation can never keep
    the task process alive; it is reported as a straggler instead.
    """

    def __init__(self, tracker: RunTracker) -> None:
        self._tracker = tracker

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        # pydantic-ai submits ``context.run`` of the tool's copied context; read the tool name from it.
        ctx = getattr(fn, "__self__", None)
        tool = ctx.get(_tool_name, None) if isinstance(ctx, contextvars.Context) else None

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        thread = threading.Thread(target=work, name=f"tool-{tool or 'sync'}", daemon=True)
        with self._tracker.lock:
            self._tracker.tool_threads.append(_ToolThread(tool or "sync tool", thread, future))
        thread.start()
        return future


@dataclass
class _OrderedTeardownToolset(WrapperToolset[Any]):
    """Cancels and drains in-flight tools before the wrapped toolset's ``__aexit__``."""

    tracker: RunTracker = field(default=None)  # type: ignore[assignment]

    async def __aexit__(self, *args: Any) -> bool | None:
        if self.tracker.scope.cancelled:
            self.tracker.cancel_tool_tasks()
            await self.tracker.stop_model_requests()
            await self.tracker.drain_tool_tasks()
            self.tracker.in_flight_stopped.set()
            self.tracker.scope.record("toolset_teardown", toolset=self.wrapped.label)
        try:
            return await super().__aexit__(*args)
        finally:
            await self.tracker.drain_lingering()


class CancellationCapability(AbstractCapability[Any]):
    """Per-run capability: tracks tool calls and model requests, orders teardown after them."""

    def __init__(self, tracker: RunTracker) -> None:
        self._tracker = tracker

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _OrderedTeardownToolset(toolset, tracker=self._tracker)

    async def wrap_model_request(self, ctx: RunContext[Any], *, request_context: Any, handler: Any) -> Any:
        # Remember which task awaits the request, so a cancelled run can stop it before teardown.
        task = asyncio.current_task()
        ended = asyncio.Event()
        if task is not None:
            with self._tracker.lock:
                self._tracker.model_requests[task] = ended
        try:
            return await handler(request_context)
        finally:
            ended.set()
            if task is not None:
                with self._tracker.lock:
                    self._tracker.model_requests.pop(task, None)

    async def wrap_tool_execute(
        self, ctx: RunContext[Any], *, call: Any, tool_def: Any, args: Any, handler: Any
    ) -> Any:
        task = asyncio.current_task()
        token = _tool_name.set(tool_def.name)
        tracker_token = _tool_tracker.set(self._tracker)
        if task is not None:
            with self._tracker.lock:
                self._tracker.tool_tasks[task] = asyncio.get_running_loop()
        try:
            return await handler(args)
        finally:
            _tool_tracker.reset(tracker_token)
            _tool_name.reset(token)
            if task is not None:
                with self._tracker.lock:
                    self._tracker.tool_tasks.pop(task, None)


@dataclass
class _ScopedRun:
    """What the sync and async runners share: refuse, track, settle a cancel, build the error."""

    scope: TaskCancellation
    tracker: RunTracker
    handle: ResourceHandle
    kwargs: dict[str, Any]

    @classmethod
    def start(
        cls, scope: TaskCancellation, tracker: RunTracker | None, run_kwargs: dict[str, Any]
    ) -> _ScopedRun:
        """Refuse a cancelled scope (no model request), else register the run's in-flight tools."""
        if scope.cancelled:
            scope.record("run_refused", reason="cancelled before the run started")
            scope.settle(Outcome.CANCELLED)
            raise _cancelled(scope, None, "cancelled before the run started; no model request was made")
        tracker = tracker if tracker is not None else RunTracker(scope)
        handle = scope.register(tracker.cancel_tool_tasks, name="in-flight tools", phase=Phase.IN_FLIGHT)
        capabilities = [CancellationCapability(tracker), *(run_kwargs.pop("capabilities", None) or [])]
        scope.record("run_started")
        kwargs = {"cancellation_token": scope.token, "capabilities": capabilities, **run_kwargs}
        return cls(scope, tracker, handle, kwargs)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The scope as :func:`current_cancellation`, and sync tools on tracked threads."""
        with self.scope.activate(), Agent.using_thread_executor(ToolThreadExecutor(self.tracker)):
            yield

    def end(self, exc: BaseException | None) -> bool:
        """Record how the run ended; return whether it ends cancelled (then settled ``CANCELLED``).

        Settling ``COMPLETED`` (or ``FAILED``) is left to the scope's owner (the execute guard, a
        delegation), whose unit of work may hold several runs.
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
        if isinstance(exc, RunTimedOut):
            scope.cancel(CancelCause.TIMEOUT, detail="the run's deadline passed")
        elif isinstance(exc, TaskCancelled):
            # A sub-agent's (or a tool's) cancellation escaped as an exception: it cancels this run
            # too, with the same cause, instead of counting as an ordinary failure.
            scope.cancel(exc.cause, detail=f"cancellation raised inside the run: {exc}")
        elif isinstance(exc, asyncio.CancelledError):
            scope.cancel(CancelCause.UNKNOWN, detail="the asyncio task running the agent was cancelled")
        if isinstance(exc, (RunCancelled, TaskCancelled, asyncio.CancelledError)):
            scope.record("run_unwound")
            scope.settle(Outcome.CANCELLED)
            return True
        scope.record("run_unwound", error=True)
        return False

    def error(self, exc: BaseException | None, result: Any = None) -> TaskCancelled:
        """The :class:`TaskCancelled` for a run that ended cancelled."""
        if exc is None:
            return _cancelled(
                self.scope, None, "cancelled after the result arrived; the result is discarded", result
            )
        run_exc = exc if isinstance(exc, RunCancelled) else None
        return _cancelled(self.scope, run_exc, "the run was cancelled", inner=exc)


def run_agent_in_scope(
    scope: TaskCancellation,
    agent: Agent[Any, Any],
    user_prompt: Any = None,
    **run_kwargs: Any,
) -> Any:
    """Run ``agent`` synchronously under ``scope`` and return its ``AgentRunResult``.

    Raises :class:`TaskCancelled` if the scope was cancelled before, during or after the run
    (a result that arrives after the cancel does not count), or if the run's own ``timeout=``
    expired (cause ``TIMEOUT``). A cancelled scope never makes a model request. Settling the
    scope as ``COMPLETED`` is left to its owner, whose unit of work may hold several runs.
    """
    run = _ScopedRun.start(scope, None, run_kwargs)
    try:
        with run.context():
            result = agent.run_sync(user_prompt, **run.kwargs)
    except BaseException as exc:
        cancelled = run.end(exc)
        _report_stragglers(scope, run.tracker)
        if cancelled:
            raise run.error(exc) from exc
        raise
    if run.end(None):
        _report_stragglers(scope, run.tracker)
        raise run.error(None, result)
    return result


async def run_agent_in_scope_async(
    scope: TaskCancellation,
    agent: AbstractAgent[Any, Any],
    user_prompt: Any = None,
    *,
    tracker: RunTracker | None = None,
    **run_kwargs: Any,
) -> Any:
    """``await agent.run(...)`` under ``scope``; the async counterpart of :func:`run_agent_in_scope`.

    Same contract: refuses a cancelled scope, raises :class:`TaskCancelled` with the partial
    transcript and usage, leaves settling ``COMPLETED`` to the scope's owner. Used for
    sub-agents, which run on their parent's event loop or on a loop of their own in a thread.
    ``tracker`` (optional) lets the caller watch the run's ``in_flight_stopped``. An external
    ``CancelledError`` propagates as itself (after the scope was cancelled and settled), never
    as a result. Blocking waits (straggler grace, an undecided cause) run off the event loop.
    """
    run = _ScopedRun.start(scope, tracker, run_kwargs)
    try:
        with run.context():
            result = await agent.run(user_prompt, **run.kwargs)
    except BaseException as exc:
        cancelled = run.end(exc)
        await _off_loop(_report_stragglers, scope, run.tracker, needed=bool(run.tracker.running_threads()))
        if cancelled and not isinstance(exc, asyncio.CancelledError):
            raise await _off_loop(run.error, exc, needed=scope.cause is None) from exc
        raise
    if run.end(None):
        await _off_loop(_report_stragglers, scope, run.tracker, needed=bool(run.tracker.running_threads()))
        raise await _off_loop(run.error, None, result, needed=scope.cause is None)
    return result


async def _off_loop(fn: Callable[..., Any], *args: Any, needed: bool) -> Any:
    """Call ``fn`` on a worker thread when it may block (``needed``), else inline."""
    if needed:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


#: How long sync tools get to notice a cancel before they are named as stragglers and left behind.
STRAGGLER_GRACE = 1.0


def _report_stragglers(scope: TaskCancellation, tracker: RunTracker) -> None:
    """Give sync tools a moment to notice the cancel, then name the ones that did not.

    A straggler is left behind on its daemon thread: it cannot keep the task from ending.
    """
    running = tracker.running_threads()
    if not running or not scope.cancelled:
        return
    for item in running:
        item.thread.join(min(scope.remaining(), STRAGGLER_GRACE))
    for item in running:
        if item.thread.is_alive():
            scope.note_straggler(f"sync tool {item.tool!r}", item.thread)


def _cancelled(
    scope: TaskCancellation,
    exc: RunCancelled | None,
    message: str,
    result: Any = None,
    *,
    inner: BaseException | None = None,
) -> TaskCancelled:
    """Build the exception the task raises; waits briefly for an undecided cause.

    ``inner`` is a :class:`TaskCancelled` that escaped the run (a sub-agent's): its transcript
    and usage are the best this run has.
    """
    cause = scope.wait_cause(timeout=min(1.5, scope.remaining())) or CancelCause.UNKNOWN
    source: Any = exc if exc is not None else (inner if isinstance(inner, TaskCancelled) else None)
    if source is None and result is not None:
        source = result
    messages = source.all_messages() if source is not None else []
    usage = source.usage if source is not None else None
    detail = scope.cause_detail
    text = f"{scope.name}: {message} (cause: {cause.value}{', ' + detail if detail else ''})"
    return TaskCancelled(
        text,
        cause=cause,
        root_cause=scope.root_cause,
        detail=detail,
        messages=messages,
        usage=usage,
        timeline=scope.timeline,
        killed=scope.killed,
    )
