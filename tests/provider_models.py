"""A pydantic-ai model of each provider's real SDK, pointed at the scripted server on 127.0.0.1.

The server ([`cancellable_agents.testing.openai_server`][]) speaks each provider's wire protocol
([`cancellable_agents.testing.wire_protocols`][]); the model string is the server's script
(``slow?tokens=600&delay=0.05``). Shared by the per-provider kill tests
(``tests/process/test_provider_kills.py``, through ``dags/task_scenarios.py``) and the benchmark
(``benchmarks/provider_kills.py``). The SDKs are the package's extras: one missing is skipped by name.
"""

from __future__ import annotations

import importlib.util
from typing import Any
from urllib.parse import quote

#: Every provider whose kill is measured, with the SDK module it needs.
PROVIDERS: dict[str, str] = {
    "openai-chat": "openai",
    "openai-responses": "openai",
    "anthropic": "anthropic",
    "gemini": "google.genai",
    "vertex": "google.genai",
    "bedrock": "botocore",
    "mistral": "mistralai",
    "groq": "groq",
}

_KEY = "local-test-key"


def installed(provider: str) -> bool:
    """Whether ``provider``'s SDK can be imported here."""
    try:
        return importlib.util.find_spec(PROVIDERS[provider]) is not None
    except ModuleNotFoundError:
        return False


def build(provider: str, script: str, root_url: str) -> Any:
    """The pydantic-ai model of ``provider`` whose requests go to the server at ``root_url``
    (``http://127.0.0.1:PORT``, no ``/v1``) and play ``script``."""
    if provider == "openai-chat":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        return OpenAIChatModel(script, provider=OpenAIProvider(base_url=f"{root_url}/v1", api_key=_KEY))
    if provider == "openai-responses":
        from pydantic_ai.models.openai import OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider

        return OpenAIResponsesModel(script, provider=OpenAIProvider(base_url=f"{root_url}/v1", api_key=_KEY))
    if provider == "anthropic":
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        return AnthropicModel(script, provider=AnthropicProvider(base_url=root_url, api_key=_KEY))
    if provider in ("gemini", "vertex"):
        return _google(provider, script, root_url)
    if provider == "bedrock":
        return _bedrock(script, root_url)
    if provider == "mistral":
        from pydantic_ai.models.mistral import MistralModel
        from pydantic_ai.providers.mistral import MistralProvider

        return MistralModel(script, provider=MistralProvider(base_url=root_url, api_key=_KEY))
    if provider == "groq":
        from pydantic_ai.models.groq import GroqModel
        from pydantic_ai.providers.groq import GroqProvider

        return GroqModel(script, provider=GroqProvider(base_url=root_url, api_key=_KEY))
    raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")


def _google(provider: str, script: str, root_url: str) -> Any:
    """Gemini API (an API key) or Vertex AI (a project and location, a static token): the
    model name travels in the URL's path, which google-genai does not quote, so it is quoted here."""
    from google.genai import Client
    from google.genai.types import HttpOptions
    from google.oauth2.credentials import Credentials
    from pydantic_ai.models.google import GoogleModel
    from pydantic_ai.providers.google import GoogleProvider

    options = HttpOptions(base_url=root_url)
    if provider == "gemini":
        client = Client(api_key=_KEY, http_options=options)
    else:
        client = Client(
            vertexai=True,
            project="local-project",
            location="us-central1",
            credentials=Credentials(token="local"),  # a token with no expiry: never refreshed
            http_options=options,
        )
    return GoogleModel(quote(script, safe=""), provider=GoogleProvider(client=client))


def _bedrock(script: str, root_url: str) -> Any:
    """Bedrock Converse through botocore, its endpoint the local server (static test credentials)."""
    import boto3
    from botocore.config import Config
    from pydantic_ai.models.bedrock import BedrockConverseModel
    from pydantic_ai.providers.bedrock import BedrockProvider

    client = boto3.client(
        "bedrock-runtime",
        region_name="us-east-1",
        endpoint_url=root_url,
        aws_access_key_id="local",
        aws_secret_access_key="local",
        config=Config(retries={"max_attempts": 1}),
    )
    return BedrockConverseModel(script, provider=BedrockProvider(bedrock_client=client))
