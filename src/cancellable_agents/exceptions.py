"""Re-exports :mod:`cancellable_agents.core.exceptions` (the exceptions' public import path)."""

from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled

__all__ = ["ConfigurationError", "TaskCancelled"]
