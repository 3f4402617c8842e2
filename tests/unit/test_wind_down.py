"""Wind-down (issue 41): a run near its deadline or its budget answers with what it has.

Real HTTP to the scripted model server (``loop``: keeps calling its tool for as long as it is
offered, and answers once it is offered none), real pydantic-ai runs under a real scope, real
deadlines (the run's ``timeout=``). What the server saw is the evidence that the last request
offered no tools and carried the final instruction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RunUsage, UsageLimits

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.core.wind_down import (
    DEFAULT_INSTRUCTION,
    DEFAULT_WIND_DOWN_SECONDS,
    WindDown,
    WindDownReport,
    wind_down_of,
)
from cancellable_agents.hooks.model import build_model
from cancellable_agents.run.final_request import budget_reason
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from cancellable_agents.testing.records import RequestRecord

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
    last = model_server.requests[-1]
    assert last.tools == [] and last.outcome == "disconnected"


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
