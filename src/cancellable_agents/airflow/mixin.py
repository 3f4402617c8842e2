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
import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

from cancellable_agents.airflow.adapter import (
    GRACE_SECONDS,
    TaskInstanceKey,
    base_operator,
    classify_sigterm,
    has_retry_policies,
    is_execution_timeout,
    ti_key,
)
from cancellable_agents.airflow.guard import guard_execute
from cancellable_agents.airflow.kill_log import log_kill_record
from cancellable_agents.airflow.metrics import emit_run_completed, genai_spans_capability
from cancellable_agents.airflow.server_stop import server_stop_verdict
from cancellable_agents.airflow.supervisor import watch_supervisor
from cancellable_agents.airflow.task_scope import scope_for
from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.scope import DEFAULT_BUDGET, Outcome, TaskCancellation
from cancellable_agents.procs.reaper import DescendantReaper

log = logging.getLogger(__name__)


#: The mixin's ``durable=True`` settings (see ``owns_durable``).
_DURABLE_SETTINGS = (
    "durable",
    "durable_path",
    "resume_after_clear",
    "usage_limits_span_tries",
    "durable_flush_after",
    "durable_write_ahead",
    "approval_timeout",
    "approval_timeout_default",
)


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
        :class:`~cancellable_agents.airflow.retry.CancellationAwareRetryPolicy` (Airflow 3.3+), so kills
        are decided by cause and never sent to a retry classifier. Default ``True``.
    :param durable: keep a continuity record while runs go, so the next try of a killed task
        resumes where it stopped (docs/content/durable.md). Transcripts may hold sensitive data:
        off by default.
    :param durable_path: keep the record under this ``ObjectStoragePath`` (required on Airflow
        3.1/3.2; default on 3.3+: the task state store).
    :param resume_after_clear: resume also after a user's Clear (default: a Clear starts fresh).
    :param usage_limits_span_tries: a durable run's ``usage_limits`` count earlier tries too.
    :param durable_flush_after: seconds a step's tool returns wait to be written with the next
        model response (one store call per step) before they are written alone; only a SIGKILL
        in that window reruns a tool that had returned. ``0``: at once (two calls per step).
        Default: ``cancellable_agents.durable.journal.RETURNS_FLUSH_S`` (1 s).
    :param durable_write_ahead: write each step before its tools start instead of while they
        run (default ``False``): a tool started just before a SIGKILL is then always known to
        the next try as a re-run, for one store round trip on every step's path.
    :param approval_timeout: how long a task whose run awaits a tool's approval waits for the
        answer (a ``timedelta``; default: no limit). docs/content/approvals.md.
    :param approval_timeout_default: when nobody answers in time: ``"reject"`` (the model is
        told so and goes on; default) or ``"fail"`` (the task fails).
    :param genai_spans: pydantic-ai's OpenTelemetry GenAI spans for this task's runs (agent run,
        model requests, tool calls), without message content: ``True``, ``False``, or a pydantic-ai
        ``InstrumentationSettings``. Default: Airflow's ``[cancellable_agents] genai_spans``
        (off). See docs/content/metrics.md.
    """

    cancellation_budget: float = DEFAULT_BUDGET
    timeout_margin: float = 2.0
    classify_timeout: float = 1.0
    reap_descendants: bool = True
    durable: bool = False
    durable_path: Any = None
    resume_after_clear: bool = False
    usage_limits_span_tries: bool = False
    durable_flush_after: float | None = None
    durable_write_ahead: bool = False
    approval_timeout: timedelta | None = None
    approval_timeout_default: str = "reject"
    genai_spans: Any = None
    #: Whether ``durable=`` and friends are this provider's. ``False`` where the operator class
    #: has a ``durable`` of its own (common.ai's): then they are passed on to it, untouched.
    owns_durable: ClassVar[bool] = True
    #: Give every subclass an ``__init__`` of its own, so BaseOperator's metaclass wraps it.
    #: ``True`` where a base operator wraps its own ``__init__`` and expects the outermost one
    #: to be wrapped too (common.ai's); by default only a class whose ``__init__`` is the mixin's.
    own_init_in_every_subclass: ClassVar[bool] = False

    def __init__(
        self,
        *args: Any,
        cancellation_budget: float | None = None,
        timeout_margin: float | None = None,
        classify_timeout: float | None = None,
        reap_descendants: bool | None = None,
        cancellation_retry_policy: bool = True,
        genai_spans: Any = None,
        **kwargs: Any,
    ) -> None:
        durable_settings = {}
        if self.owns_durable:
            durable_settings = {name: kwargs.pop(name, None) for name in _DURABLE_SETTINGS}
        super().__init__(*args, **kwargs)
        settings = {
            "cancellation_budget": cancellation_budget,
            "timeout_margin": timeout_margin,
            "classify_timeout": classify_timeout,
            "reap_descendants": reap_descendants,
            "genai_spans": genai_spans,
            **durable_settings,
        }
        for name, value in settings.items():
            if value is not None:
                setattr(self, name, value)
        _check_settings(self)
        if self.owns_durable and self.durable:
            from cancellable_agents.airflow.durable import check_durable

            check_durable(self)
        if cancellation_retry_policy:
            self.retry_policy = _cancellation_aware(getattr(self, "retry_policy", None))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_bases(cls)
        if "__init__" not in cls.__dict__ and (
            cls.__init__ is CancellableAgentMixin.__init__ or cls.own_init_in_every_subclass
        ):
            _give_own_init(cls)
        # Also an execute inherited from a plain operator (``class X(Mixin, PythonOperator)``).
        execute = cls.__dict__.get("execute", getattr(cls, "execute", None))
        if callable(execute):
            cls.execute = guard_execute(execute)  # type: ignore[attr-defined]

    # -- the scope -----------------------------------------------------------------------

    @property
    def cancellation(self) -> TaskCancellation:
        """This task instance's scope, created on first use and never replaced."""
        return scope_for(self, self.cancellation_budget)

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        # The first call that sees the task instance, before any pre_execute hook: remember
        # who we are so a SIGTERM that lands early can still be classified.
        self._know_task_instance(context)
        super().render_template_fields(context, jinja_env)  # type: ignore[misc]

    def pre_execute(self, context: Any) -> None:
        self.cancellation  # noqa: B018 - the scope exists before any pre_execute hook runs
        self._know_task_instance(context)
        self._start_reaper()
        if "_supervisor_watch" not in self.__dict__:  # stops by itself once the run settled
            self.__dict__["_supervisor_watch"] = watch_supervisor(self.cancellation, context)
        super().pre_execute(context)  # type: ignore[misc]

    def _know_task_instance(self, context: Any) -> None:
        self.__dict__["_context"] = context  # durable=True: the task state store and try number
        if self.__dict__.get("_ti_key") is None:
            self.__dict__["_ti_key"] = ti_key(context)
            self.__dict__["_ti"] = context.get("ti") if hasattr(context, "get") else None  # retry outlook

    def _start_reaper(self) -> None:
        """Watch for processes the task starts (once per task instance)."""
        if self.reap_descendants and "_reaper" not in self.__dict__:
            self.__dict__["_reaper"] = DescendantReaper.start(self.cancellation)

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
        if (spans := genai_spans_capability(self.genai_spans)) is not None:
            run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), spans]
        from cancellable_agents.run.runner import run_agent_in_scope  # pydantic-ai: at run time only

        # The runner ends the journal, and logs the kill record (on_cancelled) before its end is written.
        result = run_agent_in_scope(
            scope, agent, user_prompt, journal=self._journal(), on_cancelled=self._log_record, **run_kwargs
        )
        emit_run_completed(self, getattr(result, "usage", None))
        return result

    def _journal(self) -> Any:
        """``durable=True``: this run's continuity record (:mod:`cancellable_agents.durable`)."""
        if not (self.owns_durable and self.durable):
            return None
        from cancellable_agents.airflow.durable import journal_for

        return journal_for(self, self.__dict__.get("_context"))

    def resume_after_approval(self, context: Any, request: dict[str, Any], event: dict[str, Any]) -> Any:
        """Airflow calls this instead of ``execute`` once the reviewer answered (or the wait timed
        out): ``execute`` runs again, and the run that stopped continues from its record with
        the answer (``durable.approval``); runs before it in ``execute`` start afresh."""
        from cancellable_agents.airflow.approval import decisions_from_event
        from cancellable_agents.durable.approval import ApprovalRequest

        paused = ApprovalRequest.from_dict(request)
        self.__dict__["_approval"] = (paused, decisions_from_event(event, paused))
        return self.execute(context)  # type: ignore[attr-defined]

    def _run_timeout(self) -> float | None:
        """Seconds the run may take so it ends before ``execution_timeout`` fires."""
        timeout: timedelta | None = getattr(self, "execution_timeout", None)
        if not timeout:
            return None
        elapsed = self.cancellation.now() - self.cancellation.created_at
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
        if is_execution_timeout(sys.exc_info()[1]):
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
        return functools.partial(_classify, key)

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

    def cancelled_error(self, message: str) -> TaskCancelled:
        """The :class:`TaskCancelled` to raise for this killed task (cause, transcript, usage,
        timeline), with the kill record logged first (once per task instance). For subclasses
        whose own waits notice the kill (``raise self.cancelled_error("killed while ...")``)."""
        exc = self.cancellation.cancelled_error(message)
        self._log_record(exc)
        return exc

    def _log_record(self, exc: TaskCancelled | None = None) -> None:
        """Once per task instance, after the unwind: the kill record into the task log."""
        log_kill_record(self, exc)


def _check_bases(cls: type) -> None:
    """Refuse ``class X(BaseOperator, CancellableAgentMixin)``: BaseOperator's no-op ``on_kill``
    and ``pre_execute`` would shadow ours and kills would be silently ignored."""
    BaseOperator = base_operator()
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
    if operator.cancellation_budget >= GRACE_SECONDS:
        log.warning(
            "cancellation_budget=%.1fs: Airflow SIGKILLs a task %.0fs after SIGTERM, so the unwind is cut "
            "short there; keep it below %.0fs (default %.0fs).",
            operator.cancellation_budget,
            GRACE_SECONDS,
            GRACE_SECONDS,
            DEFAULT_BUDGET,
        )


def _cancellation_aware(policy: Any) -> Any:
    """Wrap ``policy`` where Airflow has retry policies (3.3+); leave it alone elsewhere."""
    if not has_retry_policies():
        return policy
    from cancellable_agents.airflow.retry import wrap_retry_policy

    return wrap_retry_policy(policy)


def _classify(key: TaskInstanceKey) -> CauseVerdict:
    """Why a SIGTERM came (on the cause thread): from the try's log file, where the supervisor
    logs a refused heartbeat before it signals (``server_stop``); only where that cannot tell,
    the server's view through ``classify_sigterm`` (a round trip that queues behind every other
    task's requests at a busy API server, so the cause must not depend on it)."""
    return server_stop_verdict() or classify_sigterm(*key)
