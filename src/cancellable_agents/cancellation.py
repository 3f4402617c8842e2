"""Re-exports :mod:`cancellable_agents.core.scope` (the scope's public import path)."""

from cancellable_agents.core.record import KillRecord, TimelineEvent
from cancellable_agents.core.scope import (
    DEFAULT_BUDGET,
    Outcome,
    Phase,
    ResourceHandle,
    TaskCancellation,
    current_cancellation,
)

__all__ = [
    "DEFAULT_BUDGET",
    "KillRecord",
    "Outcome",
    "Phase",
    "ResourceHandle",
    "TaskCancellation",
    "TimelineEvent",
    "current_cancellation",
]
