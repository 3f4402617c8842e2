"""Run pydantic-ai LLM calls and agents as Airflow tasks, and stop them correctly.

Where each idea lives (data flows down this list; nothing above imports what is below it):

- ``core/``: the cancellation model, Airflow-free. ``scope`` (``TaskCancellation``: cancel,
  children, settle), ``unwind`` (phased release within the budget), ``causes`` (``CancelCause``,
  ``UserAction``), ``record`` (timeline events, ``KillRecord``), ``exceptions`` (``TaskCancelled``,
  built only by ``TaskCancellation.cancelled_error``), ``workers`` (the one job-thread utility).
- ``run/``: the pydantic-ai binding: runs an agent under a scope (tool tracking, tool threads,
  in-flight work stopped before teardown).
- ``durable/``: the continuity record (``durable=True``): journal, fingerprint, stores.
- ``procs/``: ``/proc`` and signals, the descendant reaper.
- ``toolsets/``: the sandbox (protocol, ``attach_sandbox``, the local backend and its bubblewrap
  profiles) and the sub-agent toolset.
- ``airflow/``: the only place that knows Airflow: ``adapter`` (every Airflow fact and version
  shim), ``mixin`` (``CancellableAgentMixin``), ``retry`` (``CancellationAwareRetryPolicy``),
  ``supervisor`` (a lost supervisor is a kill), ``durable`` (the store and try of a task),
  ``kill_report`` (what Airflow logs after our record).
- ``operators/``, ``decorators/``, ``hooks/``: what DAG authors use; ``common_ai``: common.ai's
  operators with these semantics (optional extra).

The package imports lazily: the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TaskCancellation": "cancellable_agents.core.scope",
    "current_cancellation": "cancellable_agents.core.scope",
    "CancelCause": "cancellable_agents.core.causes",
    "UserAction": "cancellable_agents.core.causes",
    "Phase": "cancellable_agents.core.unwind",
    "Outcome": "cancellable_agents.core.scope",
    "KillRecord": "cancellable_agents.core.record",
    "TimelineEvent": "cancellable_agents.core.record",
    "ConfigurationError": "cancellable_agents.core.exceptions",
    "TaskCancelled": "cancellable_agents.core.exceptions",
    "CancellableAgentMixin": "cancellable_agents.airflow.mixin",
    "cancellation_of": "cancellable_agents.airflow.task_scope",
    "CancellationAwareRetryPolicy": "cancellable_agents.airflow.retry",
    "LLMOperator": "cancellable_agents.operators.llm",
    "AgentOperator": "cancellable_agents.operators.agent",
    "LocalSandbox": "cancellable_agents.toolsets.sandbox",
    "SandboxToolset": "cancellable_agents.toolsets.sandbox",
    "Limits": "cancellable_agents.toolsets.sandbox",
    "attach_sandbox": "cancellable_agents.toolsets.sandbox",
    "SubagentToolset": "cancellable_agents.toolsets.subagents",
    "Subagent": "cancellable_agents.toolsets.subagents",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cancellable_agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
