"""What a run under a scope tracks: its in-flight tool tasks, its sync tools' threads, its model
requests, and child runs still tearing down ([`RunTracker`][]), and the pydantic-ai hooks that
feed it ([`CancellationCapability`][], the toolset wrapper, [`ToolThreadExecutor`][]).

pydantic-ai cancels a run when its token fires, but tears toolsets down before in-flight tools see
``CancelledError`` and stops *waiting* for sync tools without stopping them: the tracker lets the
runner ([`cancellable_agents.run.runner`][]) cancel in-flight work first and name a sync tool that
ignores the cancel. Airflow-free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset

from cancellable_agents.core._workers import JobThread
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable._capability import JournalCapability
from cancellable_agents.durable._resume import current_resume
from cancellable_agents.run import _mcp_servers as mcp_servers
from cancellable_agents.run._open_streams import ClosingModel
from cancellable_agents.run.tool_calls import RunIdentity, ToolCall, active_tool_call, derive_key

if TYPE_CHECKING:
    pass

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
    """What one run has in flight: async tool tasks, model requests and the threads running sync tools.

    ``tool_tasks``, ``tool_threads`` and ``lingering`` are guarded by ``lock`` (the scope's unwind
    thread cancels tools). ``model_requests`` is only touched on the run's event loop, so it needs
    no lock: it maps each task awaiting a model request to the event that
    [`stop_model_requests`][] waits on, created only when it does (none in a normal run).
    """

    scope: TaskCancellation
    #: Who the run is, for its tool calls' idempotency keys (`cancellable_agents.run.tool_calls`).
    identity: RunIdentity = field(default_factory=RunIdentity)
    tool_tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    tool_threads: list[_ToolThread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    model_requests: dict[asyncio.Task[Any], asyncio.Event | None] = field(default_factory=dict)
    lingering: set[asyncio.Task[Any]] = field(default_factory=set)
    stdio_servers: list[Any] = field(default_factory=list)
    """MCP stdio servers spawned for this run
    ([`StdioServer`][cancellable_agents.run._mcp_servers.StdioServer]); a cancelled run's
    teardown waits for their close, which needs this run's loop."""
    in_flight_stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (on the run's loop) once a cancelled run's in-flight tools were drained, before teardown."""
    _cancelled: set[asyncio.Task[Any]] = field(default_factory=set)
    _signal_poll: asyncio.TimerHandle | None = None

    def poll_signals(self) -> None:
        """While the run is active on the main thread, wake its event loop every
        `SIGNAL_POLL_INTERVAL` seconds (call on the loop; idempotent).

        CPython runs a Python signal handler (the Task SDK's SIGTERM -> ``on_kill``) only when the
        main thread executes bytecode. A SIGTERM that the kernel hands to another thread (a sync
        tool's) leaves a loop idling in ``epoll`` with no timer due asleep: the kill would wait
        for SIGKILL (user stop) or be lost (eviction). Seen in about 1 in 10 sync-tool kills.
        """
        if self._signal_poll is not None or threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self._signal_poll = loop.call_later(SIGNAL_POLL_INTERVAL, tick)

        tick()

    def stop_polling_signals(self) -> None:
        if self._signal_poll is not None:
            self._signal_poll.cancel()
            self._signal_poll = None

    def cancel_tool_tasks(self) -> None:
        """Deliver ``CancelledError`` to every in-flight async tool, once (thread-safe).

        Once only: a second cancel would interrupt the tool's own cleanup in its ``except``.
        """
        with self.lock:
            tasks = self.tool_tasks - self._cancelled
            self._cancelled.update(tasks)
        for task in tasks:
            if not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)

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
        pending = [t for t in self.model_requests if t is not current and not t.done()]
        if not pending:
            return
        waiters = []
        for task in pending:
            ended = self.model_requests[task] or asyncio.Event()
            self.model_requests[task] = ended
            waiters.append(asyncio.ensure_future(ended.wait()))
            task.cancel()
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

    def live_threads(self) -> list[threading.Thread]:
        """The run's sync tool threads still alive, each once (a thread serves several calls)."""
        with self.lock:
            threads = {id(t.thread): t.thread for t in self.tool_threads}
        return [t for t in threads.values() if t.is_alive()]


#: Longest a signal handler waits for the main thread while a run is active (see ``poll_signals``).
SIGNAL_POLL_INTERVAL = 0.05

#: How long closing an executor waits for its finished threads to exit (they exit at once).
_WORKER_EXIT_TIMEOUT = 1.0


class ToolThreadExecutor(concurrent.futures.Executor):
    """Runs the run's sync tool calls on daemon threads of its own, tracking each call by name.

    Daemon threads (not a ``ThreadPoolExecutor``, whose threads are joined at interpreter exit)
    mean a tool that ignores cancellation can never keep the task process alive; it is reported
    as a straggler instead. A thread whose call returned waits for the run's next sync call:
    starting a thread per call blocks the event loop in ``Thread.start`` until the new thread
    runs (measured: +30 ms for 49 calls on a busy 2-core machine, against +3 ms reused).
    [`close`][] ends the run's threads, a busy one as soon as its call returns, so a
    straggler's thread still ends with its call.
    """

    def __init__(self, tracker: RunTracker) -> None:
        self._tracker = tracker
        self._workers: list[JobThread] = []  # guarded by the tracker's lock
        self._idle: list[JobThread] = []  # guarded by the tracker's lock
        self._closed = False  # guarded by the tracker's lock

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        # pydantic-ai submits ``context.run`` of the tool's copied context; read the tool name from it.
        ctx = getattr(fn, "__self__", None)
        tool = (ctx.get(_tool_name, None) if isinstance(ctx, contextvars.Context) else None) or "sync tool"
        with self._tracker.lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = JobThread(f"tool-{tool}", after_call=self._park)
            with self._tracker.lock:
                self._workers.append(worker)
        worker.thread.name = f"tool-{tool}"
        future = worker.submit(functools.partial(fn, *args, **kwargs))
        with self._tracker.lock:
            self._tracker.tool_threads.append(_ToolThread(tool, worker.thread, future))
        return future

    def _park(self, worker: JobThread) -> bool:
        """A worker's call returned: keep it for the next call, unless the run has ended."""
        with self._tracker.lock:
            if self._closed:
                return False
            self._idle.append(worker)
            return True

    def close(self) -> None:
        """The run ended: its threads exit, and those whose call returned are joined (briefly).

        A thread still in its call (a straggler) exits once the call returns; it is left to
        [`report_stragglers`][]. So is the join of a cancelled run's threads: its unwind waits
        for no thread, since on a machine whose every core is busy each one is a wait for a CPU.
        """
        with self._tracker.lock:
            self._closed = True
            idle, self._idle = self._idle, []
            workers = list(self._workers)
        for worker in idle:
            worker.stop()
        if self._tracker.scope.cancelled:
            return
        deadline = time.monotonic() + _WORKER_EXIT_TIMEOUT
        for worker in workers:
            if worker.current is None or worker.current.done():
                worker.thread.join(max(0.0, deadline - time.monotonic()))


@dataclass
class _RunToolset(WrapperToolset[Any]):
    """Wraps the run's toolsets: tracks each tool call, and stops in-flight work before teardown.

    Tool calls are tracked here rather than in a ``wrap_tool_execute`` hook because this wrapper
    is on every call's path anyway, while each capability hook costs pydantic-ai two
    ``RunContext`` copies per call. ``call_tool`` runs in the tool's own task, so the task it
    registers is the one to cancel, and the context variables it sets are what the tool (and a
    sync tool's thread) sees: its name, its run's tracker, and the [`ToolCall`][] with its
    idempotency key (``current_tool_call()``).
    """

    tracker: RunTracker = field(default=None)  # type: ignore[assignment]

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: Any) -> Any:
        tracker = self.tracker
        task = asyncio.current_task()
        name_token = _tool_name.set(name)
        tracker_token = _tool_tracker.set(tracker)
        call_token = active_tool_call.set(tool_call(tracker.identity, name, ctx))
        if task is not None:
            with tracker.lock:
                tracker.tool_tasks.add(task)
        try:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        finally:
            active_tool_call.reset(call_token)
            _tool_tracker.reset(tracker_token)
            _tool_name.reset(name_token)
            if task is not None:
                with tracker.lock:
                    tracker.tool_tasks.discard(task)

    async def __aenter__(self) -> Any:
        self.tracker.poll_signals()
        # MCP stdio servers spawned while the toolsets are entered are closed on a cancel in the
        # protocol's order, once this run's calls ended (`cancellable_agents.run._mcp_servers`).
        with mcp_servers.entering(self.tracker):
            if "pydantic_ai.mcp" in sys.modules:
                mcp_servers.carry_idempotency_keys(self.wrapped)
            return await super().__aenter__()

    async def __aexit__(self, *args: Any) -> bool | None:
        """On a cancelled run: cancel and drain tools, stop model requests, then tear down."""
        self.tracker.stop_polling_signals()
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
            if self.tracker.scope.cancelled:
                await mcp_servers.wait_closed(self.tracker)


def tool_call(identity: RunIdentity, name: str, ctx: RunContext[Any]) -> ToolCall:
    """The [`ToolCall`][] ``ctx`` runs (its key derived from the run's ``identity``). A call of
    a resumed durable run that was in flight when the earlier try stopped is a re-run (a
    sub-agent's calls are not in that record: never)."""
    call_id = ctx.tool_call_id or ""
    step = response_index(ctx.messages, call_id)
    resume = current_resume() if not identity.parent else None
    rerun = resume is not None and resume.is_rerun(call_id)
    return ToolCall(name, call_id, step, derive_key(identity, step, call_id), rerun)


def response_index(messages: list[ModelMessage], tool_call_id: str) -> int:
    """The index among ``messages`` of the model response that made the call ``tool_call_id``
    (the latest such, normally the last message); ``len(messages)`` if none holds it."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, ModelResponse) and any(
            isinstance(p, ToolCallPart) and p.tool_call_id == tool_call_id for p in message.parts
        ):
            return i
    return len(messages)


class CancellationCapability(AbstractCapability[Any]):
    """Per-run capability: wraps the toolsets (`_RunToolset`) and tracks model requests.

    pydantic-ai charges every capability of a run, whatever it overrides, a ``RunContext`` copy
    per hook per step (the journal's own capability cost a durable step 0.5 million
    instructions, 2.5 % of a plain one: see `JournaledCancellationCapability`); that is most of
    this module's overhead, and no other per-run API reaches every tool call and the toolset
    teardown. So this overrides only what it needs: the toolset wrapper, the model wrapper, and
    ``wrap_model_request``, the one hook that sees the task awaiting a request both when it
    starts and when it ends, also when it is cancelled (``after_model_request`` is skipped then).
    """

    def __init__(self, tracker: RunTracker) -> None:
        self._tracker = tracker

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _RunToolset(toolset, tracker=self._tracker)

    def get_wrapper_model(self, model: Any) -> Any:
        """A cancelled stream is closed down to its connection
        ([`ClosingModel`][cancellable_agents.run._open_streams.ClosingModel]); pydantic-ai calls
        this for each request attempt (versions without the hook never do)."""
        return ClosingModel(model, self._tracker.scope)

    async def wrap_model_request(self, ctx: RunContext[Any], *, request_context: Any, handler: Any) -> Any:
        # Remember which task awaits the request, so a cancelled run can stop it before teardown.
        task = asyncio.current_task()
        if task is None:
            return await handler(request_context)
        requests = self._tracker.model_requests
        requests[task] = None
        try:
            return await handler(request_context)
        finally:
            ended = requests.pop(task, None)
            if ended is not None:
                ended.set()


class JournaledCancellationCapability(JournalCapability, CancellationCapability):
    """[`CancellationCapability`][] with a durable run's
    [`JournalCapability`][cancellable_agents.durable._capability.JournalCapability] hooks folded in.

    One capability fewer is one ``RunContext`` copy fewer per hook per step (0.52 million
    instructions a step, counted with callgrind): on a machine whose cores the tasks saturate,
    the journal's own cost per step is what a durable fleet pays over a plain one. The hooks are
    the journal's, unchanged; only their place in the run's capabilities moves, from the last to
    the first.
    """

    def __init__(self, tracker: RunTracker, journal: JournalCapability) -> None:
        CancellationCapability.__init__(self, tracker)
        JournalCapability.__init__(self, journal.steps)


def run_capabilities(tracker: RunTracker, others: list[Any]) -> list[AbstractCapability[Any]]:
    """The run's capabilities: its [`CancellationCapability`][] first, then ``others`` (the
    caller's), with a durable run's ``JournalCapability`` among them folded into the first."""
    journal = next((c for c in others if type(c) is JournalCapability), None)
    if journal is None:
        return [CancellationCapability(tracker), *others]
    return [JournaledCancellationCapability(tracker, journal), *(c for c in others if c is not journal)]


#: How long sync tools get to notice a cancel before they are named as stragglers and left behind.
STRAGGLER_GRACE = 1.0


def report_stragglers(scope: TaskCancellation, tracker: RunTracker) -> None:
    """Give sync tools a moment to notice the cancel, then name the ones that did not.

    A straggler is left behind on its daemon thread: it cannot keep the task from ending. The
    threads whose call had returned are joined here too, after the run unwound (see
    [`ToolThreadExecutor.close`][]); they exit at once.
    """
    if not scope.cancelled:
        return
    running = tracker.running_threads()
    for thread in tracker.live_threads():
        thread.join(min(scope.remaining(), STRAGGLER_GRACE))
    for item in running:
        if item.thread.is_alive():
            scope.note_straggler(f"sync tool {item.tool!r}", item.thread)
