"""Which pydantic-ai provider a model id names, and the provider's arguments from a connection.

A connection of any of the model connection types (ours, ``cancellable_agents_model``, or
common.ai's ``pydanticai``, ``pydanticai_azure``, ``pydanticai_bedrock``, ``pydanticai_vertex``,
read as they are) is read into one [`ModelConnection`][]; [`provider_arguments`][] turns it into
the keyword arguments of the pydantic-ai provider its model id names, the cloud credentials
included:

- Bedrock (``bedrock:``): an Airflow AWS connection named by extra ``aws_conn_id`` (through the
  amazon provider's ``AwsBaseHook`` when it is installed, so a role ARN, a profile or web identity
  works as everywhere in Airflow; else its key pair and region), or keys, a profile, a bearer
  token (``api_key``) and a region in the extra, else the worker's own role (boto3's default
  chain);
- Vertex AI (``google-cloud:``): a Google Cloud connection named by extra ``gcp_conn_id``
  (through the google provider's ``GoogleBaseHook`` when it is installed; else its key file), or
  ``service_account_info`` in the extra, else Application Default Credentials; ``project`` and
  ``location`` from the extra;
- Azure OpenAI (``azure:``): the endpoint (Base URL), ``api_version`` from the extra, and the
  key, or a Microsoft Entra token: ``azure_ad_token`` in the extra, or ``azure_entra_id: true``
  for ``azure-identity``'s default credential (a workload or managed identity);
- the Gemini API (``google:``, ``google-gla:``), Mistral, Groq, OpenAI, Anthropic: the key and,
  for a local or proxied server, the Base URL.

A missing provider SDK raises one [`ConfigurationError`][] naming this package's extra that
installs it ([`missing_extra`][]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cancellable_agents.core.exceptions import ConfigurationError

#: Our connection type (the model id is the ``schema`` field).
OUR_CONN_TYPE = "cancellable_agents_model"
#: common.ai 1.0.0's model connection types, and the provider a bare model name means on each.
COMMON_AI_CONN_TYPES: dict[str, str | None] = {
    "pydanticai": None,
    "pydanticai_azure": "azure",
    "pydanticai_bedrock": "bedrock",
    "pydanticai_vertex": "google-cloud",
}
#: common.ai's key of a connection's failover chain, which ours reads too.
FALLBACK_KEY = "fallback_conn_ids"

#: pydantic-ai provider prefix -> this package's extra that installs its SDK (none: always there).
EXTRAS: dict[str, str] = {
    "anthropic": "anthropic",
    "bedrock": "bedrock",
    "google": "google",
    "google-gla": "google",
    "google-cloud": "google",
    "google-vertex": "google",
    "groq": "groq",
    "mistral": "mistral",
}
#: Model-id prefixes of one provider that pydantic-ai spells in more than one way.
_ALIASES = {"google-gla": "google", "google-vertex": "google-cloud"}

#: Extra keys read for each provider (the same names common.ai 1.0.0 uses).
_BEDROCK_KEYS = (
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "region_name",
    "profile_name",
)
_BEDROCK_TIMEOUTS = ("aws_read_timeout", "aws_connect_timeout")
_VERTEX_KEYS = ("project", "location")


@dataclass(frozen=True)
class ModelConnection:
    """What a model connection holds, whatever its type.

    ``base_url`` is the connection's *host* (common.ai's Bedrock and Vertex types keep it in
    extra ``base_url``), ``api_key`` its *password* (or extra ``api_key`` on those two), ``extra``
    the parsed extra JSON.
    """

    conn_id: str
    conn_type: str
    model_id: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bare_name_provider(self) -> str | None:
        """The provider a model name without ``provider:`` means on this connection type."""
        return COMMON_AI_CONN_TYPES.get(self.conn_type)

    def fallback_conn_ids(self) -> list[str]:
        """The failover chain in the extra (common.ai's ``fallback_conn_ids``), blanks dropped."""
        raw = self.extra.get(FALLBACK_KEY)
        if raw is None:
            return []
        if isinstance(raw, str):  # typed into the extra as one comma- or line-separated string
            raw = raw.replace(",", "\n").splitlines()
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ConfigurationError(
                f"Connection {self.conn_id!r}: extra {FALLBACK_KEY!r} must be a list of connection "
                f'ids, e.g. {{"{FALLBACK_KEY}": ["anthropic_backup", "bedrock_dr"]}}; got {raw!r}.'
            )
        return [s for item in raw if (s := item.strip())]


def provider_of(model_id: str) -> str:
    """The pydantic-ai provider prefix of ``provider:name``, aliases folded."""
    prefix = model_id.partition(":")[0]
    return _ALIASES.get(prefix, prefix)


def qualified(model_id: str, conn: ModelConnection) -> str:
    """``model_id`` in pydantic-ai's spelling (``google-gla:`` is ``google:``), with the connection
    type's provider in front of a bare name (common.ai's
    Azure, Bedrock and Vertex types take ``gpt-5`` for ``azure:gpt-5``, ...). A Bedrock id has
    a ``:`` of its own (``us.anthropic.claude-opus-4-6-v1:0``): only a known provider prefix
    counts as one."""
    default = conn.bare_name_provider
    prefix, sep, name = model_id.partition(":")
    if sep and prefix in _ALIASES:  # older spellings pydantic-ai no longer parses
        return f"{_ALIASES[prefix]}:{name}"
    if model_id == "test" or default is None:
        return model_id
    if sep and _is_provider(prefix):
        return model_id
    return f"{default}:{model_id}"


def forwarded_model_id(
    model_id: str, primary: ModelConnection | None, fallback: ModelConnection
) -> str | None:
    """The primary's model id for a fallback connection that names none, as common.ai forwards
    it: only a bare name (``gpt-5``, made the fallback type's own, ``azure:gpt-5`` on an Azure
    connection); a name with a ``:`` of its own (Bedrock's ``...-v1:0``) only between two
    connections of the same platform. ``None``: nothing to forward."""
    if model_id == "test":
        return model_id
    prefix, sep, _ = model_id.partition(":")
    if sep and _is_provider(prefix):
        return None
    if fallback.bare_name_provider is None:
        return None
    if sep and (primary is None or primary.bare_name_provider != fallback.bare_name_provider):
        return None
    return model_id


def _is_provider(prefix: str) -> bool:
    from pydantic_ai.providers import infer_provider_class

    try:
        infer_provider_class(prefix)
    except ImportError:
        return True
    except ValueError:
        return False
    return True


def missing_extra(model_id: str, exc: ImportError) -> ConfigurationError:
    """The one error for a provider whose SDK is not installed: it names our extra."""
    provider = provider_of(model_id)
    extra = EXTRAS.get(provider) or EXTRAS.get(model_id.partition(":")[0])
    if extra is None:
        return ConfigurationError(f"Model {model_id!r} needs a package that is not installed: {exc}")
    return ConfigurationError(
        f"Model {model_id!r} needs the {provider} SDK, which is not installed: "
        f'pip install "airflow-provider-cancellable-agents[{extra}]" ({exc}).'
    )


def provider_arguments(model_id: str, conn: ModelConnection) -> dict[str, Any]:
    """The keyword arguments of the pydantic-ai provider ``model_id`` names, from ``conn``.

    Empty when the connection holds nothing for it: pydantic-ai then reads the provider's
    standard environment variables (and a cloud SDK its default credential chain).
    """
    provider = provider_of(model_id)
    if provider in ("bedrock", "bedrock-mantle"):
        return _bedrock(conn)
    if provider == "google-cloud":
        return _vertex(conn)
    if provider in ("azure", "azure-responses"):
        return _azure(conn)
    arguments: dict[str, Any] = {}
    if conn.api_key:
        arguments["api_key"] = conn.api_key
    if conn.base_url:
        arguments["base_url"] = conn.base_url
    return arguments


def _bedrock(conn: ModelConnection) -> dict[str, Any]:
    extra = conn.extra
    arguments: dict[str, Any] = {k: extra[k] for k in _BEDROCK_KEYS if extra.get(k)}
    for key in _BEDROCK_TIMEOUTS:
        if extra.get(key):
            arguments[key] = float(extra[key])
    if conn.base_url:
        arguments["base_url"] = conn.base_url
    if conn.api_key:  # a Bedrock API key (bearer token), not an IAM secret
        arguments["api_key"] = conn.api_key
    aws_conn_id = extra.get("aws_conn_id")
    if aws_conn_id:
        return {"bedrock_client": _bedrock_client(str(aws_conn_id), arguments)}
    return arguments


def _bedrock_client(aws_conn_id: str, arguments: dict[str, Any]) -> Any:
    """A ``bedrock-runtime`` client with the credentials of Airflow AWS connection ``aws_conn_id``
    (and the region, endpoint and timeouts of ``arguments``, where given: the provider ignores
    its own arguments beside a client).

    Through the amazon provider's ``AwsBaseHook`` when it is installed (role ARN, profile, web
    identity, ... as every AWS task has them); else the connection's key pair (login, password),
    session token and region, read here. A role to assume needs the amazon provider.
    """
    from botocore.config import Config

    region, endpoint = arguments.get("region_name"), arguments.get("base_url")
    timeouts = {k.removeprefix("aws_"): arguments[k] for k in _BEDROCK_TIMEOUTS if k in arguments}
    config = Config(**timeouts) if timeouts else None
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:
        return _bedrock_client_without_amazon(aws_conn_id, region, endpoint, config)
    hook = AwsBaseHook(aws_conn_id=aws_conn_id, client_type="bedrock-runtime", region_name=region)
    session = hook.get_session(region_name=region)
    return session.client(
        "bedrock-runtime", region_name=region or session.region_name, endpoint_url=endpoint, config=config
    )


def _bedrock_client_without_amazon(
    aws_conn_id: str, region: str | None, endpoint: str | None, config: Any
) -> Any:
    import boto3
    from airflow.sdk.bases.hook import BaseHook

    aws = BaseHook.get_connection(aws_conn_id)
    extra = aws.extra_dejson or {}
    if extra.get("role_arn") or extra.get("assume_role_method"):
        raise ConfigurationError(
            f"AWS connection {aws_conn_id!r} assumes a role ({extra.get('role_arn')!r}): that needs the "
            f"amazon provider, `pip install apache-airflow-providers-amazon`."
        )
    session = boto3.Session(
        aws_access_key_id=aws.login or extra.get("aws_access_key_id") or None,
        aws_secret_access_key=aws.password or extra.get("aws_secret_access_key") or None,
        aws_session_token=extra.get("aws_session_token") or None,
        region_name=region or extra.get("region_name") or None,
        profile_name=extra.get("profile_name") or None,
    )
    return session.client(
        "bedrock-runtime", endpoint_url=endpoint or extra.get("endpoint_url") or None, config=config
    )


def _vertex(conn: ModelConnection) -> dict[str, Any]:
    extra = conn.extra
    arguments: dict[str, Any] = {k: extra[k] for k in _VERTEX_KEYS if extra.get(k)}
    if conn.base_url:
        arguments["base_url"] = conn.base_url
    if conn.api_key:  # Vertex AI express mode
        arguments["api_key"] = conn.api_key
    info = extra.get("service_account_info")
    if extra.get("gcp_conn_id"):
        credentials, project = _google_credentials(str(extra["gcp_conn_id"]))
        arguments["credentials"] = credentials
        if project and "project" not in arguments:
            arguments["project"] = project
    elif info:
        arguments["credentials"] = _service_account(info if isinstance(info, dict) else json.loads(info))
    return arguments


_CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def _service_account(info: dict[str, Any]) -> Any:
    from google.oauth2 import service_account

    return service_account.Credentials.from_service_account_info(info, scopes=[_CLOUD_PLATFORM])


def _google_credentials(gcp_conn_id: str) -> tuple[Any, str | None]:
    """The credentials and project of Airflow Google Cloud connection ``gcp_conn_id``.

    Through the google provider's ``GoogleBaseHook`` when it is installed (key file, key JSON,
    impersonation chain, ADC, as every Google task has them); else the connection's key JSON
    (``keyfile_dict``) or key file (``key_path``), and without either, ADC.
    """
    try:
        from airflow.providers.google.common.hooks.base_google import GoogleBaseHook
    except ImportError:
        return _google_credentials_without_google(gcp_conn_id)
    hook = GoogleBaseHook(gcp_conn_id=gcp_conn_id)
    credentials, project = hook.get_credentials_and_project_id()
    return credentials, project


def _google_credentials_without_google(gcp_conn_id: str) -> tuple[Any, str | None]:
    from airflow.sdk.bases.hook import BaseHook

    gcp = BaseHook.get_connection(gcp_conn_id)
    extra = {k.removeprefix("extra__google_cloud_platform__"): v for k, v in (gcp.extra_dejson or {}).items()}
    project = extra.get("project") or None
    keyfile = extra.get("keyfile_dict")
    if keyfile:
        info = keyfile if isinstance(keyfile, dict) else json.loads(keyfile)
        return _service_account(info), project or info.get("project_id")
    if extra.get("key_path"):
        from google.oauth2 import service_account

        credentials = service_account.Credentials.from_service_account_file(
            extra["key_path"], scopes=[_CLOUD_PLATFORM]
        )
        return credentials, project or credentials.project_id
    import google.auth

    credentials, default_project = google.auth.default(scopes=[_CLOUD_PLATFORM])
    return credentials, project or default_project


def _azure(conn: ModelConnection) -> dict[str, Any]:
    extra = conn.extra
    arguments: dict[str, Any] = {}
    if conn.base_url:
        arguments["azure_endpoint"] = conn.base_url
    if extra.get("api_version"):
        arguments["api_version"] = str(extra["api_version"])
    token = extra.get("azure_ad_token")
    if token or extra.get("azure_entra_id"):
        arguments["openai_client"] = _azure_entra_client(arguments, token)
        return arguments
    if conn.api_key:
        arguments["api_key"] = conn.api_key
    return arguments


def _azure_entra_client(arguments: dict[str, Any], token: str | None) -> Any:
    """An Azure OpenAI client authenticated by Microsoft Entra ID: a given token, or
    ``azure-identity``'s default credential (workload or managed identity, environment, CLI)."""
    from openai import AsyncAzureOpenAI

    endpoint = arguments.pop("azure_endpoint", None)
    version = arguments.pop("api_version", None)
    if token:
        return AsyncAzureOpenAI(azure_endpoint=endpoint, api_version=version, azure_ad_token=token)
    try:
        from azure.identity import DefaultAzureCredential, get_bearer_token_provider
    except ImportError as exc:
        raise ConfigurationError(
            "azure_entra_id needs azure-identity, which is not installed: "
            f"`pip install azure-identity` ({exc})."
        ) from exc
    provider = get_bearer_token_provider(
        DefaultAzureCredential(), "https://cognitiveservices.azure.com/.default"
    )
    return AsyncAzureOpenAI(azure_endpoint=endpoint, api_version=version, azure_ad_token_provider=provider)
