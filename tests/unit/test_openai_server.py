"""Tests for the scripted OpenAI-compatible server: real HTTP on 127.0.0.1, no mocks."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import AgentStreamEvent, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from cancellable_agents.testing import openai_server
from cancellable_agents.testing.openai_server import (
    ScriptedModelServer,
    ScriptError,
    fetch_records,
    parse_model,
)

USER_HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as srv:
        yield srv


def _client(server: ScriptedModelServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _agent(server: ScriptedModelServer, model: str) -> Agent[None, str]:
    return Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=server.base_url, api_key="x")))


def _add_agent(server: ScriptedModelServer, calls: list[tuple[int, int]]) -> Agent[None, str]:
    model = "tool?" + urlencode({"name": "add", "args": json.dumps({"a": 1, "b": 2}), "then": "sum"})
    agent = _agent(server, model)

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    return agent


# -- grammar --------------------------------------------------------------------------------------------


def test_parse_model_defaults_and_params() -> None:
    assert parse_model("slow") == openai_server.Script("slow", tokens=50, delay=0.1)
    assert parse_model("slow?tokens=3&delay=0.5&delay_first=1").tokens == 3
    script = parse_model("tool?" + urlencode({"name": "add", "args": '{"a": 1}', "then": "the sum"}))
    assert (script.tool_names, json.loads(script.tool_args), script.then) == (("add",), {"a": 1}, "the sum")
    assert parse_model('tool?name=add&args={"a":1,"b":2}').tool_args == '{"a": 1, "b": 2}'  # unencoded is ok
    assert parse_model("tools?names=a,b").tool_names == ("a", "b")


@pytest.mark.parametrize(
    "model",
    ["nope", "echo?tokens=3", "slow?tokens=x", "slow?delay=-1", "tool", "tool?name=a&args=[1]", "slow?x"],
)
def test_parse_model_rejects(model: str) -> None:
    with pytest.raises(ScriptError):
        parse_model(model)


# -- plain HTTP -----------------------------------------------------------------------------------------


def test_health_models_and_echo_over_httpx(server: ScriptedModelServer) -> None:
    assert httpx.get(f"{server.url}/health").text == "ok"
    models = httpx.get(f"{server.base_url}/models").json()
    assert {m["id"] for m in models["data"]} == {"echo", "slow", "tool", "tools", "steps", "loop"}
    body = httpx.post(
        f"{server.base_url}/chat/completions", json={"model": "echo", "messages": USER_HI}
    ).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "echo: hi"
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    (record,) = server.wait_for_finished(1, timeout=2) or []
    assert (record.model, record.stream, record.outcome, record.messages) == (
        "echo",
        False,
        "completed",
        USER_HI,
    )


def test_openai_client_echo_and_unknown_behaviour(server: ScriptedModelServer) -> None:
    client = _client(server)
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello there"}]
    )
    assert reply.choices[0].message.content == "echo: hello there"
    with pytest.raises(openai.BadRequestError, match="supported behaviours"):
        client.chat.completions.create(model="unknown", messages=[{"role": "user", "content": "x"}])
    assert server.request_count == 2
    assert [r.outcome for r in server.wait_for_finished(2, timeout=2) or []] == ["completed", "error"]


def test_streaming_slow_completes_with_usage(server: ScriptedModelServer) -> None:
    stream = _client(server).chat.completions.create(
        model="slow?tokens=4&delay=0", messages=USER_HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert [r.tokens_sent for r in server.wait_for_finished(1, timeout=2) or []] == [4]


# -- disconnect detection -------------------------------------------------------------------------------


def test_streaming_client_close_is_detected_quickly(server: ScriptedModelServer) -> None:
    stream = _client(server).chat.completions.create(
        model="slow?tokens=200&delay=0.05", messages=USER_HI, stream=True
    )
    for _chunk in itertools.islice(stream, 4):
        pass
    assert server.wait_for_tokens(3, timeout=2) is not None
    closed_at = time.monotonic()
    stream.close()
    record = server.wait_for_disconnect(timeout=1.0)
    assert record is not None
    assert record.outcome == "disconnected" and record.disconnected_at is not None
    assert record.disconnected_at >= closed_at, "noticed after the close, not guessed"
    assert 3 <= record.tokens_sent < 200, "while the stream still had tokens to send"


def test_non_streaming_wait_and_delay_first_detect_disconnect(server: ScriptedModelServer) -> None:
    for model in ("slow?tokens=40&delay=0.1", "echo?delay_first=5"):
        server.reset()
        with httpx.Client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
            client.post(f"{server.base_url}/chat/completions", json={"model": model, "messages": USER_HI})
        record = server.wait_for_disconnect(timeout=1.0)
        assert record is not None and record.disconnected_at is not None, model
        assert record.outcome == "disconnected", model
        assert record.tokens_sent == 0, "noticed while the reply was still being held back"


def test_waits_time_out(server: ScriptedModelServer) -> None:
    started = time.monotonic()
    assert server.wait_for_request(1, timeout=0.1) is False
    assert server.wait_for_disconnect(timeout=0.1) is None
    assert server.wait_for_tokens(1, timeout=0.1) is None
    assert time.monotonic() - started < 30, "a wait ignored its timeout"  # vs. waiting forever


def test_stop_ends_in_flight_stream_quickly() -> None:
    server = ScriptedModelServer().start()
    client = httpx.Client(timeout=5)
    payload = {"model": "slow?tokens=1000&delay=0.05", "messages": USER_HI, "stream": True}
    with client.stream("POST", f"{server.base_url}/chat/completions", json=payload) as response:
        assert server.wait_for_tokens(1, timeout=2) is not None
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 25, "stop waited for the stream to end (50 s)"
        assert response.status_code == 200
    client.close()
    assert [r.outcome for r in server.requests] == ["disconnected"]


# -- pydantic-ai ----------------------------------------------------------------------------------------


def test_pydantic_ai_echo(server: ScriptedModelServer) -> None:
    assert _agent(server, "echo").run_sync("hi").output == "echo: hi"


def test_pydantic_ai_tool_call_non_streaming(server: ScriptedModelServer) -> None:
    calls: list[tuple[int, int]] = []
    assert _add_agent(server, calls).run_sync("add them").output == "sum"
    assert calls == [(1, 2)]
    first, second = server.wait_for_finished(2, timeout=2) or []
    assert not first.stream and [m["role"] for m in second.messages] == ["user", "assistant", "tool"]


def test_pydantic_ai_tool_call_streaming(server: ScriptedModelServer) -> None:
    calls: list[tuple[int, int]] = []
    events: list[str] = []

    async def on_events(ctx: RunContext[None], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            events.append(event.event_kind)

    agent = _add_agent(server, calls)
    assert agent.run_sync("add them", event_stream_handler=on_events).output == "sum"

    async def run_stream() -> str:
        async with agent.run_stream("add them") as result:
            return await result.get_output()

    assert asyncio.run(run_stream()) == "sum"
    assert calls == [(1, 2), (1, 2)]
    assert "function_tool_call" in events
    records = server.wait_for_finished(4, timeout=2) or []
    assert len(records) == 4 and all(r.stream and r.outcome == "completed" for r in records)


def test_pydantic_ai_sequential_steps(server: ScriptedModelServer) -> None:
    called: list[int] = []
    agent = _agent(server, "steps?name=step&count=3&then=all+done")

    @agent.tool_plain
    def step(n: int) -> str:
        """One step."""
        called.append(n)
        return f"step {n} ok"

    assert agent.run_sync("go").output == "all done"
    assert called == [1, 2, 3]
    assert len(server.wait_for_finished(4, timeout=2) or []) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_steps_with_a_reason_say_it_beside_each_call(server: ScriptedModelServer, stream: bool) -> None:
    agent = _agent(server, "steps?name=step&count=2&then=done&reason=I+need+this+step")

    @agent.tool_plain
    def step(n: int) -> str:
        """One step."""
        return "ok"

    async def drain(ctx: Any, events: AsyncIterable[AgentStreamEvent]) -> None:
        async for _ in events:
            pass

    # Streamed as the operators' stream=True does: every response streamed, the run goes on.
    messages = agent.run_sync("go", event_stream_handler=drain if stream else None).all_messages()
    said = [
        ("".join(p.content for p in m.parts if isinstance(p, TextPart)), [type(p).__name__ for p in m.parts])
        for m in messages
        if isinstance(m, ModelResponse) and any(isinstance(p, ToolCallPart) for p in m.parts)
    ]
    assert said == [("I need this step", ["TextPart", "ToolCallPart"])] * 2, said


def test_pydantic_ai_parallel_tools(server: ScriptedModelServer) -> None:
    called: list[str] = []
    agent = _agent(server, "tools?names=ping,pong&then=both")

    @agent.tool_plain
    def ping() -> str:
        """Ping."""
        called.append("ping")
        return "ok"

    @agent.tool_plain
    def pong() -> str:
        """Pong."""
        called.append("pong")
        return "ok"

    assert agent.run_sync("go").output == "both"
    assert sorted(called) == ["ping", "pong"]
    first, _second = server.wait_for_finished(2, timeout=2) or []
    assert first.tokens_sent == 2


# -- separate process -----------------------------------------------------------------------------------


def _spawn_server() -> tuple[subprocess.Popen[str], str]:
    src = Path(openai_server.__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "cancellable_agents.testing.openai_server", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], 15)
    line = proc.stdout.readline() if readable else ""
    if not line.startswith("READY "):
        proc.kill()
        pytest.fail(f"server process did not print READY, got {line!r}")
    return proc, line.split()[1]


def test_module_process_serves_records_and_stops_on_sigterm() -> None:
    proc, base_url = _spawn_server()
    try:
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        body: dict[str, Any] = {"model": "echo", "messages": USER_HI}
        assert httpx.post(f"{base_url}/chat/completions", json=body).json()["choices"][0]["message"][
            "content"
        ]
        payload = {"model": "slow?tokens=100&delay=0.05", "messages": USER_HI, "stream": True}
        with httpx.stream("POST", f"{base_url}/chat/completions", json=payload) as response:
            next(response.iter_lines())
        closed_at = time.monotonic()
        deadline = closed_at + 2
        while (
            not any(r.outcome == "disconnected" for r in fetch_records(base_url))
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        echo, slow = fetch_records(base_url)
        assert echo.outcome == "completed" and slow.outcome == "disconnected"
        assert slow.disconnected_at is not None and slow.tokens_sent < 100, "noticed mid-stream"
        root = base_url.removesuffix("/v1")
        assert httpx.post(f"{root}/_reset").json() == {"cleared": 2}
        assert httpx.get(f"{root}/_records").json() == []
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, f"exited {time.monotonic() - started:.1f} s after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_steps_stall_at_streams_slowly_once_and_a_repeat_at_once(server: ScriptedModelServer) -> None:
    """``stall_at=1``: the response after the first tool result streams text tokens before its call
    the first time; the same conversation at that step again (a resumed run's repeat) gets the call
    at once. pydantic-ai runs the call either way."""
    called: list[int] = []
    agent = _agent(server, "steps?name=step&count=2&stall_at=1&tokens=3&delay=0.01&then=all+done")

    @agent.tool_plain
    def step(n: int) -> str:
        """One step."""
        called.append(n)
        return f"step {n} ok"

    async def consume(ctx: Any, events: AsyncIterable[AgentStreamEvent]) -> None:
        async for _ in events:
            pass

    for _ in range(2):
        assert agent.run_sync("go", event_stream_handler=consume).output == "all done"
    assert called == [1, 2, 1, 2]
    records = server.wait_for_finished(6, timeout=2) or []
    # Per run: the call of step 1, the (stalled or not) call of step 2, the answer.
    assert [r.tokens_sent for r in records] == [1, 4, 2, 1, 1, 2], records
