"""Every platform's model built from its Airflow connection: ours (``cancellable_agents_model``)
and common.ai's four model types as they are. Where the wire protocol is OpenAI's (Azure OpenAI,
Groq, Mistral) an agent runs end to end against the scripted server over real HTTP; Bedrock and
Vertex AI are checked on the provider the connection configures (their end-to-end runs are on
their own local servers)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from pydantic_ai import Agent

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.hooks.model import ModelHook
from cancellable_agents.testing.openai_server import ScriptedModelServer

KEY = "sk-from-the-connection"


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as s:
        yield s


@pytest.fixture
def model_server(server: ScriptedModelServer) -> ScriptedModelServer:
    server.reset()
    return server


def _connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: object) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


def _model(monkeypatch: pytest.MonkeyPatch, **fields: object) -> object:
    _connection(monkeypatch, "llm", **fields)
    return ModelHook(llm_conn_id="llm").get_model()


# -- OpenAI wire protocol: an agent end to end --------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        pytest.param(
            {
                "conn_type": "cancellable_agents_model",
                "schema": "azure:echo",
                "extra": {"api_version": "2024-10-21"},
            },
            "/openai/deployments/echo/chat/completions",
            id="azure-ours",
        ),
        pytest.param(
            {"conn_type": "pydanticai_azure", "extra": {"model": "echo"}, "suffix": "/openai/v1"},
            "/openai/v1/chat/completions",
            id="azure-common-ai",
        ),
        pytest.param({"conn_type": "cancellable_agents_model", "schema": "groq:echo"}, None, id="groq"),
        pytest.param({"conn_type": "cancellable_agents_model", "schema": "mistral:echo"}, None, id="mistral"),
        pytest.param({"conn_type": "pydanticai", "extra": {"model": "groq:echo"}}, None, id="groq-common-ai"),
    ],
)
def test_an_agent_runs_end_to_end_on_an_openai_compatible_platform(
    monkeypatch: pytest.MonkeyPatch,
    model_server: ScriptedModelServer,
    fields: dict[str, object],
    path: str | None,
) -> None:
    suffix = str(fields.pop("suffix", ""))
    model = _model(monkeypatch, host=model_server.url + suffix, password=KEY, **fields)
    result = Agent(model).run_sync("ping")
    assert result.output == "echo: ping"
    assert [r.model for r in model_server.requests] == ["echo"]


def test_azure_sends_the_key_and_the_api_version(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(
        monkeypatch,
        conn_type="cancellable_agents_model",
        schema="azure:gpt-4o",
        host="https://contoso.openai.azure.com",
        password=KEY,
        extra={"api_version": "2024-10-21"},
    )
    client = model.client  # type: ignore[attr-defined]
    assert client.api_key == KEY and client._api_version == "2024-10-21"
    assert str(client.base_url) == "https://contoso.openai.azure.com/openai/"


def test_azure_with_an_entra_token(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(
        monkeypatch,
        conn_type="cancellable_agents_model",
        schema="azure:gpt-4o",
        host="https://contoso.openai.azure.com",
        extra={"api_version": "2024-10-21", "azure_ad_token": "entra-token"},
    )
    assert model.client._azure_ad_token == "entra-token"  # type: ignore[attr-defined]


# -- Bedrock, Vertex AI, Gemini API: the provider the connection configures ----------------------


def test_bedrock_from_keys_and_region_in_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai.models.bedrock import BedrockConverseModel

    model = _model(
        monkeypatch,
        conn_type="cancellable_agents_model",
        schema="bedrock:us.anthropic.claude-opus-4-6-v1:0",
        extra={
            "region_name": "eu-west-1",
            "aws_access_key_id": "AKIAEXAMPLE",
            "aws_secret_access_key": "secret",
        },
    )
    assert isinstance(model, BedrockConverseModel)
    assert model.model_name == "us.anthropic.claude-opus-4-6-v1:0"
    client = model.client
    assert client.meta.region_name == "eu-west-1"
    assert client._request_signer._credentials.access_key == "AKIAEXAMPLE"


def test_bedrock_from_an_airflow_aws_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aws_conn_id`` names the AWS connection a task's other AWS work uses (``aws_default``)."""
    _connection(
        monkeypatch,
        "aws_default",
        conn_type="aws",
        login="AKIAFROMAWSCONN",
        password="secret",
        extra={"region_name": "ap-southeast-2"},
    )
    model = _model(
        monkeypatch,
        conn_type="cancellable_agents_model",
        schema="bedrock:amazon.nova-pro-v1:0",
        extra={"aws_conn_id": "aws_default", "aws_read_timeout": 45},
    )
    client = model.client  # type: ignore[attr-defined]
    assert client.meta.region_name == "ap-southeast-2"
    assert client.meta.config.read_timeout == 45.0
    assert client._request_signer._credentials.access_key == "AKIAFROMAWSCONN"


def test_a_role_to_assume_without_the_amazon_provider_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    if "airflow.providers.amazon" in sys.modules or _installed("airflow.providers.amazon"):
        pytest.skip("the amazon provider is installed: it assumes the role")
    _connection(
        monkeypatch,
        "aws_role",
        conn_type="aws",
        extra={"role_arn": "arn:aws:iam::123456789012:role/mwaa-bedrock"},
    )
    with pytest.raises(ConfigurationError, match="apache-airflow-providers-amazon"):
        _model(
            monkeypatch,
            conn_type="cancellable_agents_model",
            schema="bedrock:amazon.nova-pro-v1:0",
            extra={"aws_conn_id": "aws_role", "region_name": "us-east-1"},
        )


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_common_ai_bedrock_connection_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai.models.bedrock import BedrockConverseModel

    model = _model(
        monkeypatch,
        conn_type="pydanticai_bedrock",
        extra={
            "model": "us.anthropic.claude-opus-4-6-v1:0",
            "region_name": "us-east-1",
            "aws_read_timeout": 30,
        },
    )
    assert isinstance(model, BedrockConverseModel)
    assert model.model_name == "us.anthropic.claude-opus-4-6-v1:0"  # a bare name with a ':' of its own
    assert model.client.meta.region_name == "us-east-1"
    assert model.client.meta.config.read_timeout == 30.0


def test_vertex_from_project_and_location(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai.models.google import GoogleModel
    from pydantic_ai.providers.google_cloud import GoogleCloudProvider

    model = _model(
        monkeypatch,
        conn_type="pydanticai_vertex",
        extra={
            "model": "gemini-2.5-flash",
            "project": "composer-project",
            "location": "europe-west4",
            "api_key": "k",
        },
    )
    assert isinstance(model, GoogleModel) and model.model_name == "gemini-2.5-flash"
    assert isinstance(model._provider, GoogleCloudProvider)
    api = model._provider.client._api_client
    assert api.vertexai is True
    assert (api.project, api.location) == ("composer-project", "europe-west4")


def _service_account_key(email: str) -> dict[str, str]:
    """A service account key file's JSON, with a freshly made RSA key (never sent anywhere)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return {
        "type": "service_account",
        "project_id": "composer-project",
        "private_key_id": "1",
        "private_key": pem.decode(),
        "client_email": email,
        "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }


def test_vertex_from_an_airflow_google_cloud_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gcp_conn_id`` names the Google Cloud connection a Composer task's other work uses."""
    from pydantic_ai.models.google import GoogleModel

    email = "composer-worker@composer-project.iam.gserviceaccount.com"
    _connection(
        monkeypatch,
        "google_cloud_default",
        conn_type="google_cloud_platform",
        extra={"keyfile_dict": json.dumps(_service_account_key(email))},
    )
    model = _model(
        monkeypatch,
        conn_type="cancellable_agents_model",
        schema="google-cloud:gemini-2.5-flash",
        extra={"gcp_conn_id": "google_cloud_default", "location": "europe-west4"},
    )
    assert isinstance(model, GoogleModel)
    api = model._provider.client._api_client  # type: ignore[attr-defined]
    assert api.vertexai is True
    assert (api.project, api.location) == ("composer-project", "europe-west4")
    assert api._credentials.service_account_email == email


def test_gemini_api_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai.models.google import GoogleModel
    from pydantic_ai.providers.google import GoogleProvider

    model = _model(
        monkeypatch, conn_type="cancellable_agents_model", schema="google-gla:gemini-2.5-flash", password=KEY
    )
    assert isinstance(model, GoogleModel) and isinstance(model._provider, GoogleProvider)
    assert model._provider.client._api_client.api_key == KEY


# -- errors that name the fix ---------------------------------------------------------------------


def test_a_missing_sdk_names_our_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK hidden from import (it is installed here): the one error names the extra."""
    for name in [
        m
        for m in sys.modules
        if m == "mistralai" or m.startswith(("mistralai.", "pydantic_ai.models.mistral"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mistralai", None)
    with pytest.raises(ConfigurationError, match=r"airflow-provider-cancellable-agents\[mistral\]"):
        _model(
            monkeypatch,
            conn_type="cancellable_agents_model",
            schema="mistral:mistral-large-latest",
            password=KEY,
        )


def test_a_connection_of_another_type_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="not a model connection"):
        _model(monkeypatch, conn_type="http", host="https://example.com")


# -- the Test button ------------------------------------------------------------------------------


def test_the_test_button_tests_each_model_of_a_chain(
    monkeypatch: pytest.MonkeyPatch, model_server: ScriptedModelServer
) -> None:
    _connection(
        monkeypatch,
        "backup",
        conn_type="cancellable_agents_model",
        schema="groq:nope",
        host=model_server.url,
        password=KEY,
    )
    _connection(
        monkeypatch,
        "llm",
        conn_type="cancellable_agents_model",
        schema="azure:echo",
        host=model_server.url,
        password=KEY,
        extra={"api_version": "2024-10-21", "fallback_conn_ids": ["backup"]},
    )
    ok, message = ModelHook(llm_conn_id="llm").test_connection()
    assert not ok, message
    assert message.startswith("llm: Model 'echo' answered: 'echo: Reply with: ok'; backup: Model")
    assert "status_code: 400" in message and "nope" in message, message
    assert [r.model for r in model_server.requests] == ["echo", "nope"]


def test_the_test_button_of_a_blocking_cloud_sdk_does_not_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bedrock's botocore blocks in a thread: an endpoint that takes the request and never answers
    (a listening socket nobody serves) still ends the test, saying what happened."""
    import socket

    from cancellable_agents.hooks import model as model_hook

    monkeypatch.setattr(model_hook, "TEST_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        _connection(
            monkeypatch,
            "llm",
            conn_type="cancellable_agents_model",
            schema="bedrock:amazon.nova-pro-v1:0",
            host=f"http://127.0.0.1:{silent.getsockname()[1]}",
            extra={
                "region_name": "us-east-1",
                "aws_access_key_id": "AKIAEXAMPLE",
                "aws_secret_access_key": "x",
            },
        )
        ok, message = ModelHook(llm_conn_id="llm").test_connection()
    assert not ok
    assert "did not answer within" in message and "API server" in message, message


def test_the_test_button_says_a_wrong_key_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    with ScriptedModelServer(api_key="the-right-key") as server:
        _connection(
            monkeypatch,
            "llm",
            conn_type="cancellable_agents_model",
            schema="openai:echo",
            host=server.base_url,
        )
        for key, expected in (("a-wrong-key", False), ("the-right-key", True)):
            monkeypatch.setenv(
                "AIRFLOW_CONN_LLM",
                json.dumps(
                    {
                        "conn_type": "cancellable_agents_model",
                        "schema": "openai:echo",
                        "host": server.base_url,
                    }
                    | {"password": key}
                ),
            )
            ok, message = ModelHook(llm_conn_id="llm").test_connection()
            assert ok is expected, message
            if not ok:
                assert "401" in message and "Incorrect API key provided" in message, message


# -- the Port field (Airflow 3.3.1-3.3.2's Test button needs one stored) --------------------------


@pytest.mark.parametrize(
    ("base_url", "port", "expected"),
    [
        ("http://127.0.0.1/v1", 8765, "http://127.0.0.1:8765/v1"),
        ("http://127.0.0.1:8765/v1", 8765, "http://127.0.0.1:8765/v1"),
        ("https://api.groq.com", 443, "https://api.groq.com"),
        ("https://contoso.openai.azure.com", None, "https://contoso.openai.azure.com"),
        (None, 443, None),
    ],
)
def test_the_port_field_is_the_endpoints_port(
    base_url: str | None, port: int | None, expected: str | None
) -> None:
    from cancellable_agents.hooks.model import with_port

    assert with_port("llm", base_url, port) == expected


def test_a_port_that_contradicts_the_base_url_names_both() -> None:
    from cancellable_agents.hooks.model import with_port

    with pytest.raises(ConfigurationError, match="has port 8765 but the Port field says 9000"):
        with_port("llm", "http://127.0.0.1:8765/v1", 9000)


def test_a_connection_without_a_port_still_works_and_is_told_once_what_to_set(
    monkeypatch: pytest.MonkeyPatch, model_server: ScriptedModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    from cancellable_agents.hooks import model as model_hook

    monkeypatch.setattr(model_hook, "_TEST_BUTTON_NEEDS_A_PORT", frozenset({_airflow_version()}))
    monkeypatch.setattr(model_hook, "_PORT_NOTED", model_hook.Once())
    host = model_server.base_url
    for _ in range(2):
        model = _model(monkeypatch, conn_type="cancellable_agents_model", schema="openai:echo", host=host)
        assert Agent(model).run_sync("hi").output == "echo: hi"
    notes = [r.getMessage() for r in caplog.records if "has no Port" in r.getMessage()]
    assert len(notes) == 1, notes
    assert f"Set its Port to {model_server.port}" in notes[0] and "apache/airflow#73298" in notes[0]


def _airflow_version() -> str:
    from airflow import __version__

    return __version__


# -- every platform's own wire protocol: an agent end to end from its connection -----------------

#: Connections (ours and common.ai's, as they are) whose platform speaks its own wire protocol,
#: each pointed at the scripted server, which speaks them all (`testing/wire_protocols.py`).
#: ``{url}`` is the server's root URL.
_OWN_PROTOCOLS = [
    pytest.param(
        {
            "conn_type": "cancellable_agents_model",
            "schema": "bedrock:echo",
            "host": "{url}",
            "extra": {"region_name": "us-east-1", "aws_access_key_id": KEY, "aws_secret_access_key": "s"},
        },
        "bedrock-converse",
        id="bedrock-ours",
    ),
    pytest.param(
        {
            "conn_type": "pydanticai_bedrock",
            "extra": {
                "model": "echo",
                "base_url": "{url}",
                "region_name": "us-east-1",
                "aws_access_key_id": KEY,
                "aws_secret_access_key": "s",
            },
        },
        "bedrock-converse",
        id="bedrock-common-ai",
    ),
    pytest.param(
        {
            "conn_type": "cancellable_agents_model",
            "schema": "google-gla:echo",
            "host": "{url}",
            "password": KEY,
        },
        "gemini",
        id="gemini-api-ours",
    ),
    pytest.param(
        {"conn_type": "pydanticai", "extra": {"model": "google-gla:echo"}, "host": "{url}", "password": KEY},
        "gemini",
        id="gemini-api-common-ai",
    ),
    pytest.param(
        {
            "conn_type": "cancellable_agents_model",
            "schema": "anthropic:echo",
            "host": "{url}",
            "password": KEY,
        },
        "anthropic",
        id="anthropic-ours",
    ),
]


def _vertex_connections() -> list[object]:
    """Vertex AI from common.ai's type with a service-account key in its extra, and from ours with
    an Airflow Google Cloud connection: the key's ``token_uri`` is the server's token endpoint, so the
    OAuth exchange runs for real (a JWT signed with the key) and yields the token the server wants."""
    key = {
        **_service_account_key("composer-worker@composer-project.iam.gserviceaccount.com"),
        "token_uri": "{url}/token",
    }
    common_ai = {
        "conn_type": "pydanticai_vertex",
        "extra": {
            "model": "echo",
            "project": "composer-project",
            "location": "us-central1",
            "service_account_info": key,
            "base_url": "{url}",
        },
    }
    ours = {
        "conn_type": "cancellable_agents_model",
        "schema": "google-cloud:echo",
        "host": "{url}",
        "extra": {"gcp_conn_id": "google_cloud_vertex", "location": "us-central1"},
        "gcp": {"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": json.dumps(key)}},
    }
    return [
        pytest.param(common_ai, "gemini", id="vertex-common-ai"),
        pytest.param(ours, "gemini", id="vertex-ours-google-cloud-connection"),
    ]


@pytest.mark.parametrize(("fields", "protocol"), _OWN_PROTOCOLS + _vertex_connections())
def test_an_agent_runs_end_to_end_on_each_platforms_own_wire_protocol(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, object], protocol: str
) -> None:
    """The SDK the connection configures really talks to the server, in that platform's protocol,
    with the connection's key (the server refuses any other)."""
    with ScriptedModelServer(api_key=KEY) as keyed:
        filled = json.loads(json.dumps(fields).replace("{url}", keyed.url))
        if "gcp" in filled:
            _connection(monkeypatch, "google_cloud_vertex", **filled.pop("gcp"))
        result = Agent(_model(monkeypatch, **filled)).run_sync("ping")
        assert result.output == "echo: ping"
        assert [(r.model, r.protocol) for r in keyed.requests] == [("echo", protocol)]
