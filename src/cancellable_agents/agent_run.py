"""Re-exports :mod:`cancellable_agents.run.runner` (the runners' former import path)."""

from cancellable_agents.run.runner import (
    RunTracker,
    current_run_tracker,
    run_agent_in_scope,
    run_agent_in_scope_async,
)

__all__ = ["RunTracker", "current_run_tracker", "run_agent_in_scope", "run_agent_in_scope_async"]
