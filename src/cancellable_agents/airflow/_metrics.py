"""Kills, unwinds, resumes and usage as Airflow metrics (``Stats``) and one OpenTelemetry span.

Everything here runs in the task process once a try's end is known: after the kill record is
logged ([`emit_kill`][]) or after a run completed ([`emit_run_completed`][]). It reads only
facts the record already holds, so it cannot change what the record says, and it cannot delay
or break the unwind: every backend call is wrapped, a failure costs one warning per process,
and statsd is UDP (a dead receiver costs a ``sendto``; measured in ``benchmarks/metrics_cost.py``).

The backend is whatever Airflow's config chose (``[metrics] statsd_on``, Datadog, ``otel_on``)
through Airflow's own ``Stats``; the span goes to the tracer provider Airflow's
``[traces] otel_on`` installed, under the task's span. pydantic-ai's own GenAI spans (agent run,
model requests, tool calls) are opt-in: [`genai_spans_capability`][]. Names, tags and units:
``docs/content/metrics.md``.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow.config import deployment_setting
from cancellable_agents.airflow.kill_record.document import KillReport, unwound_ms
from cancellable_agents.core._usage import USAGE_FIELDS, usage_counts

if TYPE_CHECKING:
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.core.wind_down import WindDownReport

log = logging.getLogger(__name__)

#: Every metric name starts with this.
PREFIX = "cancellable_agents."
#: Name of the span that covers one cancellation, from the kill to all released.
SPAN_NAME = "cancellable_agents.cancellation"
#: Where ``Stats`` lives, newest first: common.compat's shim (it re-exports the Task SDK's on
#: 3.2+), then the Task SDK's own module, then airflow-core's (Airflow 3.1).
_STATS_MODULES = ("airflow.providers.common.compat.sdk", "airflow.sdk.observability.stats", "airflow.stats")
#: A span holds at most this many timeline events: a kill of a large process tree records one
#: event per process, and the record in the log has them all anyway.
_MAX_SPAN_EVENTS = 64

_warned = False


@dataclass(frozen=True)
class Tags:
    """The tags of one try's metrics. Low cardinality only: no run ids, prompts or pids."""

    operator: str
    dag_id: str | None = None
    task_id: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    def common(self) -> dict[str, str]:
        """Tags every metric of the try carries."""
        return {"operator": self.operator, **self.extra}

    def per_task(self) -> dict[str, str]:
        """Plus ``dag_id``/``task_id``: only where Airflow's own task metrics have them
        (``ti.finish``, ``task.duration``), so the series stay as many as Airflow's."""
        ids = {k: v for k, v in (("dag_id", self.dag_id), ("task_id", self.task_id)) if v}
        return {**self.common(), **ids}


def tags_of(task_try: TaskTry) -> Tags:
    """The try's tags: its operator's class name, and its DAG and task ids."""
    key = task_try.key
    if key is None:
        return Tags(task_try.operator, task_id=task_try.scope.name)
    return Tags(task_try.operator, key[0], key[1])


# -- what is emitted -------------------------------------------------------------------------


def emit_kill(task_try: TaskTry, report: KillReport) -> None:
    """A killed try's metrics and span, from its record. Never raises."""
    _safely(_emit_kill, tags_of(task_try), report)


def emit_run_completed(task_try: TaskTry, usage: Any, *, wound_down: bool = False) -> None:
    """A completed run's usage and (``durable=True``) how it started, tagged ``end:completed``, or
    ``end:wound_down`` for a run that answered at its wind-down. Never raises."""
    _safely(_emit_completed, tags_of(task_try), task_try, usage, "wound_down" if wound_down else "completed")


#: The task log line that carries a wind-down's report as one JSON object (after the human line).
WIND_DOWN_LINE = "cancellable_agents.wind_down"


def log_wound_down(report: WindDownReport) -> None:
    """The wind-down in the task log: one human line (``wound down ...``), then the report as one
    ``cancellable_agents.wind_down {json}`` line. Never raises."""
    _safely(_log_wound_down, report)


def _log_wound_down(report: WindDownReport) -> None:
    task_log = logging.getLogger("cancellable_agents.airflow.mixin")  # the logger the task log names
    task_log.info("%s", report.summary())
    task_log.info("%s %s", WIND_DOWN_LINE, json.dumps(report.as_dict(), sort_keys=True))


def emit_wound_down(task_try: TaskTry, report: WindDownReport) -> None:
    """A wind-down's metrics: ``wind_down.runs`` (tagged ``reason``), ``wind_down.final_answer``
    (the final request's time), ``wind_down.requests_left`` and ``wind_down.before_deadline``
    (how long before the deadline it started). Never raises."""
    _safely(_emit_wound_down, tags_of(task_try).common(), report)


def _emit_wound_down(tags: dict[str, str], report: WindDownReport) -> None:
    stats = _stats()
    if stats is None:
        return
    tags = {**tags, "reason": report.reason}
    stats.incr(PREFIX + "wind_down.runs", tags=tags)
    if report.final_answer_s is not None:
        stats.timing(PREFIX + "wind_down.final_answer", timedelta(seconds=report.final_answer_s), tags=tags)
    if report.requests_left is not None:
        stats.gauge(PREFIX + "wind_down.requests_left", report.requests_left, tags=tags)
    if report.left_s is not None:
        stats.timing(PREFIX + "wind_down.before_deadline", timedelta(seconds=report.left_s), tags=tags)


def step_write_timer(task_try: TaskTry) -> Callable[[float], None]:
    """What a ``durable=True`` run's journal calls with each step's write time (ms): one
    ``durable.step_write`` sample, sent as the step is recorded (a try SIGKILLed later still
    reported its writes). Never raises."""
    tags = tags_of(task_try).common()

    def emit(ms: float) -> None:
        _safely(_emit_step_write, ms, tags)

    return emit


def emit_deferred_wait(task_try: TaskTry, seconds: float, calls: int) -> None:
    """A deferral ended (the trigger fired): how long the task waited without a worker slot (the
    slot-seconds it freed) and for how many calls. Never raises."""
    _safely(_emit_deferred_wait, seconds, calls, tags_of(task_try).common())


def _emit_deferred_wait(seconds: float, calls: int, tags: dict[str, str]) -> None:
    stats = _stats()
    if stats is not None:
        stats.timing(PREFIX + "deferred.wait", timedelta(seconds=seconds), tags=tags)
        stats.incr(PREFIX + "deferred.calls", count=calls, tags=tags)


def _emit_step_write(ms: float, tags: dict[str, str]) -> None:
    stats = _stats()
    if stats is not None:
        stats.timing(PREFIX + "durable.step_write", timedelta(milliseconds=ms), tags=tags)


def _emit_kill(tags: Tags, report: KillReport) -> None:
    stats = _stats()
    record = report.record
    kill = {
        **tags.common(),
        "cause": str(record.get("cause") or "undecided"),
        "action": report.action.name.lower() if report.action else "none",  # no spaces in tags
        "outcome": str(record.get("outcome") or "unsettled"),
        "retry": _retry_tag(report),
    }
    if stats is not None:
        _emit_kill_metrics(stats, record, report, tags, kill)
        _emit_durable(stats, record.get("attached", {}).get("durable"), {**tags.common(), "end": "cancelled"})
        _emit_usage(stats, _try_usage(record), {**tags.common(), "end": "cancelled"})
    _emit_span(record, kill)


def _emit_kill_metrics(
    stats: Any, record: Mapping[str, Any], report: KillReport, tags: Tags, kill: dict[str, str]
) -> None:
    per_task = {**tags.per_task(), **{k: kill[k] for k in ("cause", "action", "outcome", "retry")}}
    stats.incr(PREFIX + "kills", tags=per_task)
    brief = {k: kill[k] for k in ("operator", "cause", "action")}
    unwound = _event_ms(record, "run_unwound")
    if unwound is not None:
        stats.timing(PREFIX + "kill.unwound", timedelta(milliseconds=unwound), tags=brief)
    released = unwound_ms(record)
    if released is not None:
        stats.timing(
            PREFIX + "kill.released", timedelta(milliseconds=released), tags={**brief, **tags.per_task()}
        )
    stragglers = len(record.get("stragglers") or ())
    counts = {
        "kill.processes_killed": len(record.get("killed") or ()),
        "kill.processes_left": report.processes_left,
        "kill.stragglers": stragglers,
        "kill.budget_overruns": int(_overran(record, released, stragglers)),
    }
    for name, count in counts.items():
        if count:
            stats.incr(PREFIX + name, count, tags=brief)


def _emit_completed(tags: Tags, task_try: TaskTry, usage: Any, ended: str) -> None:
    stats = _stats()
    if stats is None:
        return
    end = {**tags.common(), "end": ended}
    durable = task_try.scope.attached.get("durable")
    _emit_durable(stats, durable, end)
    this_try = (durable or {}).get("usage_this_try") or usage_counts(usage)
    _emit_usage(stats, this_try, end)


def _emit_durable(stats: Any, facts: Mapping[str, Any] | None, tags: dict[str, str]) -> None:
    """How a ``durable=True`` run started (resumed, or fresh and why) and what resuming saved."""
    if not facts:
        return
    resumed = facts.get("resumed_from_try") is not None
    start = "resumed" if resumed else ("first_try" if facts.get("try") == 1 else "not_resumable")
    why = {} if resumed else {"reason": str(facts.get("fresh_start") or "unknown")}
    stats.incr(PREFIX + "durable.runs", tags={**tags, "start": start, **why})
    if not facts.get("recording", True):
        reason = str(facts.get("recording_off") or "unknown")
        stats.incr(PREFIX + "durable.recording_off", tags={**tags, "reason": reason})
    if not resumed:
        return
    counts = {
        "durable.messages_restored": int(facts.get("messages_restored") or 0),
        "durable.tool_calls_rerun": len(facts.get("tool_calls_rerun") or ()),
    }
    # What the earlier tries paid for and this one did not pay again: their recorded usage.
    for name in USAGE_FIELDS:
        counts[f"durable.saved.{name}"] = sum(
            int(t.get(name, 0)) for t in facts.get("usage_earlier_tries") or ()
        )
    for name, count in counts.items():
        if count:
            stats.incr(PREFIX + name, count, tags=tags)


def _emit_usage(stats: Any, usage: Mapping[str, Any] | None, tags: dict[str, str]) -> None:
    """What this try spent: model requests and tokens, as the model reported them."""
    for name in USAGE_FIELDS:
        count = int((usage or {}).get(name) or 0)
        if count:
            stats.incr(f"{PREFIX}usage.{name}", count, tags=tags)


def _emit_span(record: Mapping[str, Any], attributes: dict[str, str]) -> None:
    """One span from the kill to all released, under the current (the task's) span; the
    timeline from the kill on as its events. A no-op unless a tracer provider is installed."""
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - Airflow depends on opentelemetry-api
        return
    origin_ns = int(float(record["wall_origin"]) * 1e9)
    after_kill = [e for e in record.get("timeline") or () if float(e.get("ms", -1)) >= 0]
    end_ms = unwound_ms(record)
    if end_ms is None:
        end_ms = max((float(e["ms"]) for e in after_kill), default=0.0)
    tracer = trace.get_tracer("cancellable_agents")
    span = tracer.start_span(SPAN_NAME, start_time=origin_ns, attributes=_span_attributes(record, attributes))
    if span.is_recording():
        for event in after_kill[:_MAX_SPAN_EVENTS]:
            detail = {k: v for k, v in event.items() if k not in ("event", "ms") and _scalar(v)}
            span.add_event(
                str(event["event"]), attributes=detail, timestamp=origin_ns + int(event["ms"] * 1e6)
            )
    span.end(end_time=origin_ns + int(end_ms * 1e6))


def _span_attributes(record: Mapping[str, Any], tags: dict[str, str]) -> dict[str, Any]:
    attributes: dict[str, Any] = {f"cancellable_agents.{k}": v for k, v in tags.items()}
    attributes["cancellable_agents.detail"] = str(record.get("detail") or "")
    attributes["cancellable_agents.processes_killed"] = len(record.get("killed") or ())
    attributes["cancellable_agents.stragglers"] = len(record.get("stragglers") or ())
    attributes["cancellable_agents.budget_s"] = float(record.get("budget_s") or 0.0)
    return attributes


# -- pydantic-ai's GenAI spans ---------------------------------------------------------------


def genai_spans_capability(setting: Any) -> Any | None:
    """The capability that makes a run emit pydantic-ai's GenAI spans, or ``None`` (off).

    ``setting`` is the operator's ``genai_spans``: ``None`` defers to Airflow's config
    ``[cancellable_agents] genai_spans`` (default off), so a platform team turns them on for the
    fleet; ``True``/``False`` decide for this operator; a pydantic-ai ``InstrumentationSettings``
    is used as given. Unless given settings say otherwise, prompts, completions and tool
    arguments stay out of the spans: ``[cancellable_agents] genai_span_content = True`` puts them
    in (they may hold secrets and personal data, and the spans leave the task for a collector).
    The spans go to the tracer provider Airflow's ``[traces] otel_on`` installed, as the
    cancellation span does, under the current (the task's) span.
    """
    from pydantic_ai.capabilities import Instrumentation
    from pydantic_ai.models.instrumented import InstrumentationSettings

    if isinstance(setting, InstrumentationSettings):
        return Instrumentation(settings=setting)
    if not (deployment_setting("genai_spans") if setting is None else setting):
        return None
    from opentelemetry import trace

    content = bool(deployment_setting("genai_span_content"))
    settings = InstrumentationSettings(
        tracer_provider=trace.get_tracer_provider(),
        include_content=content,
        include_binary_content=content,
    )
    return Instrumentation(settings=settings)


# -- helpers ---------------------------------------------------------------------------------


def _safely(emit: Any, *args: Any) -> None:
    """Run ``emit``; whatever it raises is logged once per process and never passed on."""
    global _warned
    try:
        emit(*args)
    except Exception as exc:
        if not _warned:
            _warned = True
            log.warning("metrics/traces not emitted (the task is unaffected): %r", exc)


@functools.cache
def _stats() -> Any | None:
    """Airflow's ``Stats`` (configured by Airflow), or ``None`` where no Airflow has one."""
    for module in _STATS_MODULES:
        try:
            return importlib.import_module(module).Stats
        except (ImportError, AttributeError):
            continue
    return None


def _retry_tag(report: KillReport) -> str:
    return report.retry.name.lower() if report.retry is not None else "unknown"


def _event_ms(record: Mapping[str, Any], name: str) -> float | None:
    times = [float(e["ms"]) for e in record.get("timeline") or () if e.get("event") == name]
    return max(times) if times else None


def _overran(record: Mapping[str, Any], released_ms: float | None, stragglers: int) -> bool:
    """Whether the unwind took longer than its budget (or left something running past it)."""
    budget_ms = float(record.get("budget_s") or 0.0) * 1000
    return bool(stragglers) or (released_ms is not None and budget_ms > 0 and released_ms > budget_ms)


def _try_usage(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """This try's usage: the journal's (``durable=True``: without earlier tries'), else the run's."""
    durable = record.get("attached", {}).get("durable") or {}
    usage: Mapping[str, Any] | None = durable.get("usage_this_try") or record.get("usage")
    return usage


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))
