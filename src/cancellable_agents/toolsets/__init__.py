"""Toolsets for agents run as Airflow tasks: each one stops cleanly when the task is cancelled.

- :mod:`cancellable_agents.toolsets.sandbox`: ``LocalSandbox`` and ``SandboxToolset``, shell and
  Python commands run as process trees that a cancel terminates and reaps within the budget.
- :mod:`cancellable_agents.toolsets.subagents`: ``SubagentToolset`` and ``Subagent``, delegation
  to sub-agents, each under a child scope that the task's cancel reaches first.

Submodules are imported on use, so importing this package costs nothing.
"""
