"""Re-exports :mod:`cancellable_agents.core.causes` (the causes' public import path)."""

from cancellable_agents.core.causes import CancelCause, CauseVerdict, UserAction, bounded

__all__ = ["CancelCause", "CauseVerdict", "UserAction", "bounded"]
