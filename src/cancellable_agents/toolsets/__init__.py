"""Toolsets for agents run as Airflow tasks: each one stops cleanly when the task is cancelled.

- [`cancellable_agents.toolsets.sandbox`][]: ``LocalSandbox`` and ``SandboxToolset``, shell and
  Python commands run as process trees that a cancel terminates and reaps within the budget.
- [`cancellable_agents.toolsets.subagent_toolset`][]: ``SubagentToolset`` and ``Subagent``,
  delegation to sub-agents as a DAG file describes it;
  [`cancellable_agents.toolsets.subagent_tools`][] runs them (``SubagentTools``), each under a
  child scope that the task's cancel reaches first.
- [`cancellable_agents.toolsets._toolset_description`][]: what makes ``SandboxToolset`` and
  ``SubagentToolset`` light descriptions, made into pydantic-ai toolsets when the task runs.

One naming rule for every toolset a DAG file can describe: ``<Feature>Toolset`` is the light
description a DAG file writes (no pydantic-ai import), ``<Feature>Tools`` the pydantic-ai toolset
it becomes when the task runs; a module holding one of them is named after it
(``sandbox/sandbox_toolset.py`` and ``sandbox/sandbox_tools.py``, ``subagent_toolset.py`` and
``subagent_tools.py``).

Submodules are imported on use, so importing this package costs nothing.
"""
