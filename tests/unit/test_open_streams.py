"""google-genai's stream is a chain of async generators; a cancel must close it to the connection.

Real google-genai (Gemini API and Vertex AI) against the scripted server's Gemini endpoint on
127.0.0.1, run under a real scope. The event handler stops reading after a few events, so when the
cancel lands the SDK's generators wait at a ``yield``, not in a read: pydantic-ai closes the
outermost one only, and without ``cancellable_agents.run._open_streams`` the HTTP response is never
released (the request stays open until the process exits).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic_ai.capabilities import AbstractCapability

from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.provider_models import build, installed

pytestmark = [
    pytest.mark.skipif(not installed("gemini"), reason="needs google-genai (the google extra)"),
    pytest.mark.skipif(
        not hasattr(AbstractCapability, "get_wrapper_model"),
        reason="this pydantic-ai has no get_wrapper_model hook: the fix cannot apply (see open_streams)",
    ),
]

#: 600 tokens 20 ms apart: 12 s, longer than every wait below.
STREAM = "slow?tokens=600&delay=0.02"


@pytest.fixture
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


async def _stop_reading(ctx: Any, events: Any) -> None:
    """Read three events, then stop reading (the stream stays open, its generators suspended)."""
    seen = 0
    async for _ in events:
        seen += 1
        if seen == 3:
            await asyncio.sleep(60)


@pytest.mark.parametrize("provider", ["gemini", "vertex"])
def test_a_cancelled_stream_between_chunks_is_closed_to_the_connection(
    server: ScriptedModelServer, provider: str
) -> None:
    from pydantic_ai import Agent

    scope = TaskCancellation(provider)
    agent = Agent(build(provider, STREAM, server.url))

    def cancel_while_not_reading() -> None:
        assert server.wait_for_tokens(6, timeout=30)
        scope.cancel()

    canceller = threading.Thread(target=cancel_while_not_reading)
    canceller.start()
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, agent, "go", event_stream_handler=_stop_reading)
    canceller.join(30)
    closed = server.wait_for_disconnect(timeout=5)
    assert closed is not None, "the SDK's inner generators were left open, and the request with them"
    assert any(e.event == "model_streams_closed" for e in scope.timeline)


def test_a_stream_that_is_not_cancelled_is_untouched(server: ScriptedModelServer) -> None:
    from pydantic_ai import Agent

    scope = TaskCancellation("gemini")
    agent = Agent(build("gemini", "slow?tokens=5&delay=0", server.url))

    async def read_all(ctx: Any, events: Any) -> None:
        async for _ in events:
            pass

    result = run_agent_in_scope(scope, agent, "go", event_stream_handler=read_all)
    assert result.output == "tok0 tok1 tok2 tok3 tok4"
    # The server records the outcome once its handler returns, which may be after the client
    # read the last token: wait for it.
    finished = server.wait_for_finished(1, timeout=10)
    assert finished is not None, "the server never finished the request"
    assert [r.outcome for r in finished] == ["completed"]
    assert not any(e.event == "model_streams_closed" for e in scope.timeline)
