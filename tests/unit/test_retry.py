"""CancellationAwareRetryPolicy: the decision table, and ``inner`` never asked about a kill."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests.airflow_versions import NO_RETRY_POLICIES, has_retry_policies

if not has_retry_policies():
    pytest.skip(NO_RETRY_POLICIES, allow_module_level=True)

from airflow.sdk.definitions.retry_policy import (
    ExceptionRetryPolicy,
    RetryAction,
    RetryDecision,
    RetryPolicy,
    RetryRule,
)
from airflow.sdk.exceptions import AirflowTaskTimeout
from pydantic_ai.exceptions import RunCancelled

from cancellable_agents import CancelCause, CancellationAwareRetryPolicy, TaskCancelled, UserAction
from cancellable_agents.airflow.retry import cancellation_cause, wrap_retry_policy
from cancellable_agents.airflow.task_try import try_for


class MustNotBeAsked(RetryPolicy):
    """An inner policy that fails the test if consulted (stands in for a model-backed one)."""

    def __init__(self) -> None:
        self.calls = 0

    def evaluate(
        self, exception: BaseException, try_number: int, max_tries: int, context: Any = None
    ) -> RetryDecision:
        self.calls += 1
        raise AssertionError(f"inner policy consulted for {exception!r}")


class Counting(RetryPolicy):
    def __init__(self, decision: RetryDecision) -> None:
        self.decision = decision
        self.calls = 0

    def evaluate(
        self, exception: BaseException, try_number: int, max_tries: int, context: Any = None
    ) -> RetryDecision:
        self.calls += 1
        return self.decision


def _cancelled(cause: CancelCause, root: CancelCause | None = None) -> TaskCancelled:
    return TaskCancelled("killed", cause=cause, root_cause=root)


DEFAULT_TABLE = [
    (CancelCause.USER, RetryAction.FAIL, "stopped by a user — not retrying"),
    (CancelCause.EVICTION, RetryAction.RETRY, "the worker is shutting down (eviction) — retrying"),
    (CancelCause.TIMEOUT, RetryAction.DEFAULT, "timed out — task's retry settings apply"),
    (CancelCause.UNKNOWN, RetryAction.DEFAULT, "cause unknown — task's retry settings apply"),
]


@pytest.mark.parametrize(("cause", "action", "reason"), DEFAULT_TABLE)
def test_default_decisions_by_cause_never_ask_inner(
    cause: CancelCause, action: RetryAction, reason: str
) -> None:
    inner = MustNotBeAsked()
    decision = CancellationAwareRetryPolicy(inner=inner).evaluate(_cancelled(cause), 1, 3)
    assert decision.action is action
    assert decision.reason == f"cancelled: {reason}"
    assert inner.calls == 0


@pytest.mark.parametrize("cause", list(CancelCause))
@pytest.mark.parametrize("action", list(RetryAction))
def test_every_cause_can_be_overridden(cause: CancelCause, action: RetryAction) -> None:
    kwargs = {f"on_{c.value}": action for c in CancelCause if c is not CancelCause.PARENT}
    policy = CancellationAwareRetryPolicy(inner=MustNotBeAsked(), **kwargs)
    root = CancelCause.USER if cause is CancelCause.PARENT else None
    assert policy.evaluate(_cancelled(cause, root), 1, 3).action is action


def test_a_clear_retries_by_default_and_can_be_overridden() -> None:
    cleared = TaskCancelled("killed", cause=CancelCause.USER, detail="cleared", action=UserAction.CLEARED)
    decision = CancellationAwareRetryPolicy(inner=MustNotBeAsked()).evaluate(cleared, 1, 3)
    assert decision.action is RetryAction.RETRY
    assert decision.reason == "cancelled: user cleared it — retrying"
    marked = TaskCancelled(
        "killed", cause=CancelCause.USER, detail="marked failed", action=UserAction.MARKED_FAILED
    )
    assert CancellationAwareRetryPolicy().evaluate(marked, 1, 3).action is RetryAction.FAIL
    custom = CancellationAwareRetryPolicy(on_cleared=RetryAction.FAIL)
    assert custom.evaluate(cleared, 1, 3).action is RetryAction.FAIL
    assert CancellationAwareRetryPolicy.deserialize(custom.serialize()).on_cleared is RetryAction.FAIL


def test_parent_cancellation_is_decided_by_its_root_cause() -> None:
    policy = CancellationAwareRetryPolicy(inner=MustNotBeAsked())
    decision = policy.evaluate(_cancelled(CancelCause.PARENT, root=CancelCause.EVICTION), 1, 3)
    assert decision.action is RetryAction.RETRY


def test_eviction_delay_applies_to_evictions_only() -> None:
    policy = CancellationAwareRetryPolicy(eviction_delay=timedelta(seconds=7))
    assert policy.evaluate(_cancelled(CancelCause.EVICTION), 1, 3).retry_delay == timedelta(seconds=7)
    assert policy.evaluate(_cancelled(CancelCause.TIMEOUT), 1, 3).retry_delay is None


def test_other_errors_go_to_inner() -> None:
    inner = Counting(RetryDecision.retry(reason="flaky network"))
    decision = CancellationAwareRetryPolicy(inner=inner).evaluate(ConnectionError("reset"), 2, 3)
    assert inner.calls == 1
    assert decision.reason == "flaky network"


def test_other_errors_without_inner_use_airflow_defaults() -> None:
    assert CancellationAwareRetryPolicy().evaluate(ValueError("x"), 1, 3).action is RetryAction.DEFAULT


def test_wraps_airflow_exception_policy_by_import_path() -> None:
    inner = ExceptionRetryPolicy(rules=[RetryRule(exception="builtins.KeyError", action=RetryAction.FAIL)])
    policy = CancellationAwareRetryPolicy(inner=inner)
    assert policy.evaluate(KeyError("k"), 1, 3).action is RetryAction.FAIL
    assert policy.evaluate(_cancelled(CancelCause.EVICTION), 1, 3).action is RetryAction.RETRY


def test_bare_run_cancelled_counts_only_when_the_task_scope_was_cancelled() -> None:
    class Task:
        pass

    task = Task()
    scope = try_for(task, budget=4.0)[0].scope
    context = {"task": task}
    error = RunCancelled("stopped")
    assert cancellation_cause(error, context) is None, "an unrelated RunCancelled is not a kill"
    scope.cancel(CancelCause.USER)
    assert scope.wait_cause(2) is CancelCause.USER
    assert cancellation_cause(error, context) is CancelCause.USER
    assert cancellation_cause(AirflowTaskTimeout(), context) is CancelCause.TIMEOUT
    inner = MustNotBeAsked()
    assert CancellationAwareRetryPolicy(inner=inner).evaluate(error, 1, 3, context).action is RetryAction.FAIL


def test_wrapping_is_idempotent_and_serializable() -> None:
    inner = ExceptionRetryPolicy(rules=[RetryRule(exception="builtins.KeyError")])
    once = wrap_retry_policy(inner)
    assert wrap_retry_policy(once) is once
    assert CancellationAwareRetryPolicy(inner=once).inner is inner
    data = CancellationAwareRetryPolicy(
        on_timeout=RetryAction.FAIL, eviction_delay=timedelta(seconds=3)
    ).serialize()
    again = CancellationAwareRetryPolicy.deserialize(data)
    assert again.actions[CancelCause.TIMEOUT] is RetryAction.FAIL
    assert again.eviction_delay == timedelta(seconds=3)


def test_operators_wrap_the_users_policy_by_default_with_opt_out() -> None:
    from cancellable_agents import LLMOperator

    inner = Counting(RetryDecision.default())
    wrapped = LLMOperator(task_id="a", model="test", prompt="p", retry_policy=inner)
    assert isinstance(wrapped.retry_policy, CancellationAwareRetryPolicy)
    assert wrapped.retry_policy.inner is inner
    plain = LLMOperator(
        task_id="b", model="test", prompt="p", retry_policy=inner, cancellation_retry_policy=False
    )
    assert plain.retry_policy is inner


def test_task_cancelled_is_importable_by_dotted_path_for_retry_rules() -> None:
    rule = RetryRule(exception="cancellable_agents.TaskCancelled", action=RetryAction.FAIL)
    assert rule.matches(_cancelled(CancelCause.USER))
