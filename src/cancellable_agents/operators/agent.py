"""``AgentOperator``: a pydantic-ai agent with tools, toolsets and deps, as a killable task."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from cancellable_agents.airflow._approval import check_approvals
from cancellable_agents.operators.llm import LLMOperator
from cancellable_agents.toolsets._toolset_description import built

__all__ = ["AgentOperator"]


class AgentOperator(LLMOperator):
    """Run an agent: a model plus tools (functions), toolsets (e.g. a sandbox) and ``deps``.

    Pass either the parts (``tools``, ``toolsets``, ``deps`` and the [`LLMOperator`][]
    arguments) or a ready ``agent``; the task's cancellation scope reaches everything the run
    starts: the model request, async and sync tools, sandboxes and sub-agents.

    :param tools: plain functions or pydantic-ai ``Tool`` objects.
    :param toolsets: toolsets: this provider's (``SandboxToolset``: a light description, made into
        its pydantic-ai toolset when the task runs), or any pydantic-ai toolset (MCP ...).
    :param deps: the run's dependencies, available to tools as ``ctx.deps``.
    :param agent: a pre-built pydantic-ai ``Agent``; the model arguments are then ignored.
    :param usage_limits: pydantic-ai ``UsageLimits`` for the run.
    :param approval_timeout: how long the task waits, without a worker slot, for the answer to a
        tool's approval (``requires_approval`` tools; needs ``durable``; Airflow 3.3+). A
        ``timedelta``; default: no limit. docs/content/approvals.md.
    :param approval_timeout_default: when nobody answers in time: ``"reject"`` (the model is told
        so and goes on; default) or ``"fail"`` (the task fails).

    Every [`LLMOperator`][] argument too (model, cancellation, ``durable``).
    """

    template_fields: Sequence[str] = (*LLMOperator.template_fields,)

    def __init__(
        self,
        *,
        tools: Sequence[Any] = (),
        toolsets: Sequence[Any] = (),
        deps: Any = None,
        agent: Any = None,
        usage_limits: Any = None,
        approval_timeout: timedelta | None = None,
        approval_timeout_default: str = "reject",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.approval_timeout = approval_timeout
        self.approval_timeout_default = approval_timeout_default
        self.tools = list(tools)
        self.toolsets = list(toolsets)
        self.deps = deps
        self.agent = agent
        self.usage_limits = usage_limits
        check_approvals(self, self.tools, self.toolsets, agent)

    def build_agent(self) -> Any:
        if self.agent is not None:
            return self.agent
        from pydantic_ai import Agent

        from cancellable_agents.hooks.model import ModelHook

        model = ModelHook(llm_conn_id=self.llm_conn_id, model=self.model).get_model()
        return Agent(
            model,
            output_type=self.output_type,
            system_prompt=self.system_prompt or (),
            tools=self.tools,
            toolsets=built(self.toolsets),
        )

    def run_kwargs(self) -> dict[str, Any]:
        kwargs = super().run_kwargs()
        if self.deps is not None:
            kwargs["deps"] = self.deps
        if self.usage_limits is not None:
            kwargs["usage_limits"] = self.usage_limits
        return kwargs
