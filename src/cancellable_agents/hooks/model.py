"""``ModelHook``: an Airflow connection (or a bare model id) turned into a pydantic-ai model.

Connection fields: *Model id* (extra ``model``), *Base URL* (host), *API key* (password).
Model ids are pydantic-ai's ``provider:name``; ``test`` is pydantic-ai's keyless ``TestModel``
for demos and tests. A Base URL makes any ``openai:`` model talk to an OpenAI-compatible server
(Ollama, vLLM, LM Studio, the provider's own local test server).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.bases.hook import BaseHook

from cancellable_agents.core.exceptions import ConfigurationError

#: Sent to OpenAI-compatible local servers that want *some* key but check none.
_LOCAL_SERVER_KEY = "not-needed-for-local-servers"


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
        """Return a pydantic-ai ``Model`` (raises :class:`ConfigurationError` naming the fix)."""
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
                f"--conn-host https://api.openai.com/v1 --conn-password $OPENAI_API_KEY "
                f'--conn-extra \'{{"model": "openai:gpt-4o-mini"}}\'`.'
            ) from exc
        extra = conn.extra_dejson or {}
        model = extra.get("model") or extra.get(f"extra__{self.conn_type}__model")
        return conn.host or None, conn.password or None, model

    # Airflow 3.2+ builds the connection form from provider.yaml (``conn-fields``,
    # ``ui-field-behaviour``) and skips these two methods; Airflow 3.1 knows only them. Both read
    # provider.yaml, so the form is the same on every version.

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Hidden, relabelled and placeholder standard fields of the form (Airflow 3.1)."""
        behaviour = _connection_type_info()["ui-field-behaviour"]
        return {key.replace("-", "_"): value for key, value in behaviour.items()}

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The form's extra fields, i.e. *Model id* (Airflow 3.1; its UI stands in for FAB)."""
        from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
        from flask_babel import lazy_gettext
        from wtforms import StringField

        fields = _connection_type_info()["conn-fields"]
        return {
            name: StringField(
                lazy_gettext(f["label"]), description=f.get("description"), widget=BS3TextFieldWidget()
            )
            for name, f in fields.items()
        }

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's *Test* button: the model can be built (no request is sent)."""
        try:
            model = self.get_model()
        except Exception as exc:
            return False, str(exc)
        return True, f"Model {getattr(model, 'model_name', model)!r} is configured"


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
