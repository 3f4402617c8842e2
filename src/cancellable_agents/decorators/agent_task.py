"""``@task.agent``: the decorated function returns the prompt; an agent with tools runs it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from cancellable_agents.decorators.llm_task import PromptFromCallable
from cancellable_agents.operators.agent import AgentOperator

__all__ = ["agent_task"]


class _AgentDecoratedOperator(PromptFromCallable, AgentOperator):
    """Runs the decorated function to get the prompt, then behaves as [`AgentOperator`][]."""

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *AgentOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **AgentOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.agent"


def agent_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> TaskDecorator:
    """Wrap a function returning a prompt into an [`AgentOperator`][] task.

    .. code-block:: python

        @task.agent(model="test", toolsets=[SandboxToolset()])
        def investigate(path: str) -> str:
            return f"List the files under {path} and summarise them."
    """
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=_AgentDecoratedOperator, **kwargs
    )
