"""``CancellableAgentMixin``: one cancellation scope per task instance, wired to Airflow's kills.

Put it *before* ``BaseOperator`` in the bases. The Task SDK calls ``on_kill`` from its SIGTERM
handler on the main thread, which is the thread blocked inside the agent run, and raises
nothing itself: unless ``execute`` stops on its own, a user stop is SIGKILLed at 5 s and an
evicted task runs to completion and ends SUCCESS. So ``on_kill`` only hands the cancel to a
helper thread and returns; the run unwinds on the main thread and ``execute`` raises
:class:`TaskCancelled`.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from cancellable_agents.agent_run import run_agent_in_scope
from cancellable_agents.airflow.supervisor import notice_exit_at_once, watch_supervisor
from cancellable_agents.cancellation import DEFAULT_BUDGET, Outcome, TaskCancellation
from cancellable_agents.causes import CancelCause, CauseVerdict, classify_sigterm
from cancellable_agents.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.process_reaper import DescendantReaper

log = logging.getLogger(__name__)

#: The scope is created lazily and operators are deep-copied, so its lock cannot live on them.
#: Re-entrant: ``on_kill`` runs as a signal handler on the main thread and needs the scope, also
#: when the signal lands while the main thread is creating it (a plain Lock deadlocks there).
_scope_creation = threading.RLock()

#: Seconds between SIGTERM and SIGKILL on Airflow's user-initiated kill paths.
_AIRFLOW_GRACE = 5.0

#: Prefix of the one structured log line a cancellation writes (parsed by the e2e tests).
RECORD_PREFIX = "cancellable_agents.record "


def _guard_execute(execute: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``execute`` end as ``TaskCancelled`` if a kill landed before it returned."""
    if getattr(execute, "_cancellable_agents_guard", False):
        return execute

    @functools.wraps(execute)
    def guarded(self: CancellableAgentMixin, context: Any) -> Any:
        if self.__dict__.get("_in_execute"):
            return execute(self, context)  # a subclass's execute calling super(): guard once
        self.__dict__["_in_execute"] = True
        try:
            return _run_guarded(self, execute, context)
        finally:
            self.__dict__["_in_execute"] = False

    guarded._cancellable_agents_guard = True  # type: ignore[attr-defined]
    return guarded


def _run_guarded(operator: CancellableAgentMixin, execute: Callable[..., Any], context: Any) -> Any:
    scope = operator.cancellation
    if scope.cancelled:
        # Killed before execute began (while rendering templates, in pre_execute): don't build
        # agents or open clients only to tear them down again.
        scope.record("execute_refused", reason="cancelled before execute started")
        scope.settle(Outcome.CANCELLED)
        raise operator._task_cancelled("killed before execute started; no work was done")
    try:
        # Active for all of execute, so tools and sandboxes find the scope outside a run too.
        with scope.activate():
            result = execute(operator, context)
    except TaskCancelled:
        scope.settle(Outcome.CANCELLED)
        raise
    except Exception as exc:
        if scope.cancelled:
            # Whatever broke after the kill (a tool whose process the unwind killed, a closed
            # client) is the kill's consequence: the outcome is cancelled, with the error chained.
            scope.settle(Outcome.CANCELLED)
            raise operator._task_cancelled(f"killed; then execute failed with {exc!r}") from exc
        scope.settle(Outcome.FAILED)
        operator._finish_reaper()  # a failed task leaves nothing running behind it
        raise
    except BaseException as exc:
        scope.settle(Outcome.FAILED)
        if not _is_timeout(exc):  # on the timeout path on_kill unwinds and reaps
            operator._finish_reaper()  # a failed task leaves nothing running behind it
        raise
    if scope.settle(Outcome.COMPLETED) is Outcome.CANCELLED:
        raise operator._task_cancelled("killed before execute returned; its result is discarded")
    operator._close_reaper()
    return result


class CancellableAgentMixin:
    """Give any operator a per-task-instance :class:`TaskCancellation` and a correct ``on_kill``.

    - the scope exists before any work (``pre_execute``; lazily on first use otherwise), so a
      kill that arrives before the run starts is remembered and the run refuses to start;
    - ``on_kill`` is idempotent, never raises and returns within milliseconds;
    - once killed, ``execute`` raises :class:`TaskCancelled` even if a result arrived;
    - a kill after ``execute`` returned is a logged no-op;
    - with ``execution_timeout``, runs get their own deadline ``timeout_margin`` seconds
      earlier, so they end as ``TIMEOUT`` with everything unwound before Airflow's SIGALRM.

    :param cancellation_budget: seconds the unwind may take (default 4; Airflow SIGKILLs 5 s
        after SIGTERM, so more than that is never honoured).
    :param timeout_margin: how much earlier than ``execution_timeout`` runs are stopped (2 s).
    :param classify_timeout: how long to wait for the API server to tell why we were killed.
    :param reap_descendants: terminate processes the task started outside a sandbox (subprocess,
        MCP stdio servers) when it is killed (Linux; default ``True``).
    :param cancellation_retry_policy: wrap ``retry_policy`` in
        :class:`~cancellable_agents.retry.CancellationAwareRetryPolicy` (Airflow 3.3+), so kills
        are decided by cause and never sent to a retry classifier. Default ``True``.
    """

    cancellation_budget: float = DEFAULT_BUDGET
    timeout_margin: float = 2.0
    classify_timeout: float = 1.0
    reap_descendants: bool = True

    def __init__(
        self,
        *args: Any,
        cancellation_budget: float | None = None,
        timeout_margin: float | None = None,
        classify_timeout: float | None = None,
        reap_descendants: bool | None = None,
        cancellation_retry_policy: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        settings = {
            "cancellation_budget": cancellation_budget,
            "timeout_margin": timeout_margin,
            "classify_timeout": classify_timeout,
            "reap_descendants": reap_descendants,
        }
        for name, value in settings.items():
            if value is not None:
                setattr(self, name, value)
        _check_settings(self)
        if cancellation_retry_policy:
            self.retry_policy = _cancellation_aware(getattr(self, "retry_policy", None))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_bases(cls)
        if cls.__init__ is CancellableAgentMixin.__init__:
            _give_own_init(cls)
        # Also an execute inherited from a plain operator (``class X(Mixin, PythonOperator)``).
        execute = cls.__dict__.get("execute", getattr(cls, "execute", None))
        if callable(execute):
            cls.execute = _guard_execute(execute)  # type: ignore[attr-defined]

    # -- the scope -----------------------------------------------------------------------

    @property
    def cancellation(self) -> TaskCancellation:
        """This task instance's scope, created on first use and never replaced."""
        scope = self.__dict__.get("_task_cancellation")
        if scope is not None:
            return scope
        with _scope_creation:
            scope = self.__dict__.get("_task_cancellation")
            if scope is None:
                name = getattr(self, "task_id", type(self).__name__)
                fresh = TaskCancellation(name, budget=self.cancellation_budget)
                # A kill handled while ``fresh`` was being built created (and cancelled) the
                # scope already: keep that one, or the kill would be lost.
                scope = self.__dict__.setdefault("_task_cancellation", fresh)
        return scope

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        # The first call that sees the task instance, before any pre_execute hook: remember
        # who we are so a SIGTERM that lands early can still be classified.
        self.__dict__.setdefault("_ti_key", _ti_key(context))
        super().render_template_fields(context, jinja_env)  # type: ignore[misc]

    def pre_execute(self, context: Any) -> None:
        scope = self.cancellation
        self.__dict__["_ti_key"] = _ti_key(context)
        if self.reap_descendants and "_reaper" not in self.__dict__:
            reaper = DescendantReaper.start(scope)
            if reaper is not None:
                self.__dict__["_reaper"] = reaper
        if "_supervisor_watch" not in self.__dict__:  # stops by itself once the run settled
            self.__dict__["_supervisor_watch"] = watch_supervisor(scope, context)
        super().pre_execute(context)  # type: ignore[misc]

    # -- running agents ------------------------------------------------------------------

    def run_agent_sync(self, agent: Any, user_prompt: Any = None, **run_kwargs: Any) -> Any:
        """Run ``agent.run_sync(user_prompt, **run_kwargs)`` under this task's scope.

        Same signature as common.ai's ``CancellableAgentRunMixin.run_agent_sync``. Raises
        :class:`TaskCancelled` (with cause, transcript, usage and timeline) when the task is
        killed or its execution timeout is near.
        """
        scope = self.cancellation
        deadline = self._run_timeout()
        if deadline is not None and run_kwargs.get("timeout") is None:
            run_kwargs["timeout"] = deadline
        try:
            return run_agent_in_scope(scope, agent, user_prompt, **run_kwargs)
        except TaskCancelled as exc:
            self._log_record(exc)
            raise

    def _run_timeout(self) -> float | None:
        """Seconds the run may take so it ends before ``execution_timeout`` fires."""
        timeout: timedelta | None = getattr(self, "execution_timeout", None)
        if not timeout:
            return None
        elapsed = self.cancellation._clock() - self.cancellation.created_at
        return max(0.01, timeout.total_seconds() - elapsed - self.timeout_margin)

    # -- kills ---------------------------------------------------------------------------

    def on_kill(self) -> None:
        """Cancel this task's scope. Safe from a signal handler: never raises, never blocks.

        Called by the Task SDK on SIGTERM (user stop, clear, eviction) and, after ``execute``
        exited with ``AirflowTaskTimeout``, on the timeout path; there nothing else will
        unwind the scope, so this call waits (within the budget) for the release.
        """
        try:
            self._on_kill()
        except BaseException as exc:  # a signal handler must never raise into the run
            log.warning("on_kill failed: %r", exc)
        finally:
            try:
                super().on_kill()  # type: ignore[misc]
            except Exception as exc:
                log.warning("the operator's own on_kill failed: %r", exc)

    def _on_kill(self) -> None:
        scope = self.cancellation
        if _is_timeout(sys.exc_info()[1]):
            # Airflow's SIGALRM beat the run's own deadline; execute already exited, so nothing
            # else will unwind the scope: do it here, within the budget, and write the record.
            scope.cancel(CancelCause.TIMEOUT, detail="execution_timeout")
            self._log_record()
            return
        classify = self._classifier()
        started = scope.cancel(CancelCause.UNKNOWN, classify=classify, classify_timeout=self.classify_timeout)
        if not started and scope.outcome is Outcome.COMPLETED:
            log.info("%s: kill after the task finished its work; nothing to cancel", scope.name)

    def _classifier(self) -> Callable[[], CauseVerdict] | None:
        key = self.__dict__.get("_ti_key")
        if key is None:
            return None
        return functools.partial(classify_sigterm, *key)

    def _finish_reaper(self) -> None:
        reaper = self.__dict__.get("_reaper")
        if reaper is not None:
            reaper.reap(self.cancellation)

    def _close_reaper(self) -> None:
        """The work completed: stop the descendant watcher's polling thread (a later kill is a
        no-op, so nothing will be reaped). Matters where a process runs several tasks (dag.test)."""
        reaper = self.__dict__.get("_reaper")
        if reaper is not None:
            reaper.close()

    # -- the record ----------------------------------------------------------------------

    def _task_cancelled(self, message: str) -> TaskCancelled:
        scope = self.cancellation
        cause = scope.wait_cause(min(self.classify_timeout + 0.5, scope.remaining())) or CancelCause.UNKNOWN
        exc = TaskCancelled(
            f"{scope.name}: {message} (cause: {cause.value})",
            cause=cause,
            root_cause=scope.root_cause,
            detail=scope.cause_detail,
            timeline=scope.timeline,
            killed=scope.killed,
        )
        self._log_record(exc)
        return exc

    def _log_record(self, exc: TaskCancelled | None = None) -> None:
        """Once per task instance: wait for the unwind (within the budget), then write the single
        structured line that says what happened, for the task log in the UI."""
        if self.__dict__.setdefault("_record_logged", False):
            return
        self.__dict__["_record_logged"] = True
        scope = self.cancellation
        scope.wait_released(scope.remaining())
        self._finish_reaper()
        record = scope.summary()
        record["usage"] = _usage_dict(exc.usage if exc else None)
        record["messages"] = len(exc.messages) if exc else 0
        log.warning("%s%s", RECORD_PREFIX, json.dumps(record, default=str, sort_keys=True))
        _exit_promptly()


def _check_bases(cls: type) -> None:
    """Refuse ``class X(BaseOperator, CancellableAgentMixin)``: BaseOperator's no-op ``on_kill``
    and ``pre_execute`` would shadow ours and kills would be silently ignored."""
    from airflow.sdk.bases.operator import BaseOperator

    mro = cls.__mro__
    if BaseOperator in mro and mro.index(BaseOperator) < mro.index(CancellableAgentMixin):
        raise TypeError(
            f"{cls.__name__}: put CancellableAgentMixin before BaseOperator in the bases, e.g. "
            f"`class {cls.__name__}(CancellableAgentMixin, BaseOperator)`, or on_kill is never ours."
        )


def _give_own_init(cls: type) -> None:
    """Give ``cls`` an ``__init__`` of its own so BaseOperator's metaclass wraps it.

    Airflow's ``apply_defaults`` must wrap the ``__init__`` that ``self.__init__`` resolves to;
    the metaclass only wraps a class's own ``__init__``, and the mixin is not an operator.
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        super(cls, self).__init__(*args, **kwargs)  # type: ignore[misc,arg-type]

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__  # type: ignore[misc]


def _check_settings(operator: CancellableAgentMixin) -> None:
    """Refuse settings that cannot work, naming the fix; warn about ones Airflow won't honour."""
    for name in ("cancellation_budget", "classify_timeout"):
        value = getattr(operator, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    if operator.timeout_margin < 0:
        raise ConfigurationError(f"timeout_margin must be >= 0 seconds, got {operator.timeout_margin!r}")
    if operator.cancellation_budget >= _AIRFLOW_GRACE:
        log.warning(
            "cancellation_budget=%.1fs: Airflow SIGKILLs a task %.0fs after SIGTERM, so the unwind is cut "
            "short there; keep it below %.0fs (default %.0fs).",
            operator.cancellation_budget,
            _AIRFLOW_GRACE,
            _AIRFLOW_GRACE,
            DEFAULT_BUDGET,
        )


def _cancellation_aware(policy: Any) -> Any:
    """Wrap ``policy`` where Airflow has retry policies (3.3+); leave it alone elsewhere."""
    try:
        from cancellable_agents.retry import wrap_retry_policy
    except ImportError:
        return policy
    return wrap_retry_policy(policy)


def _exit_promptly() -> None:
    """Spare the killed task process the interpreter's final garbage collection.

    With Airflow, pydantic-ai and the model SDKs imported, that last collection takes 1.5-5 s
    (measured on 2 cores): enough to push a cancelled task past Airflow's 5 s SIGKILL even
    though its unwind took milliseconds. Frozen objects are left to the OS at exit.
    """
    gc.freeze()
    notice_exit_at_once()  # and spare it Airflow's supervisor sleeping through its exit


def _ti_key(context: Any) -> tuple[str, str, str, int] | None:
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is None:
        return None
    return (ti.dag_id, ti.task_id, ti.run_id, getattr(ti, "map_index", -1))


def _is_timeout(exc: BaseException | None) -> bool:
    return exc is not None and type(exc).__name__ == "AirflowTaskTimeout"


def _usage_dict(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "requests": getattr(usage, "requests", None),
        "input_tokens": getattr(usage, "input_tokens", None),
        "output_tokens": getattr(usage, "output_tokens", None),
    }
