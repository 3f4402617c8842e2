"""``ModelHook``: an Airflow connection (or a bare model id) turned into a pydantic-ai model.

Connection fields: *Model id* (the standard ``schema`` field, relabelled; connections made before
it moved there keep it in extra ``model``), *Base URL* (host), *API key* (password).
Model ids are pydantic-ai's ``provider:name``; ``test`` is pydantic-ai's keyless ``TestModel``
for demos and tests. A Base URL makes any ``openai:`` model talk to an OpenAI-compatible server
(Ollama, vLLM, LM Studio, the provider's own local test server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from cancellable_agents.core.exceptions import ConfigurationError

__all__ = ["ModelHook"]

#: Sent to OpenAI-compatible local servers that want *some* key but check none.
_LOCAL_SERVER_KEY = "not-needed-for-local-servers"
#: The form's *Test* button waits this long for the model's answer (the API server waits on it).
TEST_TIMEOUT_S = 20.0
#: The test request's answer size: the test checks reachability, key and model id, not the answer.
_TEST_MAX_TOKENS = 16


class ModelHook(BaseHook):
    """Build the pydantic-ai model an operator runs with.

    :param llm_conn_id: connection of type ``cancellable_agents_model``; optional when ``model``
        names a model pydantic-ai can build from environment variables, or ``test``.
    :param model: model id overriding the connection's (``provider:name`` or ``test``).
    """

    conn_name_attr = "llm_conn_id"
    default_conn_name = "cancellable_agents_default"
    conn_type = "cancellable_agents_model"
    hook_name = "LLM model (cancellable agents)"

    def __init__(self, llm_conn_id: str | None = None, model: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.llm_conn_id = llm_conn_id
        self.model_id = model

    def get_model(self) -> Any:
        """Return a pydantic-ai ``Model`` (raises [`ConfigurationError`][] naming the fix)."""
        base_url, api_key, conn_model = self._connection_fields()
        model_id = (self.model_id or conn_model or "").strip()
        if not model_id:
            raise ConfigurationError(
                f"No model id: set `model=` on the operator or the 'Model id' field of connection "
                f"{self.llm_conn_id!r} (e.g. 'openai:gpt-4o-mini', or 'test' for the keyless test model)."
            )
        return build_model(model_id, base_url=base_url, api_key=api_key)

    def _connection_fields(self) -> tuple[str | None, str | None, str | None]:
        if not self.llm_conn_id:
            return None, None, None
        try:
            conn = self.get_connection(self.llm_conn_id)
        except Exception as exc:
            raise ConfigurationError(
                f"Connection {self.llm_conn_id!r} not found ({exc}). Create it, e.g. "
                f"`airflow connections add {self.llm_conn_id} --conn-type cancellable_agents_model "
                f"--conn-schema openai:gpt-4o-mini --conn-host https://api.openai.com/v1 "
                f"--conn-password $OPENAI_API_KEY`."
            ) from exc
        return conn.host or None, conn.password or None, _model_of(conn)

    # Airflow 3.2+ builds the connection form from provider.yaml (``ui-field-behaviour``,
    # ``conn-fields``) and skips these two methods; Airflow 3.1 knows only them. Both read
    # provider.yaml, so the form is the same on every version.

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Hidden, relabelled and placeholder standard fields of the form (Airflow 3.1)."""
        behaviour = _connection_type_info()["ui-field-behaviour"]
        return {key.replace("-", "_"): value for key, value in behaviour.items()}

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The form's extra fields (Airflow 3.1; its UI stands in for FAB). None today: *Model id*
        is a standard field."""
        fields = _connection_type_info().get("conn-fields") or {}
        if not fields:
            return {}
        from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
        from flask_babel import lazy_gettext
        from wtforms import StringField

        return {
            name: StringField(
                lazy_gettext(f["label"]), description=f.get("description"), widget=BS3TextFieldWidget()
            )
            for name, f in fields.items()
        }

    def test_connection(self) -> tuple[bool, str]:
        """The form's *Test* button: one short real request to the model (``test`` runs locally).

        Checks what a task needs: the Base URL answers, the key is accepted, the model id exists.
        Never raises; the message says what failed.
        """
        try:
            model = self.get_model()
            answer = _ask_once(model, TEST_TIMEOUT_S)
        except TimeoutError:
            return False, f"The model did not answer within {TEST_TIMEOUT_S:.0f}s"
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        name = getattr(model, "model_name", model)
        return True, f"Model {name!r} answered: {answer[:60]!r}"


def _model_of(conn: Any) -> str | None:
    """The connection's model id: the *Model id* field (``schema``), else the extra field where
    connections made before it moved keep it."""
    if conn.schema:
        return str(conn.schema)
    extra = conn.extra_dejson or {}
    return extra.get("model") or extra.get(f"extra__{ModelHook.conn_type}__model")


def _ask_once(model: Any, timeout: float) -> str:
    """Send one short prompt to ``model`` and return its text; bounded by ``timeout``.

    On a thread of its own with its own event loop: the API server calls the hook from wherever
    it is, possibly a thread with a running loop.
    """
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    async def ask() -> str:
        agent = Agent(model, output_type=str, retries=0)
        settings = ModelSettings(max_tokens=_TEST_MAX_TOKENS)
        result = await asyncio.wait_for(agent.run("Reply with: ok", model_settings=settings), timeout)
        return str(result.output)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-hook-test") as pool:
        return pool.submit(asyncio.run, ask()).result(timeout + 5)


def _connection_type_info() -> dict[str, Any]:
    """provider.yaml's entry for this connection type."""
    from cancellable_agents.get_provider_info import get_provider_info

    types = get_provider_info()["connection-types"]
    return next(t for t in types if t["connection-type"] == ModelHook.conn_type)


def build_model(model_id: str, *, base_url: str | None = None, api_key: str | None = None) -> Any:
    """Turn ``provider:name`` (+ optional base URL and key) into a pydantic-ai model."""
    if model_id == "test":
        from pydantic_ai.models.test import TestModel

        return TestModel()
    provider, _, name = model_id.partition(":")
    if not name:
        provider, name = "openai", model_id
    if provider in ("ollama", "vllm") and not base_url:
        raise ConfigurationError(
            f"Model {model_id!r} runs on your own server: set the connection's Base URL "
            f"(e.g. http://localhost:11434/v1 for Ollama, http://localhost:8000/v1 for vLLM)."
        )
    if provider in ("openai", "openai-chat", "ollama", "vllm") and base_url:
        return _openai_compatible(name, base_url, api_key)
    if provider == "anthropic" and (base_url or api_key):
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        return AnthropicModel(name, provider=AnthropicProvider(api_key=api_key, base_url=base_url))
    if provider == "openai" and api_key:
        return _openai_compatible(name, None, api_key)
    try:
        from pydantic_ai.models import infer_model

        return infer_model(model_id)
    except Exception as exc:
        raise ConfigurationError(
            f"Cannot build model {model_id!r}: {exc}. Use 'provider:name' (e.g. 'openai:gpt-4o-mini', "
            f"'anthropic:claude-sonnet-4-5'), set a Base URL for OpenAI-compatible servers, or use 'test'."
        ) from exc


def _openai_compatible(name: str, base_url: str | None, api_key: str | None) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    key = api_key or (_LOCAL_SERVER_KEY if base_url else None)
    return OpenAIChatModel(name, provider=OpenAIProvider(base_url=base_url, api_key=key))
