"""Run a pydantic-ai agent under a :class:`TaskCancellation` scope.

pydantic-ai cancels a run when its token fires, but on its own it tears toolsets down before
in-flight tools see ``CancelledError``, and it stops *waiting* for sync tools without stopping
them. This module adds what the scope needs around ``Agent.run_sync``: in-flight tool tasks are
cancelled before any toolset teardown, sync tools run on tracked threads so one that ignores
cancellation is named, and the outcome is settled exactly once. Airflow-free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import RunCancelled, RunTimedOut
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset

from cancellable_agents.cancellation import Outcome, Phase, TaskCancellation
from cancellable_agents.causes import CancelCause
from cancellable_agents.exceptions import TaskCancelled

log = logging.getLogger(__name__)

_tool_name: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cancellable_agents_tool", default=None
)


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
            await self.tracker.drain_tool_tasks()
            self.tracker.scope.record("toolset_teardown", toolset=self.wrapped.label)
        return await super().__aexit__(*args)


class CancellationCapability(AbstractCapability[Any]):
    """Per-run capability: tracks tool calls and orders teardown after in-flight tools."""

    def __init__(self, tracker: RunTracker) -> None:
        self._tracker = tracker

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _OrderedTeardownToolset(toolset, tracker=self._tracker)

    async def wrap_tool_execute(
        self, ctx: RunContext[Any], *, call: Any, tool_def: Any, args: Any, handler: Any
    ) -> Any:
        task = asyncio.current_task()
        token = _tool_name.set(tool_def.name)
        if task is not None:
            with self._tracker.lock:
                self._tracker.tool_tasks[task] = asyncio.get_running_loop()
        try:
            return await handler(args)
        finally:
            _tool_name.reset(token)
            if task is not None:
                with self._tracker.lock:
                    self._tracker.tool_tasks.pop(task, None)


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
    if scope.cancelled:
        scope.record("run_refused", reason="cancelled before the run started")
        scope.settle(Outcome.CANCELLED)
        raise _cancelled(scope, None, "cancelled before the run started; no model request was made")

    tracker = RunTracker(scope)
    handle = scope.register(tracker.cancel_tool_tasks, name="in-flight tools", phase=Phase.IN_FLIGHT)
    capabilities = [CancellationCapability(tracker), *(run_kwargs.pop("capabilities", None) or [])]
    scope.record("run_started")
    try:
        with scope.activate(), Agent.using_thread_executor(ToolThreadExecutor(tracker)):
            result = agent.run_sync(
                user_prompt, cancellation_token=scope.token, capabilities=capabilities, **run_kwargs
            )
    except RunCancelled as exc:
        if isinstance(exc, RunTimedOut):
            scope.cancel(CancelCause.TIMEOUT, detail="the run's deadline passed")
        scope.record("run_unwound")
        scope.settle(Outcome.CANCELLED)
        _report_stragglers(scope, tracker)
        raise _cancelled(scope, exc, "the run was cancelled") from exc
    except BaseException:
        scope.record("run_unwound", error=True)
        _report_stragglers(scope, tracker)
        raise
    finally:
        handle.unregister()

    # The scope's owner (the execute guard, a delegation) settles COMPLETED when its whole unit
    # of work is done; this check only spares the caller a result that is already void.
    if scope.cancelled:
        scope.record("result_discarded", reason="cancelled before the result was accepted")
        _report_stragglers(scope, tracker)
        raise _cancelled(scope, None, "cancelled after the result arrived; the result is discarded", result)
    scope.record("run_completed")
    return result


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
    scope: TaskCancellation, exc: RunCancelled | None, message: str, result: Any = None
) -> TaskCancelled:
    """Build the exception the task raises; waits briefly for an undecided cause."""
    cause = scope.wait_cause(timeout=min(1.5, scope.remaining())) or CancelCause.UNKNOWN
    messages = exc.all_messages() if exc is not None else (result.all_messages() if result else [])
    usage = exc.usage if exc is not None else (result.usage if result else None)
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
