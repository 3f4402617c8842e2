"""Wind-down (issue 41): a run near its deadline or its budget answers with what it has.

Real HTTP to the scripted model server (``loop``: keeps calling its tool for as long as it is
offered, and answers once it is offered none), real pydantic-ai runs under a real scope, real
deadlines (the run's ``timeout=``). What the server saw is the evidence that the last request
offered no tools and carried the final instruction.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.bases.operator import BaseOperator
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RunUsage, UsageLimits

from cancellable_agents import CancellableAgentMixin, LLMOperator, Subagent, SubagentToolset
from cancellable_agents.airflow._metrics import WIND_DOWN_LINE
from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX, parse_records
from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.core.wind_down import (
    DEFAULT_INSTRUCTION,
    DEFAULT_WIND_DOWN_SECONDS,
    WindDown,
    WindDownReport,
    wind_down_of,
)
from cancellable_agents.durable import Journal, MemoryStore
from cancellable_agents.hooks.model import build_model
from cancellable_agents.run._final_request import WindDownState, budget_reason
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from cancellable_agents.testing.records import RequestRecord
from tests.statsd_receiver import StatsdReceiver, metric_tags, metric_value
from tests.unit.durable_runs import Counting, cancel_on

#: Each tool call takes this long: the run makes steady progress until it is told to stop.
STEP = 0.1


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as running:
        yield running


@pytest.fixture
def model_server(server: ScriptedModelServer) -> ScriptedModelServer:
    server.reset()
    return server


def work(n: int) -> str:
    """One step of work (a sync tool, on the run's tool thread)."""
    time.sleep(STEP)
    return f"result {n}"


def _agent(server: ScriptedModelServer, behaviour: str, **kwargs: Any) -> Agent[Any, Any]:
    return Agent(build_model(f"openai:{behaviour}", base_url=server.base_url), tools=[work], **kwargs)


def _run(
    server: ScriptedModelServer, behaviour: str, wind_down: WindDown | None, **run_kwargs: Any
) -> tuple[Any, list[WindDownReport], TaskCancellation]:
    scope = TaskCancellation("wind")
    reports: list[WindDownReport] = []
    result = run_agent_in_scope(
        scope,
        _agent(server, behaviour),
        "go",
        wind_down=wind_down,
        on_wound_down=reports.append,
        **run_kwargs,
    )
    return result, reports, scope


def _system_text(record: RequestRecord) -> str:
    return " ".join(str(m.get("content")) for m in record.messages if m.get("role") == "system")


def _events(scope: TaskCancellation) -> list[str]:
    return [e.event for e in scope.timeline]


# -- the deadline ----------------------------------------------------------------------------


def test_deadline_wind_down_answers_before_the_deadline_without_tools(
    model_server: ScriptedModelServer,
) -> None:
    started = time.monotonic()
    result, reports, scope = _run(model_server, "loop?name=work", WindDown(1.5), timeout=3.0)
    took = time.monotonic() - started
    records = model_server.requests
    assert result.output.startswith("final answer (after ")
    assert took < 3.0, f"the run must end before its deadline, took {took:.2f}s"
    assert not scope.cancelled
    # Every request before the wind-down offered the tool; the last one offered none and said why.
    assert all(r.tools == ["work"] for r in records[:-1]) and len(records) > 2
    assert records[-1].tools == []
    assert DEFAULT_INSTRUCTION in _system_text(records[-1])
    assert DEFAULT_INSTRUCTION not in _system_text(records[-2])
    (report,) = reports
    assert report.reason == "deadline"
    assert 1.0 < report.started_s < 2.0  # at timeout - wind_down, after the step in flight
    assert report.left_s is not None and 1.0 < report.left_s <= 1.5
    assert report.requests_made == len(records) - 1
    assert report.requests_left == 50 - report.requests_made  # pydantic-ai's default request_limit
    assert report.final_answer_s is not None and report.final_answer_s < 1.0
    assert _events(scope).index("wind_down_started") < _events(scope).index("run_wound_down")


def test_a_run_done_before_the_window_never_notices(model_server: ScriptedModelServer) -> None:
    result, reports, scope = _run(model_server, "tool?name=work&then=all+done", WindDown(2.0), timeout=10.0)
    assert result.output == "all done"
    assert reports == []
    assert [r.tools for r in model_server.requests] == [["work"], ["work"]]
    assert "wind_down_started" not in _events(scope)


def test_without_wind_down_the_same_run_is_killed_at_its_deadline(model_server: ScriptedModelServer) -> None:
    with pytest.raises(TaskCancelled) as info:
        _run(model_server, "loop?name=work", None, timeout=1.5)
    assert info.value.cause is CancelCause.TIMEOUT
    assert all(r.tools == ["work"] for r in model_server.requests)


def test_a_final_answer_too_slow_is_killed_at_the_deadline(model_server: ScriptedModelServer) -> None:
    started = time.monotonic()
    with pytest.raises(TaskCancelled) as info:
        _run(model_server, "loop?name=work&final_delay=30", WindDown(1.0), timeout=2.0)
    took = time.monotonic() - started
    assert info.value.cause is CancelCause.TIMEOUT
    assert "deadline passed" in info.value.detail
    assert 1.9 < took < 6.0, f"killed at the deadline (2 s) within the budget, took {took:.2f}s"
    # The server notices the closed connection on its own thread: awaited, not assumed.
    closed = model_server.wait_for_disconnect(timeout=5.0)
    assert closed is not None and closed.index == model_server.requests[-1].index and closed.tools == []


def test_a_model_that_keeps_calling_tools_ends_as_a_timeout(model_server: ScriptedModelServer) -> None:
    with pytest.raises(TaskCancelled) as info:
        _run(model_server, "loop?name=work&stubborn=1", WindDown(1.0), timeout=2.5)
    assert info.value.cause is CancelCause.TIMEOUT
    assert "no final answer" in info.value.detail
    wound = [r for r in model_server.requests if r.tools == []]
    assert wound, "the wind-down's requests offered no tools"


def test_the_authors_instruction_and_a_callable_that_builds_it(model_server: ScriptedModelServer) -> None:
    _run(model_server, "loop?name=work", WindDown(1.0, instruction="Stop and summarise."), timeout=1.5)
    assert "Stop and summarise." in _system_text(model_server.requests[-1])
    model_server.reset()
    seen: list[int] = []

    def build(messages: list[ModelMessage]) -> str:
        seen.append(len(messages))
        return f"Stop now: you made {len(messages)} messages."

    _run(model_server, "loop?name=work", WindDown(1.0, instruction=build), timeout=1.5)
    assert seen and seen[0] > 2
    assert f"you made {seen[0]} messages" in _system_text(model_server.requests[-1])


def test_on_wind_down_fail_ends_as_timeout_with_the_partial_answer(model_server: ScriptedModelServer) -> None:
    with pytest.raises(TaskCancelled) as info:
        _run(model_server, "loop?name=work", WindDown(1.0, on_wind_down="fail"), timeout=1.5)
    error = info.value
    assert error.cause is CancelCause.TIMEOUT
    texts = [getattr(part, "content", "") for message in error.messages for part in message.parts]
    assert any(str(text).startswith("final answer (after ") for text in texts), texts
    assert model_server.requests[-1].tools == []


def test_output_tools_stay_offered_at_the_wind_down() -> None:
    """A structured output's tool is not a function tool: the final request still offers it."""

    class Answer(BaseModel):
        text: str

    offered: list[tuple[list[str], list[str]]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        offered.append(([t.name for t in info.function_tools], [t.name for t in info.output_tools]))
        if info.function_tools:
            time.sleep(STEP)
            return ModelResponse(parts=[ToolCallPart("work", {"n": len(offered)})])
        return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, {"text": "best so far"})])

    agent = Agent(FunctionModel(model), tools=[work], output_type=Answer)
    result = run_agent_in_scope(TaskCancellation(), agent, "go", wind_down=WindDown(1.0), timeout=1.6)
    assert result.output == Answer(text="best so far")
    assert offered[0] == (["work"], ["final_result"])
    assert offered[-1] == ([], ["final_result"])


# -- the budget ------------------------------------------------------------------------------


def test_budget_wind_down_at_the_request_limit(model_server: ScriptedModelServer) -> None:
    result, reports, _ = _run(
        model_server, "loop?name=work", WindDown(budget=True), usage_limits=UsageLimits(request_limit=4)
    )
    assert result.output == "final answer (after 3 tool results)"
    assert [r.tools for r in model_server.requests] == [["work"], ["work"], ["work"], []]
    (report,) = reports
    assert (report.reason, report.requests_made, report.requests_left) == ("request_limit", 3, 1)


def test_without_budget_the_request_limit_raises(model_server: ScriptedModelServer) -> None:
    with pytest.raises(UsageLimitExceeded):
        _run(model_server, "loop?name=work", WindDown(1.0), usage_limits=UsageLimits(request_limit=4))


def test_budget_wind_down_at_the_token_limit_keeps_the_reserve(model_server: ScriptedModelServer) -> None:
    limits = UsageLimits(total_tokens_limit=60)
    with pytest.raises(UsageLimitExceeded):  # the same run without budget wind-down
        _run(model_server, "loop?name=work", None, usage_limits=limits)
    model_server.reset()
    # The default reserve: the largest request so far plus the final instruction's tokens.
    result, reports, _ = _run(model_server, "loop?name=work", WindDown(budget=True), usage_limits=limits)
    assert result.output.startswith("final answer")
    assert result.usage.total_tokens <= 60
    assert reports[0].reason == "tokens_limit"
    assert [r.tools for r in model_server.requests][-2:] == [["work"], []]
    by_default = len(model_server.requests)
    model_server.reset()
    # A larger explicit reserve winds down sooner.
    result, reports, _ = _run(
        model_server, "loop?name=work", WindDown(budget=True, reserve_tokens=50), usage_limits=limits
    )
    assert result.output.startswith("final answer") and reports[0].reason == "tokens_limit"
    assert len(model_server.requests) < by_default


def test_budget_wind_down_at_the_cost_limit(model_server: ScriptedModelServer) -> None:
    limits = UsageLimits(cost_limit=Decimal("0.05"))
    result, reports, _ = _run(
        model_server, "loop?name=work&cost=0.01", WindDown(budget=True), usage_limits=limits
    )
    assert result.output == "final answer (after 4 tool results)"
    assert result.usage.cost == Decimal("0.05")
    assert reports[0].reason == "cost_limit"
    assert [r.tools for r in model_server.requests][-2:] == [["work"], []]


@pytest.mark.parametrize(
    ("usage", "limits", "reserve", "expected"),
    [
        (RunUsage(requests=3), UsageLimits(request_limit=4), 0, "request_limit"),
        (RunUsage(requests=2), UsageLimits(request_limit=4), 0, None),
        (
            RunUsage(requests=1, input_tokens=30, output_tokens=5),
            UsageLimits(total_tokens_limit=50),
            15,
            "tokens_limit",
        ),
        (
            RunUsage(requests=1, input_tokens=30, output_tokens=5),
            UsageLimits(total_tokens_limit=50),
            10,
            None,
        ),
        (RunUsage(requests=1, output_tokens=90), UsageLimits(output_tokens_limit=100), 10, "tokens_limit"),
        (RunUsage(requests=0), UsageLimits(total_tokens_limit=1), 10, None),  # the first request always goes
        (RunUsage(requests=2), None, 0, None),
    ],
)
def test_budget_reason(
    usage: RunUsage, limits: UsageLimits | None, reserve: int, expected: str | None
) -> None:
    assert budget_reason(usage, limits, reserve, 0.0) == expected


def test_budget_reason_at_the_cost_limit() -> None:
    usage = RunUsage(requests=2, cost=Decimal("0.04"))
    limits = UsageLimits(cost_limit=Decimal("0.05"))
    assert budget_reason(usage, limits, 0, 0.01) == "cost_limit"
    assert budget_reason(usage, limits, 0, 0.005) is None


# -- the options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seconds": -1.0}, "wind_down must be >= 0"),
        ({"seconds": float("nan")}, "must be a number of seconds"),
        ({"seconds": 5.0, "on_wind_down": "explode"}, "on_wind_down must be 'answer' or 'fail'"),
        ({"seconds": 5.0, "instruction": 42}, "must be a str or a callable"),
        ({"budget": True, "reserve_tokens": -5}, "reserve_tokens must be >= 0"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        WindDown(**kwargs)


def test_a_window_not_below_the_timeout_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="lower wind_down or raise execution_timeout"):
        WindDown(30.0).check_timeout(28.0)
    WindDown(27.0).check_timeout(28.0)


def test_wind_down_of() -> None:
    assert wind_down_of(None) is None
    assert wind_down_of(0) is None
    assert wind_down_of(False) is None
    assert wind_down_of(True) == WindDown(DEFAULT_WIND_DOWN_SECONDS)
    assert wind_down_of(12) == WindDown(12.0)
    assert wind_down_of(12, "fail") == WindDown(12.0, on_wind_down="fail")
    assert wind_down_of(None, "fail") is None  # on_wind_down alone winds nothing down
    with pytest.raises(ConfigurationError, match="wind_down must be seconds"):
        wind_down_of("soon")


def test_the_report_reads_as_one_line() -> None:
    report = WindDownReport("deadline", 25.04, 6, requests_left=44, left_s=15.0, final_answer_s=3.2)
    assert report.summary() == (
        "wound down 15.0s before the deadline (25.0s into the run, after 6 request(s), 44 request(s) left); "
        "the final answer took 3.20s"
    )
    assert report.as_dict()["final_answer_s"] == 3.2


# -- durable=True ----------------------------------------------------------------------------


def _stepping_agent(calls: list[int], on_call: Any = None) -> Agent[None, str]:
    """A model that calls ``step`` while it is offered, and answers once it is not."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if info.function_tools:
            return ModelResponse(parts=[ToolCallPart("step", {"n": done + 1})])
        return ModelResponse(parts=[TextPart(f"best so far after {done} steps")])

    agent: Agent[None, str] = Agent(FunctionModel(model))

    @agent.tool_plain
    def step(n: int) -> str:
        calls.append(n)
        if on_call is not None:
            on_call(n)
        return f"step {n} ok"

    return agent


def _durable_try(
    store: Any, try_number: int, calls: list[int], on_call: Any = None, spans: bool = False, **kwargs: Any
) -> tuple[Any, Journal]:
    """One try of a durable run: its result, or the ``TaskCancelled`` it raised."""
    scope = TaskCancellation(f"try{try_number}")
    journal = Journal(store, try_number=try_number, scope=scope, usage_spans_tries=spans)
    with scope.activate():
        try:
            result = run_agent_in_scope(
                scope, _stepping_agent(calls, on_call), "work", journal=journal, **kwargs
            )
        except TaskCancelled as exc:
            return exc, journal
    return result, journal


def test_a_durable_record_ends_wound_down_and_the_next_try_starts_fresh() -> None:
    store = Counting()  # like Airflow's task state store, it cannot list keys: the record stays
    calls: list[int] = []
    limits = UsageLimits(request_limit=4)
    result, _ = _durable_try(store, 1, calls, wind_down=WindDown(budget=True), usage_limits=limits)
    assert result.output == "best so far after 3 steps"
    kept = [json.loads(v) if isinstance(v, str) else v for v in store.store.data.values()]
    ended = [e for e in kept if isinstance(e, dict) and e.get("kind") == "end"]
    assert ended and ended[-1]["state"] == "wound_down", ended
    assert ended[-1]["wound_down"]["reason"] == "request_limit"
    # A Clear (or any later try) starts fresh: the wound-down answer was the task's result.
    calls.clear()
    result, journal = _durable_try(store, 2, calls, wind_down=WindDown(budget=True), usage_limits=limits)
    assert journal.resume is None
    assert calls == [1, 2, 3]


def test_budget_wind_down_counts_earlier_tries_where_the_limits_span_them() -> None:
    """``usage_limits_span_tries``: try 2 resumes with try 1's requests counted, so its final,
    tool-less request is the fifth of the task, not of the try."""
    store = MemoryStore()
    limits = UsageLimits(request_limit=5)
    evicted = CauseVerdict(CancelCause.EVICTION, "worker shutdown")
    first, _ = _durable_try(store, 1, [], cancel_on(2, evicted), spans=True, usage_limits=limits)
    assert isinstance(first, TaskCancelled)
    reports: list[WindDownReport] = []
    result, journal = _durable_try(
        store,
        2,
        [],
        spans=True,
        usage_limits=limits,
        wind_down=WindDown(budget=True),
        on_wound_down=reports.append,
    )
    assert journal.resume is not None, "try 2 resumed try 1's record"
    assert result.output.startswith("best so far after ")
    (report,) = reports
    assert (report.reason, report.requests_left) == ("request_limit", 1)
    assert result.usage.requests == 5, "five requests over both tries: the limit, not passed"


# -- the operators ---------------------------------------------------------------------------


class Budgeted(CancellableAgentMixin, BaseOperator):
    """Runs the stepping agent under a request limit of 4 (budget wind-down at request 4)."""

    def execute(self, context: Any) -> Any:
        calls: list[int] = []
        return self.run_agent_sync(
            _stepping_agent(calls), "work", usage_limits=UsageLimits(request_limit=4)
        ).output


def test_an_operator_logs_the_wind_down_and_returns_the_answer(caplog: pytest.LogCaptureFixture) -> None:
    op = Budgeted(task_id="budgeted", wind_down=WindDown(budget=True))
    with caplog.at_level(logging.INFO, logger="cancellable_agents"):
        assert op.execute({}) == "best so far after 3 steps"
    assert "wound down at the request limit" in caplog.text
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(WIND_DOWN_LINE))
    logged = json.loads(line.removeprefix(WIND_DOWN_LINE))
    assert (logged["reason"], logged["requests_made"], logged["requests_left"]) == ("request_limit", 3, 1)
    assert [r.reason for r in op.task_try().wound_down] == ["request_limit"]
    assert RECORD_PREFIX not in caplog.text, "a wound-down run is no kill"
    assert not op.cancellation.cancelled


def test_on_wind_down_fail_is_a_timeout_with_the_partial_answer_in_the_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    op = Budgeted(task_id="strict", wind_down=WindDown(budget=True), on_wind_down="fail")
    with caplog.at_level(logging.INFO, logger="cancellable_agents"), pytest.raises(TaskCancelled) as info:
        op.execute({})
    assert info.value.cause is CancelCause.TIMEOUT
    (record,) = parse_records(caplog.text)
    assert record["cause"] == "timeout"
    assert "on_wind_down='fail', the partial answer: 'best so far after 3 steps'" in record["detail"]
    texts = [getattr(part, "content", "") for message in info.value.all_messages() for part in message.parts]
    assert "best so far after 3 steps" in texts, "the whole answer is in the error's transcript"


def test_a_wound_down_run_sends_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("airflow.sdk.observability.stats")
    from tests.unit.test_metrics import _configure_stats, _reset_stats

    receiver = StatsdReceiver()
    try:
        _configure_stats(monkeypatch, receiver.port)
        assert Budgeted(task_id="metered", wind_down=WindDown(budget=True)).execute({})
        got = receiver.wait_for(
            "airflow.cancellable_agents.wind_down.runs",
            "airflow.cancellable_agents.wind_down.final_answer",
            "airflow.cancellable_agents.usage.requests",
        )
    finally:
        _reset_stats()
        receiver.close()
    assert metric_tags(got["airflow.cancellable_agents.wind_down.runs"])["reason"] == "request_limit"
    assert metric_value(got["airflow.cancellable_agents.wind_down.runs"]) == "1|c"
    assert metric_tags(got["airflow.cancellable_agents.usage.requests"])["end"] == "wound_down"


def _llm(task_id: str, timeout_s: float | None = None, **kwargs: Any) -> LLMOperator:
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    return LLMOperator(task_id=task_id, prompt="p", model="test", execution_timeout=timeout, **kwargs)


def test_an_operator_refuses_a_window_not_below_its_timeout() -> None:
    with pytest.raises(ConfigurationError, match="lower wind_down or raise execution_timeout"):
        LLMOperator(
            task_id="t", prompt="p", model="test", execution_timeout=timedelta(seconds=30), wind_down=28
        )
    with pytest.raises(ConfigurationError, match="wind_down must be >= 0"):
        _llm("u", wind_down=-5)
    op = LLMOperator(
        task_id="v", prompt="p", model="test", execution_timeout=timedelta(seconds=30), wind_down=True
    )
    assert op.wind_down == WindDown(DEFAULT_WIND_DOWN_SECONDS)


def test_the_deployment_setting(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert _llm("off", 300).wind_down is None, "off by default"
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__WIND_DOWN", "15")
    long = _llm("long", 300)
    assert long.wind_down == WindDown(15.0)
    with caplog.at_level(logging.WARNING):
        short = LLMOperator(
            task_id="short", prompt="p", model="test", execution_timeout=timedelta(seconds=10)
        )
    assert short.wind_down is None, "the deployment's window is left off where it does not fit"
    assert "no wind-down for this task" in caplog.text
    own = LLMOperator(
        task_id="own", prompt="p", model="test", wind_down=0, execution_timeout=timedelta(minutes=5)
    )
    assert own.wind_down is None, "an operator's own value wins"
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__WIND_DOWN", "soon")
    with pytest.raises(ConfigurationError, match="wind_down"):
        _llm("bad")


# -- sub-agents ------------------------------------------------------------------------------


def test_a_parent_winds_its_running_child_down_first(model_server: ScriptedModelServer) -> None:
    """The child loops on its tool; at the parent's wind-down it answers, its answer is the
    delegation's result, and only then does the parent make its own final, tool-less request."""
    child = Agent(
        build_model("openai:loop?name=work&then=child+answer", base_url=model_server.base_url), tools=[work]
    )
    delegate = 'tool?name=delegate&args={"agent":"worker","task":"dig"}&then=parent+answer'
    parent = Agent(
        build_model(f"openai:{delegate}", base_url=model_server.base_url),
        toolsets=[SubagentToolset([Subagent("worker", child)])],
    )
    scope = TaskCancellation("parent")
    reports: list[WindDownReport] = []
    started = time.monotonic()
    result = run_agent_in_scope(
        scope, parent, "go", wind_down=WindDown(1.5), on_wound_down=reports.append, timeout=3.0
    )
    assert time.monotonic() - started < 3.0
    assert result.output == "parent answer"
    records = model_server.requests
    child_final = next(i for i, r in enumerate(records) if r.model.startswith("loop") and r.tools == [])
    parent_final = max(i for i, r in enumerate(records) if r.model.startswith("tool"))
    assert child_final < parent_final, "the child answered before the parent's final request"
    assert records[parent_final].tools == []
    returned = [
        part.content
        for message in result.all_messages()
        for part in message.parts
        if getattr(part, "tool_name", None) == "delegate" and hasattr(part, "content")
    ]
    assert any("child answer (after " in str(text) for text in returned), returned
    (child_scope,) = scope.children
    assert "run_wound_down" in [e.event for e in child_scope.timeline]
    assert [r.reason for r in reports] == ["deadline"]


def test_the_decorators_take_the_options() -> None:
    from datetime import datetime

    from airflow.sdk import DAG, task

    with DAG("wind_down_decorators", schedule=None, start_date=datetime(2026, 1, 1)) as dag:

        @task.agent(model="test", wind_down=10, execution_timeout=timedelta(seconds=60))
        def agent_task() -> str:
            return "go"

        @task.llm(model="test", wind_down=True, on_wind_down="fail", execution_timeout=timedelta(seconds=60))
        def llm_task() -> str:
            return "go"

        agent_task()
        llm_task()
    found = {t.task_id: getattr(t, "wind_down", None) for t in dag.tasks}
    assert found == {
        "agent_task": WindDown(10.0),
        "llm_task": WindDown(DEFAULT_WIND_DOWN_SECONDS, on_wind_down="fail"),
    }


def test_a_streamed_run_winds_down_too(model_server: ScriptedModelServer) -> None:
    async def drain(ctx: Any, events: Any) -> None:
        async for _ in events:
            pass

    result, reports, _ = _run(
        model_server, "loop?name=work", WindDown(1.0), timeout=1.6, event_stream_handler=drain
    )
    assert result.output.startswith("final answer (after ")
    records = model_server.requests
    assert all(r.stream for r in records) and records[-1].tools == []
    assert [r.reason for r in reports] == ["deadline"]


class _Clock:
    """A clock the test moves (the scope's monotonic clock, injected)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_decision_starts_at_the_window_and_is_never_undone() -> None:
    clock = _Clock()
    started: list[WindDownReport] = []
    state = WindDownState(WindDown(15.0), 125.0, 140.0, clock, 100.0, on_start=started.append)
    ctx: Any = SimpleNamespace(usage=RunUsage(requests=3), usage_limits=UsageLimits(request_limit=10))
    clock.now = 124.999
    assert not state.decide(ctx)
    clock.now = 125.0
    assert state.decide(ctx)
    (report,) = started
    assert (report.reason, report.started_s, report.left_s, report.requests_left) == (
        "deadline",
        25.0,
        15.0,
        7,
    )
    clock.now = 0.0  # whatever the clock says later, the run stays wound down, and starts once
    assert state.decide(ctx) and len(started) == 1
