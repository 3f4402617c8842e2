"""Re-exports :mod:`cancellable_agents.airflow.mixin` (the mixin's public import path)."""

from cancellable_agents.airflow.mixin import RECORD_PREFIX, CancellableAgentMixin, cancellation_of

__all__ = ["RECORD_PREFIX", "CancellableAgentMixin", "cancellation_of"]
