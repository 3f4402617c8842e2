"""common.ai's model-backed retry policies, wrapped: a cancellation never reaches the model.

The model is a real OpenAI-compatible HTTP server on loopback (``ScriptedModelServer``) behind a
real common.ai connection, so "zero model calls" is counted where the calls would arrive. The
control cases send an ordinary error through the same wrapped policy and see the request arrive
and the model's answer decide, so these tests fail if the wrapper stops deferring to ``inner``
or if the server is not where the policy looks.

common.ai registers ``@task.llm``/``@task.agent`` too, so it is not in the main dev environment;
``make compat-common-ai`` runs this file in a venv that has it (and sets
``CANCELLABLE_AGENTS_EXPECT_COMMON_AI=1``, which turns the skip into a failure).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from urllib.parse import quote

import pytest

if os.environ.get("CANCELLABLE_AGENTS_EXPECT_COMMON_AI") == "1":
    from airflow.providers.common.ai.policies import retry as common_ai_retry
else:
    common_ai_retry = pytest.importorskip(
        "airflow.providers.common.ai.policies.retry",
        reason="apache-airflow-providers-common-ai is not installed here; `make compat-common-ai` runs this",
    )

from airflow.sdk.definitions.retry_policy import RetryAction, RetryPolicy
from airflow.sdk.exceptions import AirflowTaskTimeout
from pydantic_ai.exceptions import RunCancelled

from cancellable_agents import CancelCause, CancellationAwareRetryPolicy, TaskCancelled, UserAction
from cancellable_agents.airflow.task_try import try_for
from cancellable_agents.testing.openai_server import ScriptedModelServer

CONN_ID = "common_ai_model"
#: What the scripted model answers for an ordinary error: LLMRetryPolicy's structured output.
CLASSIFICATION = {
    "category": "data",
    "should_retry": False,
    "suggested_delay_seconds": 0,
    "reasoning": "bad input rows",
}


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as srv:
        yield srv


@pytest.fixture(autouse=True)
def connection(server: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A common.ai (``pydanticai``) connection pointing at the local server."""
    conn = {"conn_type": "pydanticai", "host": server.base_url, "password": "not-a-real-key"}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(conn))
    server.reset()


def _model(behaviour: str) -> str:
    return f"openai-chat:{behaviour}"


def _classifying_model() -> str:
    args = quote(json.dumps(CLASSIFICATION), safe="")
    return _model(f"tool?name=final_result&args={args}")


def _model_backed_policies() -> dict[str, RetryPolicy]:
    llm = common_ai_retry.LLMRetryPolicy(llm_conn_id=CONN_ID, model_id=_classifying_model(), timeout=10)
    classifier = common_ai_retry.ClassifierRetryPolicy(
        llm_conn_id=CONN_ID,
        model_id=_model("slow?tokens=1000&delay=1"),  # a model that would hang the decision
        timeout=10,
        fallback_policy=common_ai_retry.LLMRetryPolicy(llm_conn_id=CONN_ID, model_id=_classifying_model()),
    )
    return {"LLMRetryPolicy": llm, "ClassifierRetryPolicy": classifier}


def _cancellations() -> list[tuple[BaseException, dict[str, object] | None, RetryAction]]:
    """Every shape a kill reaches the policy in, with what the default table decides for it."""

    class Task:
        pass

    task = Task()
    killed_scope = try_for(task, budget=4.0)[0].scope
    killed_scope.cancel(CancelCause.EVICTION)
    assert killed_scope.wait_cause(2) is CancelCause.EVICTION
    context = {"task": task}
    return [
        (
            TaskCancelled(
                "killed", cause=CancelCause.USER, detail="marked failed", action=UserAction.MARKED_FAILED
            ),
            None,
            RetryAction.FAIL,
        ),
        (
            TaskCancelled("killed", cause=CancelCause.USER, detail="cleared", action=UserAction.CLEARED),
            None,
            RetryAction.RETRY,
        ),
        (TaskCancelled("killed", cause=CancelCause.EVICTION), None, RetryAction.RETRY),
        (TaskCancelled("killed", cause=CancelCause.TIMEOUT), None, RetryAction.DEFAULT),
        (TaskCancelled("killed", cause=CancelCause.UNKNOWN), None, RetryAction.DEFAULT),
        (
            TaskCancelled("killed", cause=CancelCause.PARENT, root_cause=CancelCause.USER),
            None,
            RetryAction.FAIL,
        ),
        (RunCancelled("run cancelled"), context, RetryAction.RETRY),
        (AirflowTaskTimeout(), context, RetryAction.DEFAULT),
    ]


@pytest.mark.parametrize("name", ["LLMRetryPolicy", "ClassifierRetryPolicy"])
def test_a_cancellation_makes_zero_model_calls(name: str, server: ScriptedModelServer) -> None:
    policy = CancellationAwareRetryPolicy(inner=_model_backed_policies()[name])
    for error, context, action in _cancellations():
        decision = policy.evaluate(error, 1, 3, context)  # type: ignore[arg-type]
        assert decision.action is action, (error, decision)
        assert decision.reason is not None
        assert decision.reason.startswith("cancelled: ")
    assert server.request_count == 0, [r.model for r in server.requests]


def test_an_ordinary_error_is_decided_by_the_model(server: ScriptedModelServer) -> None:
    policy = CancellationAwareRetryPolicy(inner=_model_backed_policies()["LLMRetryPolicy"])
    decision = policy.evaluate(ValueError("row 7: expected int, got 'abc'"), 1, 3)
    assert server.request_count == 1
    assert decision.action is RetryAction.FAIL
    assert decision.reason == "data: bad input rows"


def test_an_unrelated_run_cancelled_still_goes_to_the_model(server: ScriptedModelServer) -> None:
    """A ``RunCancelled`` the task's scope did not cause is an ordinary error, not a kill."""
    policy = CancellationAwareRetryPolicy(inner=_model_backed_policies()["LLMRetryPolicy"])
    decision = policy.evaluate(RunCancelled("a sub-run gave up"), 1, 3, {"task": object()})
    assert server.request_count == 1
    assert decision.reason == "data: bad input rows"


def test_the_operators_wrap_a_common_ai_policy_by_default() -> None:
    from cancellable_agents import AgentOperator, LLMOperator

    inner = _model_backed_policies()["LLMRetryPolicy"]
    for operator in (
        LLMOperator(task_id="llm", model="test", prompt="p", retry_policy=inner),
        AgentOperator(task_id="agent", model="test", prompt="p", retry_policy=inner),
    ):
        assert isinstance(operator.retry_policy, CancellationAwareRetryPolicy)
        assert operator.retry_policy.inner is inner
