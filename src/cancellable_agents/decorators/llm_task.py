"""``@task.llm``: the decorated function returns the prompt; the task sends it to the model."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow.sdk.definitions._internal.types import SET_DURING_EXECUTION
from airflow.sdk.definitions.context import Context, context_merge

from cancellable_agents.airflow._adapter import determine_kwargs
from cancellable_agents.operators.llm import LLMOperator

__all__ = ["llm_task"]


class PromptFromCallable(DecoratedOperator):
    """The TaskFlow part of ``@task.llm`` / ``@task.agent``: the function's return value is the
    prompt; the operator the class is combined with does the rest."""

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
        context_merge(context, self.op_kwargs)
        kwargs = determine_kwargs(self.python_callable, self.op_args, context)
        prompt = self.python_callable(*self.op_args, **kwargs)
        if not isinstance(prompt, str) or not prompt.strip():
            raise TypeError(
                f"{getattr(self, 'custom_operator_name', 'TaskFlow')} functions must return the prompt "
                f"as a non-empty string, got {prompt!r}"
            )
        self.prompt = prompt
        # Skip DecoratedOperator.execute (it would only call the function again).
        return super(DecoratedOperator, self).execute(context)


class _LLMDecoratedOperator(PromptFromCallable, LLMOperator):
    """Runs the decorated function to get the prompt, then behaves as [`LLMOperator`][]."""

    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *LLMOperator.template_fields)
    template_fields_renderers: ClassVar[dict[str, str]] = {
        **DecoratedOperator.template_fields_renderers,
        **LLMOperator.template_fields_renderers,
    }
    custom_operator_name: str = "@task.llm"


def llm_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> TaskDecorator:
    """Wrap a function returning a prompt into an [`LLMOperator`][] task.

    .. code-block:: python

        @task.llm(model="openai:gpt-4o-mini", system_prompt="Answer in one word.")
        def capital(country: str) -> str:
            return f"What is the capital of {country}?"
    """
    return task_decorator_factory(
        python_callable=python_callable, decorated_operator_class=_LLMDecoratedOperator, **kwargs
    )
