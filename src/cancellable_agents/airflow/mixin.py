"""``CancellableAgentMixin``: one cancellation scope per task instance, wired to Airflow's kills.

Put it *before* ``BaseOperator`` in the bases. The Task SDK calls ``on_kill`` from its SIGTERM
handler on the main thread, which is the thread blocked inside the agent run, and raises
nothing itself: unless ``execute`` stops on its own, a user stop is SIGKILLed at 5 s and an
evicted task runs to completion and ends SUCCESS. So ``on_kill`` only hands the cancel to a
helper thread and returns; the run unwinds on the main thread and ``execute`` raises
[`TaskCancelled`][].
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from cancellable_agents.airflow._adapter import (
    GRACE_SECONDS,
    base_operator,
    has_retry_policies,
    is_execution_timeout,
)
from cancellable_agents.airflow._guard import guard_execute
from cancellable_agents.airflow.config import OPTIONS, deployment_setting
from cancellable_agents.airflow.task_try import TaskTry, note_kill_before_try, try_for, try_of
from cancellable_agents.core.wind_down import OnWindDown, WindDown, wind_down_of
from cancellable_agents.durable.options import DurableOptions

if TYPE_CHECKING:
    from cancellable_agents.core.exceptions import TaskCancelled
    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.core.wind_down import WindDownReport

__all__ = ["CancellableAgentMixin"]

log = logging.getLogger(__name__)


#: The release that drops the old spellings of the durable options (0.1 keyword -> option).
_OLD_DURABLE_KEYWORDS_GO_IN = "0.3.0"
_OLD_DURABLE_KEYWORDS = {
    "durable_path": "path",
    "resume_after_clear": "resume_after_clear",
    "usage_limits_span_tries": "usage_limits_span_tries",
    "durable_flush_after": "flush_after",
    "durable_write_ahead": "write_ahead",
}
_warned_old_keywords: set[str] = set()


class CancellableAgentMixin:
    """Give any operator a per-task-instance [`TaskCancellation`][] and a correct ``on_kill``.

    - the scope exists before any work (``pre_execute``; lazily on first use otherwise), so a
      kill that arrives before the run starts is remembered and the run refuses to start;
    - ``on_kill`` is idempotent, never raises and returns within milliseconds;
    - once killed, ``execute`` raises [`TaskCancelled`][] even if a result arrived;
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
        [`CancellationAwareRetryPolicy`][cancellable_agents.airflow.retry.CancellationAwareRetryPolicy]
        (Airflow 3.3+), so kills are decided by cause and never sent to a retry classifier. Default ``True``.
    :param durable: ``True`` or [`DurableOptions`][cancellable_agents.durable.options.DurableOptions]: keep a
    continuity
        record while runs go, so the next try of a killed task resumes where it stopped
        (docs/content/durable.md). Transcripts may hold sensitive data: off by default.
    :param wind_down: seconds before the run's deadline (``execution_timeout`` minus
        ``timeout_margin``) at which the run winds down: the step in flight finishes, the next
        model request offers no function tools and asks for a final answer, which is the task's
        result (success). ``True``: the measured default (15 s); a
        [`WindDown`][cancellable_agents.core.wind_down.WindDown] for the final instruction, budget
        wind-down (``usage_limits``) and ``on_wind_down``. ``None``: ``[cancellable_agents]
        wind_down`` (0: off). docs/content/wind-down.md.
    :param on_wind_down: ``"answer"`` (default) or ``"fail"``: a wound-down answer fails the task
        as ``timeout``, the partial answer in its record.
    :param genai_spans: pydantic-ai's OpenTelemetry GenAI spans for this task's runs (agent run,
        model requests, tool calls), without message content: ``True``, ``False``, or a pydantic-ai
        ``InstrumentationSettings``. See docs/content/metrics.md.

    Settings left ``None`` take the deployment's value from Airflow's ``[cancellable_agents]``
    config section (``provider.yaml`` declares it; docs/content/reference.md lists it), or a value
    a subclass sets as a class attribute.
    """

    cancellation_budget: float
    timeout_margin: float
    classify_timeout: float
    reap_descendants: bool = True
    #: This provider's durable options (``None``: off); common.ai's own ``durable`` where
    #: ``owns_durable`` is ``False``.
    durable: Any = None
    genai_spans: Any = None
    #: How the task's runs wind down before their deadline or budget (``None``: they do not).
    wind_down: WindDown | None = None
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
        durable: bool | DurableOptions | None = None,
        wind_down: float | bool | WindDown | None = None,
        on_wind_down: OnWindDown | None = None,
        **kwargs: Any,
    ) -> None:
        options = None
        if self.owns_durable:
            options = _durable_options(durable, kwargs)
        elif durable is not None:
            kwargs["durable"] = durable  # common.ai's own
        super().__init__(*args, **kwargs)
        self.cancellation_budget = _setting(self, "cancellation_budget", cancellation_budget)
        self.timeout_margin = _setting(self, "timeout_margin", timeout_margin)
        self.classify_timeout = _setting(self, "classify_timeout", classify_timeout)
        if reap_descendants is not None:
            self.reap_descendants = reap_descendants
        if genai_spans is not None:
            self.genai_spans = genai_spans
        if self.owns_durable:
            self.durable = options
        self.wind_down = _wind_down_setting(self, wind_down, on_wind_down)
        _check_settings(self)
        if self.owns_durable and self.durable:
            from cancellable_agents.airflow._durable_task import check_durable

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

    # -- the try ------------------------------------------------------------------------

    @property
    def cancellation(self) -> TaskCancellation:
        """This task instance's scope, created on first use and never replaced."""
        return self.task_try().scope

    def task_try(self, context: Any = None) -> TaskTry:
        """This try's state ([`TaskTry`][cancellable_agents.airflow.task_try.TaskTry]), made on first
        use; ``context`` tells it who the task instance is. A kill that came before it was made
        cancels it now, once the cause can be asked for."""
        task_try, killed_before = try_for(self, self.cancellation_budget, context)
        if context is not None:
            task_try.know(context)
        if killed_before:
            task_try.kill(self.classify_timeout)
        return task_try

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        # The first call that sees the task instance, before any pre_execute hook: remember
        # who we are so a SIGTERM that lands early can still be classified.
        self.task_try(context)
        super().render_template_fields(context, jinja_env)  # type: ignore[misc]

    def pre_execute(self, context: Any) -> None:
        task_try = self.task_try(context)  # the scope exists before any pre_execute hook runs
        if self.reap_descendants:
            task_try.start_reaper()
        task_try.watch_supervisor(context)
        super().pre_execute(context)  # type: ignore[misc]

    # -- running agents ------------------------------------------------------------------

    def run_agent_sync(self, agent: Any, user_prompt: Any = None, **run_kwargs: Any) -> Any:
        """Run ``agent.run_sync(user_prompt, **run_kwargs)`` under this task's scope.

        Same signature as common.ai's ``CancellableAgentRunMixin.run_agent_sync``. Raises
        [`TaskCancelled`][] (with cause, transcript, usage and timeline) when the task is
        killed or its execution timeout is near.
        """
        from cancellable_agents.airflow._metrics import emit_run_completed, genai_spans_capability
        from cancellable_agents.run.runner import run_agent_in_scope  # pydantic-ai: at run time only

        task_try = self.task_try()
        deadline = self.run_timeout()
        if deadline is not None and run_kwargs.get("timeout") is None:
            run_kwargs["timeout"] = deadline
        if (spans := genai_spans_capability(self.genai_spans)) is not None:
            run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), spans]
        journal = self._journal(task_try)
        run_key = journal.run_key if journal is not None else task_try.next_run_key()
        wound_down: list[WindDownReport] = []
        # The runner ends the journal, and logs the kill record (on_cancelled) before its end is written.
        result = run_agent_in_scope(
            task_try.scope,
            agent,
            user_prompt,
            journal=journal,
            on_cancelled=self._log_record,
            identity=task_try.run_identity(run_key),
            wind_down=self.wind_down,
            on_wound_down=wound_down.append,
            **run_kwargs,
        )
        for report in wound_down:
            self._wound_down(task_try, report)
        emit_run_completed(task_try, getattr(result, "usage", None), wound_down=bool(wound_down))
        return result

    def _wound_down(self, task_try: TaskTry, report: WindDownReport) -> None:
        """A run answered at its wind-down: the summary line, the record line and the metrics."""
        from cancellable_agents.airflow._metrics import emit_wound_down, log_wound_down

        task_try.wound_down.append(report)
        log_wound_down(report)
        emit_wound_down(task_try, report)

    def _journal(self, task_try: TaskTry) -> Any:
        """``durable=True``: this run's continuity record ([`cancellable_agents.durable`][])."""
        if not (self.owns_durable and self.durable):
            return None
        from cancellable_agents.airflow._durable_task import journal_for

        return journal_for(self, task_try)

    def resume_after_approval(
        self,
        context: Any,
        request: dict[str, Any],
        event: dict[str, Any],
        asked_at: float | None = None,
        waits: list[dict[str, Any]] | None = None,
        **_: Any,
    ) -> Any:
        """Airflow calls this instead of ``execute`` once the reviewer answered (or the wait timed
        out): ``execute`` runs again, and the run that stopped continues from its record with
        the answer (``durable.pauses``); runs before it in ``execute`` start afresh. ``asked_at``
        and ``waits`` (the try's earlier waits) make the wait one of the try's facts."""
        from cancellable_agents.airflow._approval import decisions_from_event, note_approval_wait
        from cancellable_agents.durable._pauses import ApprovalRequest

        paused = ApprovalRequest.from_dict(request)
        task_try = self.task_try(context)
        note_approval_wait(task_try, paused, asked_at, waits)
        task_try.answers = (paused.run_key, decisions_from_event(event, paused))
        return self.execute(context)  # type: ignore[attr-defined]

    def resume_after_deferral(
        self, context: Any, event: Any = None, waits: list[dict[str, Any]] | None = None, **_: Any
    ) -> Any:
        """Airflow calls this instead of ``execute`` once the trigger a tool deferred to fired:
        ``execute`` runs again, and the run that stopped continues from its record with the
        trigger's event as the deferred calls' results (``airflow.deferral``); or, when a call
        whose ``on_timeout`` is ``"fail"`` timed out, the task ends as ``timeout`` (raises
        [`TaskCancelled`][]). Needs nothing but ``event`` (``dag.test()`` hands a resumed task
        the event alone); ``waits``, the try's earlier waits, where Airflow passes them."""
        from cancellable_agents.airflow.deferral import answers_from_event, end_if_timed_out, note_wait

        task_try = self.task_try(context)
        task_try.answers = answers_from_event(event)
        note_wait(task_try, event, waits)
        if (timed_out := end_if_timed_out(task_try, event)) is not None:
            raise self.cancelled_error(timed_out)
        return self.execute(context)  # type: ignore[attr-defined]

    def run_timeout(self) -> float | None:
        """Seconds a run started now may take so it ends (as ``timeout``, unwound) ``timeout_margin``
        before ``execution_timeout`` fires; ``None`` without one. ``run_agent_sync`` passes it as
        the run's ``timeout``; a subclass running agents its own way can too."""
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
        task_try = try_of(self)
        if task_try is None:
            # Before the try was made: nothing runs yet, and a signal handler must not build the
            # scope (its import may be half done on this very thread). The try starts cancelled.
            note_kill_before_try(self)
            return
        if is_execution_timeout(sys.exc_info()[1]):
            # Airflow's SIGALRM beat the run's own deadline; execute already exited, so nothing
            # else will unwind the scope: do it here, within the budget, and write the record.
            from cancellable_agents.core.causes import CancelCause

            task_try.scope.cancel(CancelCause.TIMEOUT, detail="execution_timeout")
            self._log_record()
            return
        task_try.kill(self.classify_timeout)

    # -- the record ----------------------------------------------------------------------

    def cancelled_error(self, message: str) -> TaskCancelled:
        """The [`TaskCancelled`][] to raise for this killed task (cause, transcript, usage,
        timeline), with the kill record logged first (once per task instance). For subclasses
        whose own waits notice the kill (``raise self.cancelled_error("killed while ...")``)."""
        from cancellable_agents.airflow.kill_record._task_log import cancelled_error

        return cancelled_error(self.task_try(), getattr(self, "retry_policy", None), message)

    def _log_record(self, exc: TaskCancelled | None = None) -> None:
        """Once per task instance, after the unwind: the kill record into the task log."""
        from cancellable_agents.airflow.kill_record._task_log import log_kill_record

        log_kill_record(self.task_try(), getattr(self, "retry_policy", None), exc)


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
            _refuse(f"{name} must be a positive number of seconds, got {value!r}")
    if operator.timeout_margin < 0:
        _refuse(f"timeout_margin must be >= 0 seconds, got {operator.timeout_margin!r}")
    if operator.cancellation_budget >= GRACE_SECONDS:
        log.warning(
            "cancellation_budget=%.1fs: Airflow SIGKILLs a task %.0fs after SIGTERM, so the unwind is cut "
            "short there; keep it below %.0fs (default %.0fs).",
            operator.cancellation_budget,
            GRACE_SECONDS,
            GRACE_SECONDS,
            OPTIONS["cancellation_budget"].default,
        )


def _setting(operator: Any, name: str, given: float | None) -> float:
    """An operator setting: as given, else a subclass's class attribute, else the deployment's."""
    if given is not None:
        return given
    value = getattr(type(operator), name, None)
    if value is not None:
        return float(value)
    return float(deployment_setting(name))


def _wind_down_setting(
    operator: CancellableAgentMixin, given: float | bool | WindDown | None, on_wind_down: OnWindDown | None
) -> WindDown | None:
    """``wind_down=``: as given, else a subclass's class attribute, else the deployment's seconds.

    Checked against ``execution_timeout`` where the DAG file sets one: a window the author gave
    that is not below it is refused (the error names the fix); the deployment's window is only
    left off for such a task (one deployment value must not break every short task's DAG file).
    """
    explicit = given is not None
    if not explicit:
        given = getattr(type(operator), "wind_down", None) or deployment_setting("wind_down")
    options = wind_down_of(given, on_wind_down)
    if options is None and on_wind_down is not None:
        _refuse(
            f"on_wind_down={on_wind_down!r} does nothing without a wind-down: give wind_down= "
            "(seconds, True or WindDown(...)) or set [cancellable_agents] wind_down"
        )
    timeout: timedelta | None = getattr(operator, "execution_timeout", None)
    if options is None or not timeout:
        return options
    run_timeout = timeout.total_seconds() - operator.timeout_margin
    if explicit or not options.seconds or options.seconds < run_timeout:
        options.check_timeout(run_timeout)
        return options
    log.warning(
        "%s: [cancellable_agents] wind_down=%gs is not below its %gs run (execution_timeout minus "
        "timeout_margin): no wind-down for this task",
        getattr(operator, "task_id", type(operator).__name__),
        options.seconds,
        run_timeout,
    )
    return None


def _durable_options(durable: bool | DurableOptions | None, kwargs: dict[str, Any]) -> DurableOptions | None:
    """``durable=`` as options; the 0.1 keywords (``durable_path=`` ...) still work, with one
    warning each naming the option that replaces them (alone, as before, they turn nothing on)."""
    old = {name: kwargs.pop(name) for name in list(kwargs) if name in _OLD_DURABLE_KEYWORDS}
    for name in old:
        _warn_old_keyword(name)
    options = DurableOptions.of(durable)
    fields = {_OLD_DURABLE_KEYWORDS[name]: value for name, value in old.items() if value is not None}
    if options is None or not fields:
        return options
    return dataclasses.replace(options, **fields)


def _warn_old_keyword(name: str) -> None:
    if name in _warned_old_keywords:
        return
    _warned_old_keywords.add(name)
    warnings.warn(
        f"{name}= is deprecated and goes away in {_OLD_DURABLE_KEYWORDS_GO_IN}: pass "
        f"durable=DurableOptions({_OLD_DURABLE_KEYWORDS[name]}=...) instead",
        DeprecationWarning,
        stacklevel=4,
    )


def _refuse(message: str) -> NoReturn:
    """Raise ``ConfigurationError`` (imported here: a DAG file without the mistake never loads it)."""
    from cancellable_agents.core.exceptions import ConfigurationError

    raise ConfigurationError(message)


def _cancellation_aware(policy: Any) -> Any:
    """Wrap ``policy`` where Airflow has retry policies (3.3+); leave it alone elsewhere."""
    if not has_retry_policies():
        return policy
    from cancellable_agents.airflow.retry import wrap_retry_policy

    return wrap_retry_policy(policy)
