"""The per-task cancellation scope.

One [`TaskCancellation`][] exists per task instance (and one per sub-agent delegation, as a
child). It wraps a pydantic-ai `CancellationToken` and adds what a task
needs on top of "stop the run": a decided cause, a timeline, child scopes, registered
resources released in order within a grace budget, and a single terminal outcome.

The model, in four rules:

- ``cancel()`` is the only way in. It is idempotent, thread-safe and returns at once (it is
  called from signal handlers on the very thread that must unwind); the unwind runs on a
  helper thread: pydantic-ai's token first (no new model request), then ``Phase.IN_FLIGHT``
  resources concurrently, then ``Phase.TEARDOWN``, never past ``budget`` seconds.
- A cancel reaches the whole tree: children are flagged before ``cancel()`` returns, and a
  child or resource added after the cancel is cancelled or released at once. No kill is lost.
- The cause is decided once (first decision wins), within a bounded wait; ``UNKNOWN`` rather
  than a guess.
- The outcome is settled once; ``COMPLETED`` loses to a cancel here or above.

Every mutable field is guarded by ``_lock`` (one lock per scope; re-entrant, because ``cancel``
may run as a signal handler while the same thread holds it). That lock is why this is one
module of ~500 lines: the scope's state is one class, and splitting it would split the lock.
Airflow-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic_ai import CancellationToken

from cancellable_agents.core.causes import CancelCause, CauseVerdict, UserAction, bounded
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.timeline import KillRecord, TimelineEvent
from cancellable_agents.core.unwind import (
    DEFAULT_BUDGET,
    Cleanup,
    Phase,
    Resource,
    release_phases,
    release_together,
)

__all__ = ["Outcome", "ResourceHandle", "TaskCancellation", "current_cancellation"]

log = logging.getLogger(__name__)

#: How long the unwind waits for a classifier past its deadline: the time to record its answer.
_CLASSIFIER_SLACK_S = 0.05


class Outcome(str, enum.Enum):
    """The one terminal outcome of a scope's run."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class ResourceHandle:
    """Returned by [`TaskCancellation.register`][]; unregister when the resource is gone."""

    def __init__(self, scope: TaskCancellation, resource: Resource) -> None:
        self._scope = scope
        self._resource = resource

    def unregister(self) -> None:
        """Forget the resource (it was released normally). Idempotent."""
        self._scope._forget(self._resource)


_current: contextvars.ContextVar[TaskCancellation | None] = contextvars.ContextVar(
    "cancellable_agents_current", default=None
)
_active_roots: list[TaskCancellation] = []
_roots_lock = threading.Lock()


def current_cancellation() -> TaskCancellation | None:
    """The scope of the run this code belongs to, or ``None`` outside any run.

    Works in async tools, in sync tools (pydantic-ai copies the context into its worker
    threads), and in plain threads a tool started: when the context does not carry a scope and
    exactly one task scope is active in the process, as in an Airflow task process, that one.
    """
    scope = _current.get()
    if scope is not None:
        return scope
    with _roots_lock:
        roots = set(_active_roots)  # the same scope may be active at several depths
    return roots.pop() if len(roots) == 1 else None


class TaskCancellation:
    """A cancellation scope: cancel once, unwind everything registered, within a budget.

    Thread-safe. [`cancel`][] returns at once and does the work on a helper thread, because
    the caller is usually a signal handler running on the very thread that must unwind.
    """

    def __init__(
        self,
        name: str = "task",
        *,
        budget: float = DEFAULT_BUDGET,
        parent: TaskCancellation | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget <= 0:
            raise ConfigurationError(f"budget must be positive seconds, got {budget!r}; Airflow allows 5 s.")
        self.name = name
        self.budget = budget
        self.parent = parent
        # The run's pydantic-ai token, made when a run first asks (never in a signal handler, never
        # while a DAG file is parsed); guarded by _lock, as is whether a cancel already wanted it.
        self._token: CancellationToken | None = None
        self._token_cancelled = False
        self._clock = clock
        self._lock = threading.RLock()
        self._cancelled = threading.Event()  # set once, under _lock
        # Taken by the one cancel that starts the unwind. ``next()`` is one C call: a signal
        # handler run on this thread inside cancel() (the RLock lets it in) finds it taken, where
        # it could pass an ``is_set()`` check made before the outer call's ``set()``.
        self._cancel_claims = itertools.count()
        self._signalled = threading.Event()  # set by the unwind once the token was cancelled
        self._cause_decided = threading.Event()  # set once _cause is
        self._release_done = threading.Condition(self._lock)
        # All guarded by _lock:
        self._unwound = False
        self._late_releases = 0
        self._cause: CauseVerdict | None = None  # written once
        self._outcome: Outcome | None = None  # written once
        self._cancel_at: float | None = None  # written once, before _cancelled is set
        self._timeline: list[TimelineEvent] = []
        self._children: list[TaskCancellation] = []
        self._resources: list[Resource] = []
        self._killed: list[KillRecord] = []
        self._stragglers: list[str] = []
        self._attached: dict[str, Any] = {}
        self.created_at = clock()
        self.record("scope_created")

    # -- state ---------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """Whether cancellation was requested (sticky)."""
        return self._cancelled.is_set()

    @property
    def cause(self) -> CancelCause | None:
        """The decided cause, or ``None`` while it is being decided or if never cancelled."""
        return self._cause.cause if self._cause else None

    @property
    def cause_detail(self) -> str:
        return self._cause.detail if self._cause else ""

    @property
    def user_action(self) -> UserAction | None:
        """What the user did, when the cause is ``USER`` (marked failed, cleared ...)."""
        return self._cause.action if self._cause else None

    @property
    def root_cause(self) -> CancelCause | None:
        """The cause at the top of the scope chain: why the whole task stopped."""
        if self.parent is not None and self.cause is CancelCause.PARENT:
            return self.parent.root_cause
        return self.cause

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome

    @property
    def timeline(self) -> list[TimelineEvent]:
        with self._lock:
            return list(self._timeline)

    @property
    def killed(self) -> list[KillRecord]:
        """Processes and remote commands stopped by the unwind."""
        with self._lock:
            return list(self._killed)

    @property
    def stragglers(self) -> list[str]:
        """Names of work that did not stop within the budget."""
        with self._lock:
            return list(self._stragglers)

    @property
    def children(self) -> list[TaskCancellation]:
        with self._lock:
            return list(self._children)

    def now(self) -> float:
        """The scope's clock (monotonic seconds)."""
        return self._clock()

    def remaining(self) -> float:
        """Seconds left of the budget once cancelled (the full budget before that)."""
        if self._cancel_at is None:
            return self.budget
        return max(0.0, self._cancel_at + self.budget - self._clock())

    # -- the cooperative API for tools ---------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` passes; return whether cancelled.

        Wakes only once the run itself was told to stop, so a tool that returns on wake-up
        cannot trigger one more model request.
        """
        return self._signalled.wait(timeout)

    def raise_if_cancelled(self) -> None:
        """Raise [`TaskCancelled`][] if this scope was cancelled (for loops in sync tools)."""
        if self.cancelled:
            raise self.cancelled_error("cancelled")

    @contextlib.contextmanager
    def activate(self) -> Iterator[TaskCancellation]:
        """Make this the scope [`current_cancellation`][] returns in this context."""
        token = _current.set(self)
        is_root = self.parent is None
        if is_root:
            with _roots_lock:
                _active_roots.append(self)
        try:
            yield self
        finally:
            _current.reset(token)
            if is_root:
                with _roots_lock, contextlib.suppress(ValueError):
                    _active_roots.remove(self)

    # -- timeline ------------------------------------------------------------------------

    def record(self, event: str, **detail: Any) -> TimelineEvent:
        """Append an event with the current monotonic and wall-clock time."""
        entry = TimelineEvent(event, self._clock(), time.time(), detail)
        with self._lock:
            self._timeline.append(entry)
        return entry

    def record_killed(self, killed: KillRecord) -> None:
        """Note a process or remote command the unwind stopped."""
        with self._lock:
            self._killed.append(killed)
        self.record("killed", **killed.as_dict())

    def attach(self, **facts: Any) -> None:
        """Add JSON-friendly facts to the record (a sub-agent's partial transcript and usage)."""
        with self._lock:
            self._attached.update(facts)

    @property
    def attached(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._attached)

    def note_straggler(self, name: str, thread: threading.Thread | None = None) -> None:
        """Name work that ignored cancellation, so the log tells the DAG author what to fix.

        With ``thread``, a watcher also records when (and how far past the budget) it ended.
        """
        since = self._clock() - (self._cancel_at if self._cancel_at is not None else self.created_at)
        with self._lock:
            self._stragglers.append(name)
        self.record("straggler", name=name, running_s=round(since, 3))
        log.warning(
            "%s: %s is still running %.2fs after the cancel and is left behind; make it check "
            "current_cancellation() (or use an async tool) so it stops within the %.1fs budget.",
            self.name,
            name,
            since,
            self.budget,
        )
        if thread is not None:
            threading.Thread(target=self._watch_straggler, args=(name, thread), daemon=True).start()

    def _watch_straggler(self, name: str, thread: threading.Thread) -> None:
        thread.join()
        started = self._cancel_at if self._cancel_at is not None else self.created_at
        overran = max(0.0, self._clock() - started - self.budget)
        self.record("straggler_finished", name=name, overran_s=round(overran, 3))
        log.warning("%s: %s finished %.2fs past the cancellation budget", self.name, name, overran)

    # -- children and resources ----------------------------------------------------------

    def child(self, name: str) -> TaskCancellation:
        """A child scope (sub-agent, delegated run) that this scope's cancel also cancels.

        Its budget is this scope's remaining budget. A child created after this scope was
        cancelled is born cancelled: an interrupt that lands mid-creation is never lost.
        """
        kid = TaskCancellation(name, budget=max(self.remaining(), 0.05), parent=self, clock=self._clock)
        with self._lock:
            self._children.append(kid)
            born_cancelled = self.cancelled
        if born_cancelled:
            kid.cancel(CancelCause.PARENT)
        return kid

    def register(
        self,
        cleanup: Cleanup,
        *,
        name: str,
        phase: Phase = Phase.IN_FLIGHT,
        inline: bool = False,
    ) -> ResourceHandle:
        """Release ``cleanup`` (sync or async callable) when this scope is cancelled.

        Async callables registered from a running event loop are run on that loop; others run
        on a helper thread. Registering after the scope was cancelled releases at once.
        ``inline``: the cleanup returns within the scope's budget by itself (it never waits on
        anything that may hang), so the unwind runs it without a thread of its own.
        """
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        resource = Resource(name, cleanup, phase, loop, inline)
        with self._lock:
            self._resources.append(resource)
            late = self._cancelled.is_set() and self._claim([resource])
            if late:
                self._late_releases += 1
        if late:
            threading.Thread(
                target=self._release_late, args=(resource,), name=f"release-{name}", daemon=True
            ).start()
        return ResourceHandle(self, resource)

    def _release_late(self, resource: Resource) -> None:
        try:
            release_together(self, [resource])
        finally:
            with self._release_done:
                self._late_releases -= 1
                self._release_done.notify_all()

    def _claim(self, resources: list[Resource]) -> list[Resource]:
        """Mark resources as being released (caller holds the lock); each is released once."""
        claimed = [r for r in resources if not r.released]
        for resource in claimed:
            resource.released = True
        return claimed

    def _forget(self, resource: Resource) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._resources.remove(resource)

    # -- cancel and settle ---------------------------------------------------------------

    def cancel(
        self,
        cause: CancelCause = CancelCause.UNKNOWN,
        *,
        detail: str = "",
        classify: Callable[[], CauseVerdict] | None = None,
        classify_timeout: float = 1.0,
        verdict: CauseVerdict | None = None,
    ) -> bool:
        """Request cancellation; return ``True`` if this call started it.

        Idempotent and thread-safe, never raises, returns within microseconds: the unwind runs
        on a helper thread. The cause is ``verdict`` if given (decided by the caller, with what
        user action and source it knows), else ``cause`` and ``detail``; or ``classify``
        (optional) decides it off-thread within ``classify_timeout`` of this call; until it
        answers, ``cause`` is ``None``, and the unwind waits for it no later than that. A
        cancel after the run completed is a logged no-op.
        """
        if verdict is not None:
            cause, detail, classify = verdict.cause, verdict.detail, None
        with self._lock:
            if self._outcome is Outcome.COMPLETED:
                self.record("cancel_ignored", reason="run already completed", cause=cause.value)
                log.info("%s: cancel after the run completed; nothing to do", self.name)
                return False
            if next(self._cancel_claims):
                self.record("cancel_repeated", cause=cause.value)
                return False
            self._cancel_at = self._clock()
            self._cancelled.set()
        extra = {"detail": detail} if detail else {}
        if classify is None:
            self.record("kill_received", cause=cause.value, **extra)
            self._decide(verdict or CauseVerdict(cause, detail))
        else:  # the answer comes in ``cause_decided``; ``cause`` is what a silent classifier leaves
            self.record("kill_received", cause="deciding", fallback=cause.value, **extra)
        # Flag the children before returning (each unwinds on its own helper, before this scope's
        # token is cancelled): no child can start or complete once its parent's cancel is accepted.
        for kid in self.children:
            kid.cancel(CancelCause.PARENT)
        helper = threading.Thread(
            target=self._unwind,
            args=(classify, classify_timeout),
            name=f"cancellable-agents-unwind-{self.name}",
            daemon=True,
        )
        helper.start()
        return True

    def decide_cause(self, cause: CancelCause, detail: str = "") -> bool:
        """Fix the cause from what is known locally if nothing decided it yet (first decision
        wins); return whether it did. For a cancel whose classifier cannot answer (its channel
        died), so the record need not wait for the classifier's timeout."""
        return self._decide(CauseVerdict(cause, detail))

    def _decide(self, verdict: CauseVerdict) -> bool:
        with self._lock:
            if self._cause is not None:
                return False
            self._cause = verdict
        self.record(
            "cause_decided", cause=verdict.cause.value, detail=verdict.detail, source=verdict.source.value
        )
        self._cause_decided.set()
        return True

    def _cancelled_here_or_above(self) -> bool:
        scope: TaskCancellation | None = self
        while scope is not None:
            if scope.cancelled:
                return True
            scope = scope.parent
        return False

    def wait_cause(self, timeout: float) -> CancelCause | None:
        """Wait (bounded) for the cause to be decided and return it."""
        self._cause_decided.wait(timeout)
        return self.cause

    def cancelled_error(self, message: str, *, source: Any = None) -> TaskCancelled:
        """The [`TaskCancelled`][] for this scope: the one place it is built.

        Waits for the cause within the budget (a classifier always decides within its own
        timeout, so this only waits that long). ``source`` is whatever holds the partial
        transcript and usage: a pydantic-ai ``RunCancelled``, a discarded result, or a
        ``TaskCancelled`` that escaped a child run.
        """
        cause = self.wait_cause(self.remaining()) or CancelCause.UNKNOWN
        detail = self.cause_detail
        messages = source.all_messages() if source is not None else []
        return TaskCancelled(
            f"{self.name}: {message} (cause: {cause.value}{', ' + detail if detail else ''})",
            cause=cause,
            root_cause=self.root_cause,
            detail=detail,
            action=self.user_action,
            messages=messages,
            usage=getattr(source, "usage", None),
            timeline=self.timeline,
            killed=self.killed,
        )

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait until every registered resource was released (or given up on), late ones included."""
        with self._release_done:
            return self._release_done.wait_for(lambda: self._unwound and not self._late_releases, timeout)

    def settle(self, outcome: Outcome) -> Outcome:
        """Record the run's terminal outcome; the first one wins and is returned.

        ``COMPLETED`` loses to a cancel that already happened, here or on any ancestor: a result
        that arrives after cancellation cannot turn it back into success.
        """
        with self._lock:
            if self._outcome is None:
                if outcome is Outcome.COMPLETED and self._cancelled_here_or_above():
                    outcome = Outcome.CANCELLED
                self._outcome = outcome
                self.record("run_settled", outcome=outcome.value)
            return self._outcome

    # -- the unwind (helper thread) ------------------------------------------------------

    def _unwind(self, classify: Callable[[], CauseVerdict] | None, classify_timeout: float) -> None:
        classifier: threading.Thread | None = None
        # The classifier's budget counts from the cancel, not from when this thread got to run
        # (a busy machine starts it late): it never holds the unwind past ``classify_timeout``.
        assert self._cancel_at is not None  # set by cancel() before this thread starts
        classify_until = self._cancel_at + classify_timeout
        if classify is not None:
            classifier = threading.Thread(
                target=lambda: self._decide(bounded(classify, max(0.0, classify_until - self._clock()))),
                name="cancellable-agents-cause",
                daemon=True,
            )
            classifier.start()
        with self._lock:
            pending = self._claim(list(self._resources))
        # Stop the run first (no new model request), then in-flight work, then tear down what held it.
        self._cancel_token()
        self._signalled.set()
        release_phases(self, pending)
        if classifier is not None:
            # The classifier gives up at ``classify_until``; a moment more lets it record that.
            classifier.join(max(0.0, classify_until - self._clock()) + _CLASSIFIER_SLACK_S)
        # Children unwound concurrently from the start; waiting here only makes "released" cover
        # the whole tree, so the record is complete when it is logged.
        for kid in self.children:
            if kid.cancelled:
                kid.wait_released(self.remaining())
        self.record("resources_released", remaining_s=round(self.remaining(), 3))
        with self._release_done:
            self._unwound = True
            self._release_done.notify_all()

    @property
    def token(self) -> CancellationToken:
        """The pydantic-ai token a run of this scope carries; already cancelled if the scope's
        unwind reached it first (a run started after the kill stops at once)."""
        from pydantic_ai import CancellationToken

        with self._lock:
            if self._token is None:
                self._token = CancellationToken()
                if self._token_cancelled:
                    self._token.cancel()
            return self._token

    def _cancel_token(self) -> None:
        # Recorded first: the run reacts on its own loop at once, and may record its toolset
        # teardown before this thread runs again (a busy machine); the cause comes first.
        self.record("token_cancelled")
        with self._lock:
            self._token_cancelled = True
            token = self._token
        if token is None:  # no run asked for one yet: the property hands out a cancelled one
            return
        try:
            token.cancel()
        except Exception as exc:  # a run whose loop cannot be reached must not stop the unwind
            log.warning("%s: could not cancel the pydantic-ai run: %s", self.name, exc)
            self.record("token_cancel_failed", error=repr(exc))

    # -- reporting -----------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The record as one JSON-friendly dict: cause, timeline, kills.

        Timeline ``ms`` are relative to the cancel (``kill_received`` is 0), or to the scope's
        creation if it was never cancelled. ``wall_origin`` is the wall-clock time
        (``time.time()``) of that 0, so the timeline can be laid against other processes' clocks
        (e.g. when a user clicked *Mark as failed*).
        """
        origin = self._cancel_at if self._cancel_at is not None else self.created_at
        timeline = self.timeline
        first = timeline[0]  # scope_created: recorded in __init__, always there
        return {
            "scope": self.name,
            "cause": self.cause.value if self.cause else None,
            "root_cause": self.root_cause.value if self.root_cause else None,
            "detail": self.cause_detail,
            "cause_source": self._cause.source.value if self._cause else None,
            "outcome": self._outcome.value if self._outcome else None,
            "budget_s": self.budget,
            "wall_origin": round(first.wall + (origin - first.at), 3),
            "timeline": [e.as_dict(origin) for e in timeline],
            "killed": [k.as_dict() for k in self.killed],
            "stragglers": self.stragglers,
            "attached": self.attached,
            "children": [kid.summary() for kid in self.children],
        }
