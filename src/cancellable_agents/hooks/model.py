"""``ModelHook``: an Airflow connection (or a bare model id) turned into a pydantic-ai model.

Connection fields: *Model id* (the standard ``schema`` field, relabelled; connections made before
it moved there keep it in extra ``model``), *Base URL* (host), *API key* (password), and in the
extra what a cloud platform needs (region, project, API version, the Airflow AWS or Google Cloud
connection to take credentials from: `cancellable_agents.hooks._platforms`) and
``fallback_conn_ids``, the failover chain.
Model ids are pydantic-ai's ``provider:name``; ``test`` is pydantic-ai's keyless ``TestModel``
for demos and tests. A Base URL makes any ``openai:`` model talk to an OpenAI-compatible server
(Ollama, vLLM, LM Studio, the provider's own local test server).

common.ai's model connection types (``pydanticai``, ``pydanticai_azure``, ``pydanticai_bedrock``,
``pydanticai_vertex``) are read as they are, without importing common.ai, so ``llm_conn_id=``
may name one of those unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from airflow.sdk.bases.hook import BaseHook

from cancellable_agents.core._once import Once
from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.hooks._platforms import (
    COMMON_AI_CONN_TYPES,
    OUR_CONN_TYPE,
    ModelConnection,
    forwarded_model_id,
    missing_extra,
    provider_arguments,
    provider_of,
    qualified,
)

__all__ = ["ModelHook"]

log = logging.getLogger(__name__)

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
    :param fallback_conn_ids: connections to fail over to, in order, when the model is down or
        refuses (overrides the connection's extra ``fallback_conn_ids``; ``[]`` turns a chain
        off). A kill never moves to the next one (`cancellable_agents.run._failover`).
    """

    conn_name_attr = "llm_conn_id"
    default_conn_name = "cancellable_agents_default"
    conn_type = "cancellable_agents_model"
    hook_name = "LLM model (cancellable agents)"

    def __init__(
        self,
        llm_conn_id: str | None = None,
        model: str | None = None,
        fallback_conn_ids: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.llm_conn_id = llm_conn_id
        self.model_id = model
        self.fallback_conn_ids = fallback_conn_ids

    def get_model(self) -> Any:
        """Return a pydantic-ai ``Model``, a failover chain when fallbacks are configured (raises
        [`ConfigurationError`][] naming the fix)."""
        conn = self._read(self.llm_conn_id) if self.llm_conn_id else None
        model_id = (self.model_id or (conn.model_id if conn else None) or "").strip()
        if not model_id:
            raise ConfigurationError(
                f"No model id: set `model=` on the operator or the 'Model id' field of connection "
                f"{self.llm_conn_id!r} (e.g. 'openai:gpt-4o-mini', or 'test' for the keyless test model)."
            )
        primary = build_model(model_id, conn=conn)
        fallbacks = self._fallbacks(conn, model_id)
        if not fallbacks:
            return primary
        from cancellable_agents.run._failover import failover

        return failover([(self.llm_conn_id or model_id, primary), *fallbacks])

    def _fallbacks(self, conn: ModelConnection | None, model_id: str) -> list[tuple[str, Any]]:
        """``(connection id, model)`` of each fallback connection, in order. A fallback without a
        model id of its own takes the primary's when that is a bare name, as common.ai does
        (``forwarded_model_id``)."""
        ids = self.fallback_conn_ids
        if ids is None:
            ids = conn.fallback_conn_ids() if conn is not None else []
        chain: list[tuple[str, Any]] = []
        for conn_id in ids:
            if conn_id == self.llm_conn_id or conn_id in (c for c, _ in chain):
                raise ConfigurationError(
                    f"Fallback connection {conn_id!r} is listed twice in the chain of {self.llm_conn_id!r}: "
                    f"list each connection once, the primary not at all."
                )
            fallback = self._read(conn_id)
            fallback_model = fallback.model_id or forwarded_model_id(model_id, conn, fallback)
            if not fallback_model:
                raise ConfigurationError(
                    f"Fallback connection {conn_id!r} has no model id: set its 'Model id' field "
                    f"(extra 'model' on a common.ai connection)."
                )
            chain.append((conn_id, build_model(fallback_model, conn=fallback)))
        return chain

    def _read(self, conn_id: str) -> ModelConnection:
        """Connection ``conn_id`` as a ``ModelConnection``, whichever model type it is."""
        try:
            conn = self.get_connection(conn_id)
        except Exception as exc:
            raise ConfigurationError(
                f"Connection {conn_id!r} not found ({exc}). Create it, e.g. "
                f"`airflow connections add {conn_id} --conn-type cancellable_agents_model "
                f"--conn-schema openai:gpt-4o-mini --conn-host https://api.openai.com/v1 "
                f"--conn-password $OPENAI_API_KEY`."
            ) from exc
        return model_connection(conn)

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
        """The form's *Test* button: one short real request to the model (``test`` runs locally),
        and to each model of a failover chain.

        Checks what a task needs: the Base URL answers, the key is accepted, the model id exists.
        Never raises and never waits past `TEST_TIMEOUT_S` per model (a blocking cloud SDK's
        request is left behind on its thread); the message says what failed, and that the check
        ran on the API server, which may not reach an endpoint the workers reach.
        """
        try:
            model = self.get_model()
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        members = getattr(model, "members", None) or [model]
        results = [_test_one(m) for m in members]
        if len(results) == 1:
            return results[0]
        labels = [getattr(m, "member", "?") for m in members]
        message = "; ".join(f"{label}: {text}" for label, (_, text) in zip(labels, results, strict=True))
        return all(ok for ok, _ in results), message


def _test_one(model: Any) -> tuple[bool, str]:
    """One model's answer to the test prompt, as the *Test* button shows it."""
    try:
        answer = _ask_once(model, TEST_TIMEOUT_S)
    except TimeoutError:
        return False, (
            f"The model did not answer within {TEST_TIMEOUT_S:.0f}s (the test runs on the API server: "
            f"check it can reach the model's endpoint)"
        )
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        if "connect" in message.lower() or "credentials" in message.lower():
            message += (
                " (the test runs on the API server: it must reach the model's endpoint and have its "
                "credentials, which the workers may have and it may not)"
            )
        return False, message
    name = getattr(model, "model_name", model)
    return True, f"Model {name!r} answered: {answer[:60]!r}"


def model_connection(conn: Any) -> ModelConnection:
    """An Airflow connection of a model type read into a ``ModelConnection``.

    Ours keeps the model id in *Model id* (``schema``; connections made before it moved keep it in
    extra ``model``), common.ai's in extra ``model``; common.ai's Bedrock and Vertex types keep a
    Base URL and key in the extra (``base_url``, ``api_key``). Another type is refused, naming
    the types that work.
    """
    conn_type = conn.conn_type or OUR_CONN_TYPE
    if conn_type != OUR_CONN_TYPE and conn_type not in COMMON_AI_CONN_TYPES:
        known = ", ".join([OUR_CONN_TYPE, *COMMON_AI_CONN_TYPES])
        raise ConfigurationError(
            f"Connection {conn.conn_id!r} has type {conn_type!r}, which is not a model connection: "
            f"use one of {known}."
        )
    extra = dict(conn.extra_dejson or {})
    model_id = (conn.schema if conn_type == OUR_CONN_TYPE else None) or extra.get("model")
    model_id = model_id or extra.get(f"extra__{OUR_CONN_TYPE}__model")
    in_extra = conn_type in ("pydanticai_bedrock", "pydanticai_vertex")
    base_url = (extra.get("base_url") if in_extra else conn.host) or None
    if conn_type == OUR_CONN_TYPE:
        base_url = with_port(conn.conn_id, base_url, conn.port)
        if conn.port is None:
            _note_the_port_the_test_button_needs(conn.conn_id, base_url)
    return ModelConnection(
        conn_id=conn.conn_id,
        conn_type=conn_type,
        model_id=str(model_id).strip() if model_id else None,
        base_url=base_url,
        api_key=(extra.get("api_key") if in_extra else conn.password) or None,
        extra=extra,
    )


_DEFAULT_PORTS = {"https": 443, "http": 80}


def endpoint_port(base_url: str | None) -> int:
    """The port a Base URL reaches (its own, else its scheme's; 443 without a Base URL: the
    provider's own HTTPS API)."""
    if not base_url:
        return 443
    parts = urlsplit(base_url)
    return parts.port or _DEFAULT_PORTS.get(parts.scheme, 443)


def with_port(conn_id: str, base_url: str | None, port: int | None) -> str | None:
    """The Base URL with the connection's *Port* in it.

    The *Port* field holds the endpoint's port, so that Airflow 3.3.1-3.3.2's *Test* button
    (which sends ``port: 0`` for a connection without one and is refused) passes: a Base URL
    without a port of its own takes it (unless it is the scheme's default); one with a different
    port of its own is an error naming both. Without a Base URL the port is only for that button.
    """
    if not base_url or port is None:
        return base_url
    parts = urlsplit(base_url)
    if parts.port is not None:
        if parts.port != port:
            raise ConfigurationError(
                f"Connection {conn_id!r}: the Base URL {base_url!r} has port {parts.port} but the Port "
                f"field says {port}: make them the same (or leave the port out of the Base URL)."
            )
        return base_url
    if port == _DEFAULT_PORTS.get(parts.scheme):
        return base_url
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port}"))


_PORT_NOTED = Once()


def _note_the_port_the_test_button_needs(conn_id: str, base_url: str | None) -> None:
    """Warn once per process, on Airflow 3.3.1-3.3.2 only, that a connection without a port fails
    the UI's *Test* button there (apache/airflow#73298), naming the value to set."""
    from airflow import __version__ as airflow_version

    if airflow_version not in _TEST_BUTTON_NEEDS_A_PORT or not _PORT_NOTED.first():
        return
    port = endpoint_port(base_url)
    log.warning(
        "Connection %r has no Port: Airflow %s's Test button refuses it ('The host or port to test "
        "differs from the stored connection', apache/airflow#73298). Set its Port to %d "
        "(`airflow connections delete %s` and add it again with `--conn-port %d`, or edit it in the "
        "UI); tasks work either way.",
        conn_id,
        airflow_version,
        port,
        conn_id,
        port,
    )


#: Airflow versions whose connection *Test* route refuses ``port: 0`` (what their UI sends for
#: a connection without a port) when the stored port is empty.
_TEST_BUTTON_NEEDS_A_PORT = frozenset({"3.3.1", "3.3.2"})


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

    # Not a `with` block: its exit would wait for a thread that a blocking SDK (botocore) keeps in
    # its request past the timeout; the thread is left behind instead, the answer is not waited for.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-hook-test")
    try:
        return pool.submit(asyncio.run, ask()).result(timeout + 5)
    except concurrent.futures.TimeoutError as exc:
        raise TimeoutError from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _connection_type_info() -> dict[str, Any]:
    """provider.yaml's entry for this connection type."""
    from cancellable_agents.get_provider_info import get_provider_info

    types = get_provider_info()["connection-types"]
    return next(t for t in types if t["connection-type"] == ModelHook.conn_type)


def build_model(
    model_id: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    conn: ModelConnection | None = None,
) -> Any:
    """Turn ``provider:name`` into a pydantic-ai model, with the Base URL, key and platform
    settings of ``conn`` (or the ``base_url`` and ``api_key`` given alone)."""
    if model_id == "test":
        from pydantic_ai.models.test import TestModel

        return TestModel()
    if conn is not None:
        model_id = qualified(model_id, conn)
        base_url, api_key = conn.base_url, conn.api_key
        if provider_of(model_id) not in ("openai", "openai-chat", "ollama", "vllm", "anthropic"):
            return _from_provider(model_id, conn)
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
    except ImportError as exc:
        raise missing_extra(model_id, exc) from exc
    except Exception as exc:
        raise ConfigurationError(
            f"Cannot build model {model_id!r}: {exc}. Use 'provider:name' (e.g. 'openai:gpt-4o-mini', "
            f"'anthropic:claude-sonnet-4-5'), set a Base URL for OpenAI-compatible servers, or use 'test'."
        ) from exc


def _from_provider(model_id: str, conn: ModelConnection) -> Any:
    """Any other pydantic-ai provider (Bedrock, Vertex AI, Azure OpenAI, Gemini, Mistral, Groq,
    ...), its provider built from the connection (``provider_arguments``); with nothing in the
    connection, pydantic-ai reads the provider's environment variables."""
    from pydantic_ai.models import infer_model
    from pydantic_ai.providers import infer_provider_class

    try:
        arguments = provider_arguments(model_id, conn)
        if not arguments:
            return infer_model(model_id)
        return infer_model(model_id, provider_factory=lambda name: infer_provider_class(name)(**arguments))
    except ImportError as exc:
        raise missing_extra(model_id, exc) from exc
    except ConfigurationError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            f"Cannot build model {model_id!r} from connection {conn.conn_id!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _openai_compatible(name: str, base_url: str | None, api_key: str | None) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    key = api_key or (_LOCAL_SERVER_KEY if base_url else None)
    return OpenAIChatModel(name, provider=OpenAIProvider(base_url=base_url, api_key=key))
