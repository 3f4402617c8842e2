"""``@task.agent``: the decorated function returns the prompt; an agent with tools runs it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION
from airflow.sdk.definitions.context import Context

from cancellable_agents.decorators.llm import prompt_from_callable
from cancellable_agents.operators.agent import AgentOperator


class _AgentDecoratedOperator(DecoratedOperator, AgentOperator):
    """Runs the decorated function to get the prompt, then behaves as :class:`AgentOperator`."""

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *AgentOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **AgentOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.agent"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            prompt=SET_DURING_EXECUTION,
            **kwargs,
        )

    def execute(self, context: Context) -> Any:
        self.prompt = prompt_from_callable(self, context)
        return AgentOperator.execute(self, context)


def agent_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> TaskDecorator:
    """Wrap a function returning a prompt into an :class:`AgentOperator` task.

    .. code-block:: python

        @task.agent(model="test", toolsets=[SandboxToolset()])
        def investigate(path: str) -> str:
            return f"List the files under {path} and summarise them."
    """
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=_AgentDecoratedOperator, **kwargs
    )
