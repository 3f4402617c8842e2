"""Run pydantic-ai LLM calls and agents as Airflow tasks, and stop them correctly.

Where each idea lives: ``docs/content/architecture.md`` (the layers and what each owns, every
module, the data flow of a kill, the thread model, the records' formats, the sandbox modes);
``tests/unit/test_layers.py`` holds the code to its layers and its module map.

The package imports lazily: the names below are loaded on first use. Type checkers see them
through the ``TYPE_CHECKING`` imports, which mirror ``_EXPORTS`` (``tests/unit/test_provider.py``
holds the two to each other); ``py.typed`` says the package is typed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cancellable_agents.core._lazy import lazy_exports
from cancellable_agents.core._renamed import renamed_modules

if TYPE_CHECKING:  # ``X as X``: an explicit re-export, for type checkers and linters alike
    from cancellable_agents.airflow.deferral import defer_to as defer_to
    from cancellable_agents.airflow.http_job import HttpJobTrigger as HttpJobTrigger
    from cancellable_agents.airflow.mixin import CancellableAgentMixin as CancellableAgentMixin
    from cancellable_agents.airflow.retry import CancellationAwareRetryPolicy as CancellationAwareRetryPolicy
    from cancellable_agents.airflow.task_try import cancellation_of as cancellation_of
    from cancellable_agents.airflow.triggers import PollTrigger as PollTrigger
    from cancellable_agents.core.causes import CancelCause as CancelCause
    from cancellable_agents.core.causes import UserAction as UserAction
    from cancellable_agents.core.exceptions import CancellableAgentsError as CancellableAgentsError
    from cancellable_agents.core.exceptions import ConfigurationError as ConfigurationError
    from cancellable_agents.core.exceptions import TaskCancelled as TaskCancelled
    from cancellable_agents.core.scope import Outcome as Outcome
    from cancellable_agents.core.scope import TaskCancellation as TaskCancellation
    from cancellable_agents.core.scope import current_cancellation as current_cancellation
    from cancellable_agents.core.timeline import KillRecord as KillRecord
    from cancellable_agents.core.timeline import TimelineEvent as TimelineEvent
    from cancellable_agents.core.unwind import Phase as Phase
    from cancellable_agents.core.wind_down import WindDown as WindDown
    from cancellable_agents.durable.options import DurableOptions as DurableOptions
    from cancellable_agents.operators.agent import AgentOperator as AgentOperator
    from cancellable_agents.operators.llm import LLMOperator as LLMOperator
    from cancellable_agents.run.tool_calls import ToolCall as ToolCall
    from cancellable_agents.run.tool_calls import current_tool_call as current_tool_call
    from cancellable_agents.run.tool_calls import idempotency_headers as idempotency_headers
    from cancellable_agents.toolsets.sandbox import EgressPolicy as EgressPolicy
    from cancellable_agents.toolsets.sandbox import Limits as Limits
    from cancellable_agents.toolsets.sandbox import LocalSandbox as LocalSandbox
    from cancellable_agents.toolsets.sandbox import SandboxToolset as SandboxToolset
    from cancellable_agents.toolsets.sandbox import attach_sandbox as attach_sandbox
    from cancellable_agents.toolsets.subagent_toolset import Subagent as Subagent
    from cancellable_agents.toolsets.subagent_toolset import SubagentToolset as SubagentToolset

__version__ = "0.1.0"

_EXPORTS = {
    "TaskCancellation": "cancellable_agents.core.scope",
    "current_cancellation": "cancellable_agents.core.scope",
    "CancelCause": "cancellable_agents.core.causes",
    "UserAction": "cancellable_agents.core.causes",
    "Phase": "cancellable_agents.core.unwind",
    "Outcome": "cancellable_agents.core.scope",
    "KillRecord": "cancellable_agents.core.timeline",
    "TimelineEvent": "cancellable_agents.core.timeline",
    "CancellableAgentsError": "cancellable_agents.core.exceptions",
    "ConfigurationError": "cancellable_agents.core.exceptions",
    "TaskCancelled": "cancellable_agents.core.exceptions",
    "WindDown": "cancellable_agents.core.wind_down",
    "DurableOptions": "cancellable_agents.durable.options",
    "ToolCall": "cancellable_agents.run.tool_calls",
    "current_tool_call": "cancellable_agents.run.tool_calls",
    "idempotency_headers": "cancellable_agents.run.tool_calls",
    "CancellableAgentMixin": "cancellable_agents.airflow.mixin",
    "cancellation_of": "cancellable_agents.airflow.task_try",
    "defer_to": "cancellable_agents.airflow.deferral",
    "PollTrigger": "cancellable_agents.airflow.triggers",
    "HttpJobTrigger": "cancellable_agents.airflow.http_job",
    "CancellationAwareRetryPolicy": "cancellable_agents.airflow.retry",
    "LLMOperator": "cancellable_agents.operators.llm",
    "AgentOperator": "cancellable_agents.operators.agent",
    "LocalSandbox": "cancellable_agents.toolsets.sandbox",
    "SandboxToolset": "cancellable_agents.toolsets.sandbox",
    "Limits": "cancellable_agents.toolsets.sandbox",
    "EgressPolicy": "cancellable_agents.toolsets.sandbox",
    "attach_sandbox": "cancellable_agents.toolsets.sandbox",
    "SubagentToolset": "cancellable_agents.toolsets.subagent_toolset",
    "Subagent": "cancellable_agents.toolsets.subagent_toolset",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

#: Public modules renamed in 0.2.0 (old path -> new): the old path warns once, until 0.3.0.
_RENAMED_MODULES = {
    "cancellable_agents.core.record": "cancellable_agents.core.timeline",
    "cancellable_agents.core.report": "cancellable_agents.airflow.kill_record.document",
    "cancellable_agents.decorators.llm": "cancellable_agents.decorators.llm_task",
    "cancellable_agents.decorators.agent": "cancellable_agents.decorators.agent_task",
    "cancellable_agents.toolsets.sandbox.description": "cancellable_agents.toolsets.sandbox.sandbox_toolset",
    "cancellable_agents.toolsets.sandbox.toolset": "cancellable_agents.toolsets.sandbox.sandbox_tools",
    "cancellable_agents.toolsets.sandbox.local.boundary.egress_policy": (
        "cancellable_agents.toolsets.sandbox.egress_policy"
    ),
    "cancellable_agents.toolsets.sandbox.local.boundary.limits": "cancellable_agents.toolsets.sandbox.limits",
    "cancellable_agents.toolsets.delegation": "cancellable_agents.toolsets.subagent_toolset",
    "cancellable_agents.toolsets.subagents": "cancellable_agents.toolsets.subagent_tools",
}
renamed_modules(_RENAMED_MODULES, removed_in="0.3.0")
