"""Kill metrics through Airflow's real ``Stats`` to a real UDP receiver, and the kill's span.

Stats is configured as the Task SDK's ``main()`` configures it in every task process
(``[metrics] statsd_on`` and friends, read from the environment, then ``stats.initialize``), and
sends real statsd datagrams to a socket this test owns on loopback. ``statsd_influxdb_enabled``
puts the tags into the lines, so the test can read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from airflow.sdk.bases.operator import BaseOperator
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel

from cancellable_agents import CancellableAgentMixin, DurableOptions, TaskCancelled
from cancellable_agents.airflow import _metrics as metrics
from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX
from tests.statsd_receiver import StatsdReceiver, airflow_statsd_env, metric_tags, metric_value

stats_module: Any
try:
    from airflow.sdk.observability import stats as stats_module
except ImportError:  # Airflow 3.1: Stats is airflow-core's
    stats_module = None


def _configure_stats(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """Airflow's statsd backend pointed at ``port``, set up as ``task_runner.main()`` does it."""
    _needs_stats_initialize()
    from airflow.sdk.observability.metrics import stats_utils

    for key, value in airflow_statsd_env(port).items():
        monkeypatch.setenv(key, value)
    stats_module.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)


def _needs_stats_initialize() -> None:
    if not hasattr(stats_module, "initialize"):
        pytest.skip("Stats.initialize (how a task process sets Stats up) is the Task SDK's from Airflow 3.3")


@pytest.fixture
def statsd(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatsdReceiver]:
    _needs_stats_initialize()
    receiver = StatsdReceiver()
    _configure_stats(monkeypatch, receiver.port)
    yield receiver
    _reset_stats()
    receiver.close()


def _reset_stats() -> None:
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger

    stats_module.initialize(factory=NoStatsLogger, export_legacy_names=True)


class KilledInTool(CancellableAgentMixin, BaseOperator):
    """Runs an agent whose tool starts a real process and then waits; the test kills the task."""

    def execute(self, context: Any) -> Any:
        agent = Agent(TestModel(call_tools=["work"]))

        @agent.tool_plain
        async def work() -> str:
            self.child = subprocess.Popen(["sleep", "300"])
            self.tool_started.set()
            await asyncio.Event().wait()  # cancelled by the unwind
            return "never"

        return self.run_agent_sync(agent, "go").output


def _kill_in_tool(caplog: pytest.LogCaptureFixture) -> KilledInTool:
    op = KilledInTool(task_id="metrics_task", cancellation_budget=3.0)
    op.tool_started = threading.Event()
    op.pre_execute({})

    def kill_once_the_tool_runs() -> None:
        if op.tool_started.wait(30):
            op.on_kill()

    killer = threading.Thread(target=kill_once_the_tool_runs)
    killer.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TaskCancelled):
            op.execute({})
    finally:
        killer.join(30)
        with contextlib.suppress(psutil.NoSuchProcess, AttributeError):
            psutil.Process(op.child.pid).kill()
    assert RECORD_PREFIX in caplog.text, "the record is logged, metrics or not"
    return op


def test_a_real_kill_sends_its_metrics_to_statsd(
    statsd: StatsdReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    op = _kill_in_tool(caplog)
    got = statsd.wait_for(
        "airflow.cancellable_agents.kills",
        "airflow.cancellable_agents.kill.unwound",
        "airflow.cancellable_agents.kill.released",
        "airflow.cancellable_agents.kill.processes_killed",
        "airflow.cancellable_agents.usage.requests",
    )
    print("\n[statsd received]\n" + "\n".join(statsd.seen))
    kills = metric_tags(got["airflow.cancellable_agents.kills"])
    assert kills["operator"] == "KilledInTool" and kills["task_id"] == "metrics_task"
    assert (kills["cause"], kills["outcome"], kills["action"]) == ("unknown", "cancelled", "none")
    assert metric_value(got["airflow.cancellable_agents.kills"]) == "1|c"
    assert metric_value(got["airflow.cancellable_agents.kill.processes_killed"]) == "1|c"
    assert metric_value(got["airflow.cancellable_agents.usage.requests"]) == "1|c"
    assert metric_tags(got["airflow.cancellable_agents.usage.requests"])["end"] == "cancelled"
    unwound_ms = float(metric_value(got["airflow.cancellable_agents.kill.unwound"]).split("|")[0])
    released_ms = float(metric_value(got["airflow.cancellable_agents.kill.released"]).split("|")[0])
    assert 0 <= unwound_ms <= released_ms <= op.cancellation_budget * 1000
    assert "task_id" not in metric_tags(got["airflow.cancellable_agents.kill.unwound"]), (
        "per-task ids only where Airflow has them"
    )
    assert not [line for line in statsd.seen if "stragglers" in line or "budget_overruns" in line]


def test_a_completed_run_sends_its_usage(statsd: StatsdReceiver) -> None:
    class Completes(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> Any:
            return self.run_agent_sync(Agent(TestModel(custom_output_text="ok")), "hi").output

    assert Completes(task_id="done").execute({}) == "ok"
    got = statsd.wait_for("airflow.cancellable_agents.usage.requests")
    assert metric_tags(got["airflow.cancellable_agents.usage.requests"])["end"] == "completed"
    assert not [line for line in statsd.seen if ".kills" in line], "no kill, no kill metric"


def test_a_dead_receiver_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: each datagram draws an ICMP port-unreachable
    _configure_stats(monkeypatch, port)
    try:
        op = _kill_in_tool(caplog)
    finally:
        _reset_stats()
    assert "metrics/traces not emitted" not in caplog.text
    record_events = [e.event for e in op.cancellation.timeline]
    assert "run_unwound" in record_events


def test_a_failing_backend_warns_once_and_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("statsd exploded")

    monkeypatch.setattr(metrics, "_stats", Broken)
    monkeypatch.setattr(metrics, "_warned", False)
    _kill_in_tool(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        metrics.emit_run_completed(KilledInTool(task_id="again").task_try(), None)
    assert "metrics/traces not emitted" not in caplog.text, "one warning per process, not per try"


def test_the_kill_is_one_span_under_the_task_span(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # What Airflow's [traces] otel_on installs globally, for this test only.
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    with provider.get_tracer("airflow.task_runner").start_as_current_span("worker.metrics_task") as task_span:
        op = _kill_in_tool(caplog)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    span = spans[metrics.SPAN_NAME]
    assert span.parent is not None and span.parent.span_id == task_span.get_span_context().span_id
    attributes = dict(span.attributes or {})
    assert attributes["cancellable_agents.cause"] == "unknown"
    assert attributes["cancellable_agents.outcome"] == "cancelled"
    assert attributes["cancellable_agents.processes_killed"] == 1
    events = [e.name for e in span.events]
    assert events[0] == "kill_received" and "run_unwound" in events and "killed" in events
    assert span.start_time is not None and span.end_time is not None
    assert [e.timestamp for e in span.events] == sorted(e.timestamp for e in span.events)
    assert span.start_time <= span.events[-1].timestamp <= span.end_time
    assert (span.end_time - span.start_time) / 1e9 <= op.cancellation_budget


def test_a_resumed_durable_run_reports_how_it_started_and_what_resuming_saved(
    statsd: StatsdReceiver, tmp_path: Any
) -> None:
    from tests.unit.test_durable_operator import _try

    _, first, outcome = _try(tmp_path, 1, kill_at=3)
    assert isinstance(outcome, TaskCancelled)
    got = statsd.wait_for(
        "airflow.cancellable_agents.durable.runs", "airflow.cancellable_agents.durable.step_write"
    )
    assert metric_tags(got["airflow.cancellable_agents.durable.runs"]) | {"operator": ""} == {
        "operator": "",
        "end": "cancelled",
        "start": "first_try",
        "reason": "no_record",
    }
    assert metric_value(got["airflow.cancellable_agents.durable.step_write"]).endswith("|ms")
    _, second, outcome = _try(tmp_path, 2, kill_at=None)
    assert outcome == "done"
    saved = "airflow.cancellable_agents.durable.saved.requests"
    got = statsd.wait_for(saved, "airflow.cancellable_agents.durable.messages_restored")
    assert metric_value(got[saved]) == f"{len(first)}|c", "the first try's requests were not made again"
    assert "end=completed" in statsd.wait_line("durable.runs,", "start=resumed")
    usage = statsd.wait_line("usage.requests,", "end=completed")
    assert metric_value(usage) == f"{len(second)}|c", "usage counts this try only"


def test_a_try_that_could_not_resume_says_why(statsd: StatsdReceiver, tmp_path: Any) -> None:
    from tests.unit.test_durable_operator import _try

    _, _, outcome = _try(tmp_path, 1, kill_at=3)
    assert isinstance(outcome, TaskCancelled)
    edited = [p for p in tmp_path.rglob("*.json") if "step 2 ok" in p.read_text()]
    assert len(edited) == 1
    edited[0].write_text(edited[0].read_text().replace("step 2 ok", "step 2 FAILED"))
    _, _, outcome = _try(tmp_path, 2, kill_at=None)
    assert outcome == "done"
    line = statsd.wait_line("durable.runs,", "end=completed")
    assert (metric_tags(line)["start"], metric_tags(line)["reason"]) == ("not_resumable", "tampered"), (
        statsd.seen
    )


def test_a_run_that_stopped_recording_says_why(statsd: StatsdReceiver, tmp_path: Any) -> None:
    from cancellable_agents import AgentOperator
    from tests.unit.durable_runs import TI

    broken = threading.Event()

    def step(n: int) -> str:
        """Puts a file where the record's directory is: this call's result cannot be written."""
        (record,) = {path.parent for path in tmp_path.rglob("*.json")}
        record.rename(record.with_name("moved away"))  # at once, though the sibling may be writing
        record.write_text("in the way")
        broken.set()
        return f"step {n} ok"

    def other(n: int) -> str:
        # Still running when step returns, so step's result is appended beside it (the store
        # error surfaces mid-run). Returning first, it would leave step's result to ride with the
        # end entry, and a failed end is a warning, not recording_off (ci, under load).
        assert broken.wait(30), "step never ran beside this call"
        return f"other {n} ok"

    # One response calls both: each result is appended as it returns, beside its sibling.
    agent: Agent[None, str] = Agent(TestModel(call_tools=["step", "other"]), tools=[step, other])
    # Written ahead: the record's folder exists once a tool runs (otherwise it may not yet).
    op = AgentOperator(
        task_id="agent",
        agent=agent,
        prompt="go",
        durable=DurableOptions(path=str(tmp_path), write_ahead=True),
    )
    op.execute({"ti": TI(1)})
    line = statsd.wait_line("durable.recording_off,")
    assert (metric_tags(line)["reason"], metric_tags(line)["end"]) == ("store_error", "completed"), (
        statsd.seen
    )


# -- pydantic-ai's GenAI spans (opt-in) -------------------------------------------------------

SECRET_PROMPT = "the customer's account number is 4711"


class RunsAnAgent(CancellableAgentMixin, BaseOperator):
    """Runs an agent that calls one tool, then answers."""

    def execute(self, context: Any) -> Any:
        agent = Agent(TestModel(call_tools=["lookup"], custom_output_text="the answer"))

        @agent.tool_plain
        def lookup(account: str) -> str:
            return f"balance of {account}: 12"

        return self.run_agent_sync(agent, SECRET_PROMPT).output


@dataclass
class Traced:
    """An in-memory exporter and the tracer provider that feeds it."""

    exporter: Any
    provider: Any

    def get_finished_spans(self) -> Any:
        return self.exporter.get_finished_spans()

    def clear(self) -> None:
        self.exporter.clear()


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Traced:
    """Finished spans of a tracer provider installed as Airflow's ``[traces] otel_on`` installs
    its own (the global one), for this test only."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    return Traced(memory, provider)


def _span_text(spans: Any) -> str:
    """Every attribute and event of ``spans`` as one string: where content would show."""
    parts = []
    for span in spans:
        parts.append(repr(dict(span.attributes or {})))
        parts.extend(repr(dict(e.attributes or {})) for e in span.events)
    return "\n".join(parts)


def _run_under_task_span(exporter: Traced, **operator_kwargs: Any) -> tuple[Any, list[Any]]:
    with exporter.provider.get_tracer("airflow.task_runner").start_as_current_span(
        "worker.genai"
    ) as task_span:
        assert RunsAnAgent(task_id="genai", **operator_kwargs).execute({}) == "the answer"
    spans = [s for s in exporter.get_finished_spans() if s.name != "worker.genai"]
    return task_span, spans


def test_genai_spans_are_off_by_default(exporter: Traced) -> None:
    _, spans = _run_under_task_span(exporter)
    assert spans == []


def test_genai_spans_on_trace_the_run_under_the_task_span_without_content(exporter: Traced) -> None:
    task_span, spans = _run_under_task_span(exporter, genai_spans=True)
    names = [s.name for s in spans]
    assert any(n.startswith("invoke_agent") or n == "agent run" for n in names), names
    assert any(n.startswith("chat ") for n in names), names
    assert any("lookup" in n for n in names), names
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert len(roots) == 1, [r.name for r in roots]
    assert [r.parent.span_id for r in roots if r.parent] == [task_span.get_span_context().span_id] * len(
        roots
    )
    text = _span_text(spans)
    assert "gen_ai" in text, "the GenAI attributes are there"
    for content in ("4711", "balance of", "the answer"):
        assert content not in text, f"message content {content!r} is in a span"


def test_the_fleet_config_turns_genai_spans_and_content_on(
    exporter: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__GENAI_SPANS", "True")
    _, spans = _run_under_task_span(exporter)
    assert spans and "4711" not in _span_text(spans), "config alone turns spans on, content still off"
    exporter.clear()
    _, spans = _run_under_task_span(exporter, genai_spans=False)
    assert spans == [], "the operator's own False wins over the config"
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__GENAI_SPAN_CONTENT", "True")
    _, spans = _run_under_task_span(exporter)
    assert "4711" in _span_text(spans), "content only when the config asks for it"
