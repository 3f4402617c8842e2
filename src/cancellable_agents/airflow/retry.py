"""``CancellationAwareRetryPolicy``: cancellation is a failure class of its own.

A killed run must not go through a retry classifier, least of all a model-backed one: that
would make a model call inside the 5 s kill window, and its answer could lose to SIGKILL. For a
cancellation this policy decides from the recorded cause alone and never consults ``inner``;
for every other error it defers to ``inner`` (any Airflow ``RetryPolicy``).

Needs Airflow 3.3+ (``airflow.sdk.definitions.retry_policy``); on older Airflow the operators
still raise [`TaskCancelled`][] and log the cause, and importing this module says so.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow._adapter import is_execution_timeout
from cancellable_agents.airflow.task_try import cancellation_of
from cancellable_agents.core.causes import CancelCause, UserAction

__all__ = ["CancellationAwareRetryPolicy"]

try:
    from airflow.sdk.definitions.retry_policy import RetryAction, RetryDecision, RetryPolicy
except ImportError as exc:  # pragma: no cover - exercised only on Airflow < 3.3
    raise ImportError(
        "CancellationAwareRetryPolicy needs Airflow 3.3+ (retry policies). On older Airflow the "
        "operators still raise TaskCancelled with the cause; upgrade Airflow to use retry policies."
    ) from exc

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context

_ACTION_WORDS = {
    RetryAction.FAIL: "not retrying",
    RetryAction.RETRY: "retrying",
    RetryAction.DEFAULT: "task's retry settings apply",
}


class CancellationAwareRetryPolicy(RetryPolicy):
    """Decide retries of cancelled runs by cause; defer everything else to ``inner``.

    :param inner: the policy for ordinary failures (e.g. an ``ExceptionRetryPolicy`` or
        common.ai's ``LLMRetryPolicy``); ``None`` means Airflow's default handling.
    :param on_user: marked failed or success by a user (default ``FAIL``: the user said stop;
        Airflow would otherwise send a retry the server refuses and fire ``on_retry_callback``).
    :param on_cleared: cleared by a user (default ``RETRY``: the next try is already starting,
        which is what ``on_retry_callback`` announces; ``FAIL`` would raise a failure alert).
    :param on_eviction: SIGTERM while the server still has the try running (default ``RETRY``).
    :param on_timeout: ``execution_timeout`` or the run's deadline (default ``DEFAULT``).
    :param on_unknown: the cause could not be decided in time (default ``DEFAULT``).
    :param eviction_delay: retry delay for evictions (``None``: the task's ``retry_delay``).
    """

    def __init__(
        self,
        inner: RetryPolicy | None = None,
        on_user: RetryAction = RetryAction.FAIL,
        on_cleared: RetryAction = RetryAction.RETRY,
        on_eviction: RetryAction = RetryAction.RETRY,
        on_timeout: RetryAction = RetryAction.DEFAULT,
        on_unknown: RetryAction = RetryAction.DEFAULT,
        eviction_delay: timedelta | None = None,
    ) -> None:
        if isinstance(inner, CancellationAwareRetryPolicy):
            inner = inner.inner
        self.inner: RetryPolicy | None = inner
        self.actions = {
            CancelCause.USER: RetryAction(on_user),
            CancelCause.EVICTION: RetryAction(on_eviction),
            CancelCause.TIMEOUT: RetryAction(on_timeout),
            CancelCause.UNKNOWN: RetryAction(on_unknown),
        }
        self.on_cleared = RetryAction(on_cleared)
        self.eviction_delay = eviction_delay

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Context | None = None,
    ) -> RetryDecision:
        cause = cancellation_cause(exception, context)
        if cause is None:
            if self.inner is None:
                return RetryDecision.default()
            return self.inner.evaluate(exception, try_number, max_tries, context)
        return self.decide(cause, _user_action(exception, context))

    def decide(self, cause: CancelCause, user_action: UserAction | None = None) -> RetryDecision:
        """The decision for a cancellation with ``cause`` (a parent cancel counts as its root)."""
        if cause is CancelCause.USER and user_action is UserAction.CLEARED:
            action = self.on_cleared
            reason = f"cancelled: {UserAction.CLEARED.words} — {_ACTION_WORDS[action]}"
            return RetryDecision(action=action, reason=reason)
        action = self.actions.get(cause, self.actions[CancelCause.UNKNOWN])
        reason = f"cancelled: {cause.words} — {_ACTION_WORDS[action]}"
        delay = self.eviction_delay if cause is CancelCause.EVICTION else None
        return RetryDecision(action=action, retry_delay=delay, reason=reason)

    def serialize(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "__type": "CancellationAwareRetryPolicy",
            "actions": {cause.value: action.value for cause, action in self.actions.items()},
            "on_cleared": self.on_cleared.value,
        }
        if self.eviction_delay is not None:
            data["eviction_delay"] = self.eviction_delay.total_seconds()
        if self.inner is not None:
            data["inner"] = {"class": type(self.inner).__qualname__, **_safe_serialize(self.inner)}
        return data

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> CancellationAwareRetryPolicy:
        actions = {CancelCause(k): RetryAction(v) for k, v in data.get("actions", {}).items()}
        delay = data.get("eviction_delay")
        return cls(
            on_user=actions.get(CancelCause.USER, RetryAction.FAIL),
            on_cleared=RetryAction(data.get("on_cleared", "retry")),
            on_eviction=actions.get(CancelCause.EVICTION, RetryAction.RETRY),
            on_timeout=actions.get(CancelCause.TIMEOUT, RetryAction.DEFAULT),
            on_unknown=actions.get(CancelCause.UNKNOWN, RetryAction.DEFAULT),
            eviction_delay=timedelta(seconds=delay) if delay is not None else None,
        )

    def __repr__(self) -> str:
        return f"CancellationAwareRetryPolicy(inner={self.inner!r})"


def cancellation_cause(exception: BaseException, context: Any = None) -> CancelCause | None:
    """The cause if ``exception`` is a cancellation of an agent task, else ``None``.

    A ``TaskCancelled`` carries its cause (a ``PARENT`` cancel counts as its root cause). A bare
    pydantic-ai ``RunCancelled`` or an ``AirflowTaskTimeout`` counts only when the task's scope
    was cancelled, so an unrelated error is never mistaken for a kill.
    """
    from cancellable_agents.core.exceptions import TaskCancelled  # at failure time, not at parse

    if isinstance(exception, TaskCancelled):
        return exception.root_cause or exception.cause
    scope = _task_scope(context)
    if scope is None or not scope.cancelled:
        return None
    if is_execution_timeout(exception):
        return CancelCause.TIMEOUT
    from pydantic_ai.exceptions import RunCancelled

    if isinstance(exception, RunCancelled):
        return scope.root_cause or CancelCause.UNKNOWN
    return None


def _user_action(exception: BaseException, context: Any) -> UserAction | None:
    """Which user action it was (cleared, marked failed ...), from the error or the scope."""
    from cancellable_agents.core.exceptions import TaskCancelled

    if isinstance(exception, TaskCancelled):
        return exception.action
    scope = _task_scope(context)
    return scope.user_action if scope is not None else None


def wrap_retry_policy(policy: RetryPolicy | None) -> CancellationAwareRetryPolicy:
    """``policy`` wrapped so cancellations skip it (idempotent)."""
    if isinstance(policy, CancellationAwareRetryPolicy):
        return policy
    return CancellationAwareRetryPolicy(inner=policy)


def _task_scope(context: Any) -> Any:
    task = context.get("task") if hasattr(context, "get") else None
    return cancellation_of(task) if task is not None else None


def _safe_serialize(policy: RetryPolicy) -> dict[str, Any]:
    try:
        return {"data": policy.serialize()}
    except NotImplementedError:
        return {}
