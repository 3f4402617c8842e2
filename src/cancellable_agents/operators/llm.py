"""``LLMOperator``: one prompt to one model, as a task that stops correctly when killed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.operator import BaseOperator

from cancellable_agents.airflow.mixin import CancellableAgentMixin
from cancellable_agents.core.wind_down import OnWindDown, WindDown
from cancellable_agents.durable.options import DurableOptions

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context

__all__ = ["LLMOperator"]


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
    :param cancellation_budget: seconds the unwind may take once the task is killed (Airflow
        SIGKILLs 5 s after SIGTERM). ``None``: ``[cancellable_agents] cancellation_budget`` (4).
    :param timeout_margin: with ``execution_timeout``, the run stops this much earlier so it ends
        as ``timeout`` with everything unwound. ``None``: ``[cancellable_agents] timeout_margin`` (2).
    :param classify_timeout: how long to wait to learn why the task was killed before recording
        ``unknown``. ``None``: ``[cancellable_agents] classify_timeout`` (1).
    :param reap_descendants: stop processes the task started outside a sandbox (subprocesses,
        MCP stdio servers) when it is killed (Linux). Default ``True``.
    :param cancellation_retry_policy: wrap ``retry_policy`` in
        [`CancellationAwareRetryPolicy`][cancellable_agents.airflow.retry.CancellationAwareRetryPolicy]
        (Airflow 3.3+), so kills are decided by cause and never sent to a retry classifier. Default ``True``.
    :param genai_spans: pydantic-ai's OpenTelemetry GenAI spans for the run: ``True``, ``False``, or
        an ``InstrumentationSettings``. ``None``: ``[cancellable_agents] genai_spans`` (off).
    :param wind_down: with ``execution_timeout``, seconds before the run's deadline at which it
        winds down: the step in flight finishes, the next request offers no function tools and
        asks for a final answer, which becomes the result (success, not a timeout). ``True``: the
        measured default (15 s); a [`WindDown`][cancellable_agents.core.wind_down.WindDown] for the
        final instruction and the budget wind-down. ``None``: ``[cancellable_agents] wind_down``
        (0: off). docs/content/wind-down.md.
    :param on_wind_down: ``"answer"`` (default) or ``"fail"`` (a wound-down answer fails the
        task as ``timeout``, the partial answer in its record).
    :param durable: ``True`` or [`DurableOptions`][cancellable_agents.durable.options.DurableOptions]:
        journal the run so the next try of a killed task resumes where it stopped (docs/content/durable.md).
        Default off.

    Everything else goes to ``BaseOperator`` (``retries``, ``execution_timeout``, ``retry_policy`` ...).
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
        cancellation_budget: float | None = None,
        timeout_margin: float | None = None,
        classify_timeout: float | None = None,
        reap_descendants: bool | None = None,
        cancellation_retry_policy: bool = True,
        genai_spans: Any = None,
        durable: bool | DurableOptions | None = None,
        wind_down: float | bool | WindDown | None = None,
        on_wind_down: OnWindDown | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            cancellation_budget=cancellation_budget,
            timeout_margin=timeout_margin,
            classify_timeout=classify_timeout,
            reap_descendants=reap_descendants,
            cancellation_retry_policy=cancellation_retry_policy,
            genai_spans=genai_spans,
            durable=durable,
            wind_down=wind_down,
            on_wind_down=on_wind_down,
            **kwargs,
        )
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
