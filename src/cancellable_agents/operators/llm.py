"""``LLMOperator``: one prompt to one model, as a task that stops correctly when killed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.operator import BaseOperator

from cancellable_agents.airflow.mixin import CancellableAgentMixin

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context


class LLMOperator(CancellableAgentMixin, BaseOperator):
    """Send ``prompt`` to a model and return its output (pydantic models as dicts, for XCom).

    :param prompt: the user prompt (templated).
    :param system_prompt: instructions for the model (templated).
    :param output_type: ``str`` (default) or a pydantic model / type for structured output.
    :param llm_conn_id: connection of type ``cancellable_agents_model``.
    :param model: model id overriding the connection's (``openai:gpt-4o-mini``, ``test`` ...).
    :param model_settings: pydantic-ai ``ModelSettings`` (temperature, max_tokens ...).
    :param stream: request a streamed response (tokens arrive as they are generated; a kill
        closes the live stream). Default ``False``.

    Cancellation settings (``cancellation_budget``, ``timeout_margin``, ``classify_timeout``,
    ``reap_descendants``, ``cancellation_retry_policy``) are those of
    :class:`~cancellable_agents.airflow.mixin.CancellableAgentMixin`, and so are the continuity
    settings (``durable``, ``durable_path``, ``resume_after_clear``, ``usage_limits_span_tries``).
    """

    template_fields: Sequence[str] = ("prompt", "system_prompt", "model")
    template_fields_renderers = {"prompt": "md", "system_prompt": "md"}
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        prompt: str = "",
        system_prompt: str = "",
        output_type: Any = str,
        llm_conn_id: str | None = None,
        model: str | None = None,
        model_settings: dict[str, Any] | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.prompt = prompt
        self.system_prompt = system_prompt
        self.output_type = output_type
        self.llm_conn_id = llm_conn_id
        self.model = model
        self.model_settings = model_settings
        self.stream = stream

    def build_agent(self) -> Any:
        """The pydantic-ai agent this task runs (override to customise)."""
        from pydantic_ai import Agent

        from cancellable_agents.hooks.model import ModelHook

        model = ModelHook(llm_conn_id=self.llm_conn_id, model=self.model).get_model()
        return Agent(model, output_type=self.output_type, system_prompt=self.system_prompt or ())

    def run_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``run_sync`` besides the prompt."""
        kwargs: dict[str, Any] = {}
        if self.model_settings:
            kwargs["model_settings"] = self.model_settings
        if self.stream:
            kwargs["event_stream_handler"] = _consume_events
        return kwargs

    def execute(self, context: Context) -> Any:
        result = self.run_agent_sync(self.build_agent(), self.prompt, **self.run_kwargs())
        self.log.info("Run finished: %s", result.usage)
        return _xcom_friendly(result.output)


async def _consume_events(ctx: Any, events: Any) -> None:
    """Passing an event handler makes pydantic-ai stream model responses."""
    async for _ in events:
        pass


def _xcom_friendly(output: Any) -> Any:
    dump = getattr(output, "model_dump", None)
    return dump(mode="json") if callable(dump) else output
