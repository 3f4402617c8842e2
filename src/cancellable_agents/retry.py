"""Re-exports :mod:`cancellable_agents.airflow.retry` (Airflow 3.3+; the policy's public import path)."""

from cancellable_agents.airflow.retry import (
    CancellationAwareRetryPolicy,
    cancellation_cause,
    wrap_retry_policy,
)

__all__ = ["CancellationAwareRetryPolicy", "cancellation_cause", "wrap_retry_policy"]
