"""common.ai's own operators, killed with real SIGTERMs through the Task SDK's handler.

``cancellable_agents.common_ai.AgentOperator``/``LLMOperator`` under ``dag.test()`` in a real task
process, models on the local HTTP server. All kill scenarios run as consecutive tasks of one
process (one start, ~15 s on 2 cores); the durable retry gets a process of its own. Each kill is
an eviction (SIGTERM to the task pid only, the server still has the try running), so the cause
must come back ``eviction`` and the wrapped retry policy must say "retry" without asking a model.

Needs apache-airflow-providers-common-ai (``make compat-common-ai``, which sets
``CANCELLABLE_AGENTS_EXPECT_COMMON_AI=1`` and turns the skip into a failure).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("CANCELLABLE_AGENTS_EXPECT_COMMON_AI") != "1":
    pytest.importorskip(
        "airflow.providers.common.ai.operators.agent",
        reason="apache-airflow-providers-common-ai is not installed here; `make compat-common-ai` runs this",
    )

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.airflow_env import airflow_env
from tests.process.common_ai_kills import (
    FALLBACK_MODEL,
    GRACE,
    KILL_SCENARIOS,
    KillResult,
    run_kills,
)

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def kills(
    airflow_home: Path, _model_server_session: ScriptedModelServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, KillResult]:
    """Every kill scenario, once, through ``cancellable_agents.common_ai`` (one task process)."""
    server = _model_server_session
    server.reset()
    env = airflow_env(airflow_home)
    logs = tmp_path_factory.mktemp("common_ai_kills")
    results = {
        r.scenario: r for r in run_kills("ours", KILL_SCENARIOS, server=server, airflow_env=env, log_dir=logs)
    }
    for result in results.values():
        latency = result.raised_ms or float("nan")
        print(f"\n[latency] common.ai {result.scenario}: SIGTERM -> raised {latency:.1f} ms")
    return results


def _passed(kills: dict[str, KillResult], scenario: str) -> KillResult:
    result = kills[scenario]
    assert result.passed, f"{scenario}: {result.problems}\n{result.log_tail}"
    assert result.outcome == "TaskCancelled", result.log_tail
    assert result.raised_ms is not None and result.raised_ms < GRACE * 1000
    assert result.failed is not None and result.failed["cause"] == "eviction", result.failed
    return result


def _timeline(result: KillResult) -> list[str]:
    assert result.failed is not None and result.failed["record"] is not None
    return [e["event"] for e in result.failed["record"]["timeline"]]


def test_kill_before_the_run_makes_no_model_request(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "before_run")
    assert result.requests == []
    assert "execute_refused" in _timeline(result)


def test_streaming_request_is_closed(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "stream")
    (request,) = result.requests
    assert request.stream and request.outcome == "disconnected"


def test_llm_operator_request_is_closed(kills: dict[str, KillResult]) -> None:
    (request,) = _passed(kills, "llm_nonstream").requests
    assert request.outcome == "disconnected"


def test_sync_tool_is_named_and_cannot_hold_the_process(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "sync_tool")
    assert result.failed is not None
    assert result.failed["record"]["stragglers"] == ["sync tool 'slow_sync_tool'"]


def test_tool_subprocess_and_its_setsid_child_are_stopped(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "subprocess")
    assert result.failed is not None
    killed = [k["command"] for k in result.failed["record"]["killed"]]
    assert len([c for c in killed if c.startswith("sleep ")]) == 2, killed  # incl. the setsid one


def test_result_after_the_kill_is_discarded(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "after_result")
    assert "after the result arrived" in result.failed["message"]  # type: ignore[index]


def test_kill_while_waiting_for_human_review_ends_the_wait(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "hitl_wait")
    assert "waiting for human review" in result.failed["message"]  # type: ignore[index]


def test_sandbox_backend_teardown_runs_inside_the_budget(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "sandbox")
    destroyed = next(e for e in result.events if e["event"] == "destroy_finished")
    assert destroyed["pids"], "the backend's destroy found no command to stop"
    assert result.failed is not None
    budget = result.failed["record"]["budget_s"]
    assert destroyed["t"] - result.sent < budget and destroyed["t"] <= result.failed["raised_t"]


def test_fallback_is_not_tried_and_the_retry_policy_asks_no_model(kills: dict[str, KillResult]) -> None:
    result = _passed(kills, "fallback")
    assert [r.model for r in result.requests] == ["slow?tokens=600&delay=0.05"]
    assert FALLBACK_MODEL not in {r.model for r in result.requests}
    assert result.failed is not None and "ExceptionGroup" not in " ".join(result.failed["exc_mro"])
    # common.ai's LLMRetryPolicy (inner) would have sent an "echo" request; the wrapper decided.
    assert (
        "Retry policy decision" in result.log_tail
        and "cancelled: the worker is shutting down (eviction)" in result.log_tail
    )
    usage = result.failed["saved_usage"]  # common.ai's usage budget, read back from the task state store
    assert usage is not None and usage["requests"] == 1, usage


def test_durable_retry_replays_completed_steps(kills: dict[str, KillResult]) -> None:
    result = kills["durable"]
    assert result.passed, f"{result.problems}\n{result.log_tail}"
    failed, retried = result.failed, result.retried
    assert failed is not None and retried is not None
    assert (failed["exc_type"], failed["try_number"]) == ("TaskCancelled", 1)
    # "unknown" only when the cause query outlasts its timeout (a loaded machine); both retry here.
    assert failed["cause"] in ("eviction", "unknown"), failed["message"]
    assert (retried["event"], retried["try_number"]) == ("task_succeeded", 2)
    ran = [e["tool"] for e in result.events if e["event"] == "tool_ran"]
    assert ran.count("fetch_orders") == 1, "a completed tool call ran again on the retry"
    assert ran.count("summarize_orders") == 1  # the in-flight step: at least once, here exactly once
    # Try 1: one request (the tool calls). Try 2: that step replayed from the journal, then the answer.
    first_try = [r for r in result.requests if r.started_at < result.sent]
    assert (len(first_try), len(result.requests)) == (1, 2), [r.model for r in result.requests]
