"""Bedrock's botocore blocks a worker thread in the request; a cancel shuts its socket down.

Real botocore against the scripted server's Bedrock Converse endpoint on 127.0.0.1, run under a
real scope; the server records when it sees the client go. Without
``cancellable_agents.run._blocking_requests`` the thread stays in the read with the request open
until the answer (30 s here) and holds the task process at its exit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.run import _blocking_requests as blocking_requests
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.provider_models import build, installed

pytestmark = pytest.mark.skipif(not installed("bedrock"), reason="needs botocore (the bedrock extra)")

#: Long enough that only the cancel can end the request before the test's waits time out.
WHOLE = "slow?tokens=3&delay=10"
BEFORE_FIRST_BYTE = "slow?tokens=600&delay=0.05&delay_first=30"


@pytest.fixture
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


async def _consume(ctx: Any, events: Any) -> None:
    async for _ in events:
        pass


def _run_and_cancel(server: ScriptedModelServer, script: str, stream: bool) -> TaskCancellation:
    """Run a Bedrock agent under a scope, cancel it once the request arrived; the scope."""
    from pydantic_ai import Agent

    scope = TaskCancellation("bedrock")
    agent = Agent(build("bedrock", script, server.url))

    def cancel_once_sent() -> None:
        assert server.wait_for_request(1, timeout=30)
        scope.cancel()

    canceller = threading.Thread(target=cancel_once_sent)
    canceller.start()
    kwargs = {"event_stream_handler": _consume} if stream else {}
    with pytest.raises(TaskCancelled):
        run_agent_in_scope(scope, agent, "go", **kwargs)
    canceller.join(30)
    return scope


@pytest.mark.parametrize(
    ("script", "stream"), [(WHOLE, False), (BEFORE_FIRST_BYTE, True)], ids=["whole", "first"]
)
def test_a_cancel_closes_the_request_the_thread_is_blocked_in(
    server: ScriptedModelServer, script: str, stream: bool
) -> None:
    scope = _run_and_cancel(server, script, stream)
    closed = server.wait_for_disconnect(timeout=10)
    assert closed is not None, "the request stayed open: the worker thread is still blocked in it"
    # The release shuts the socket, then records: its thread may still be between the two.
    assert scope.wait_released(timeout=10)
    [event] = [e for e in scope.timeline if e.event == "blocking_requests_closed"]
    assert event.detail["requests"] == 1, event
    assert server.wait_for_finished(1, timeout=10)
    assert server.request_count == 1, "botocore retried the request after the cancel"


def test_a_request_after_the_cancel_is_refused_before_it_is_sent(server: ScriptedModelServer) -> None:
    model = build("bedrock", "echo", server.url)
    assert blocking_requests.watch_botocore()
    scope = TaskCancellation("cancelled first")
    scope.cancel()
    with scope.activate(), pytest.raises(blocking_requests.RequestCancelled):
        model.client.converse(modelId="echo", messages=[{"role": "user", "content": [{"text": "hi"}]}])
    assert server.request_count == 0


def test_requests_outside_a_run_are_left_alone(server: ScriptedModelServer) -> None:
    model = build("bedrock", "echo", server.url)
    assert blocking_requests.watch_botocore()
    answer = model.client.converse(modelId="echo", messages=[{"role": "user", "content": [{"text": "hi"}]}])
    assert answer["output"]["message"]["content"] == [{"text": "echo: hi"}]
