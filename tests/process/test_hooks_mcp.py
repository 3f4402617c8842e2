"""MCP servers from Airflow connections (common.ai's ``mcp`` type, as it is): a real server over
stdio (its command and environment from the connection) and over streamable HTTP (its URL and
token from the connection), called by an agent on the scripted model server over real HTTP; a
kill during a call stops the stdio server the connection described."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from pydantic_ai import Agent

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.hooks.mcp import MCPConnectionToolset
from cancellable_agents.hooks.model import build_model
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.process.test_mcp_kill import HAVE_MCP, http_server, server_events  # noqa: F401 (fixture)
from tests.process.trees import eventually, survivors

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not HAVE_MCP, reason="needs pydantic-ai's fastmcp MCPToolset (the mcp extra)"),
]

SERVER = Path(__file__).with_name("mcp_server.py")
CALLS_STEP = 'openai:tool?name=step&args={"n":1}&then=done'
CALLS_WORK = 'openai:tool?name=work&args={"what":"x"}&then=done'


def _connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: object) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


def _stdio(monkeypatch: pytest.MonkeyPatch, mode: str, events: Path, marker: str) -> None:
    _connection(
        monkeypatch,
        "mcp_local",
        conn_type="mcp",
        extra={
            "transport": "stdio",
            "command": sys.executable,
            "args": [str(SERVER), mode, str(events), marker],
            "env": {"MCP_TEST_SECRET": "from-the-connection"},
        },
    )


def test_a_stdio_server_from_a_connection(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, marker: str
) -> None:
    events = tmp_path / "events.jsonl"
    _stdio(monkeypatch, "steps", events, marker)
    toolset = MCPConnectionToolset("mcp_local")
    with ScriptedModelServer() as model:
        agent = Agent(build_model(CALLS_STEP, base_url=model.base_url), toolsets=[toolset.build()])
        assert agent.run_sync("go").output == "done"
    (step,) = server_events(events, "step")
    assert step["secret"] == "from-the-connection"
    assert toolset.build().id == "mcp_local"


def test_a_streamable_http_server_from_a_connection_gets_its_token(
    monkeypatch: pytest.MonkeyPatch,
    http_server: tuple[str, Path],  # noqa: F811 (the fixture, imported)
) -> None:
    url, events = http_server
    _connection(
        monkeypatch,
        "mcp_remote",
        conn_type="mcp",
        host=url,
        password="token-from-the-connection",
        extra={"headers": {"X-Tenant": "analytics"}},
    )
    with ScriptedModelServer() as model:
        agent = Agent(
            build_model(CALLS_STEP, base_url=model.base_url), toolsets=[MCPConnectionToolset("mcp_remote")]
        )
        assert agent.run_sync("go").output == "done"
    (step,) = server_events(events, "step")
    assert step["authorization"] == "Bearer token-from-the-connection"


def test_a_kill_during_a_call_stops_the_server_the_connection_described(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, marker: str
) -> None:
    events = tmp_path / "events.jsonl"
    _stdio(monkeypatch, "child", events, marker)
    scope = TaskCancellation()

    def kill_once_the_tool_runs() -> None:
        if eventually(lambda: server_events(events, "tool_started"), timeout=120):
            scope.cancel(CancelCause.USER)

    threading.Thread(target=kill_once_the_tool_runs, daemon=True).start()
    with ScriptedModelServer() as model:
        agent = Agent(
            build_model(CALLS_WORK, base_url=model.base_url), toolsets=[MCPConnectionToolset("mcp_local")]
        )
        with pytest.raises(TaskCancelled):
            run_agent_in_scope(scope, agent, "go")
    assert scope.wait_released(10), "the unwind did not end"  # as the task's guard waits for it
    closed = [e.detail for e in scope.timeline if e.event == "mcp_server_closed"]
    # How the server hears the cancel (and when, under load) is test_mcp_kill.py's: here, that the
    # server the connection described and what its tool started are gone, within the unwind.
    assert closed, f"the connection's server was not closed by the unwind: {server_events(events)}"
    assert eventually(lambda: not survivors(marker), timeout=5), (
        survivors(marker),
        closed,
        server_events(events),
    )


def test_a_connection_that_cannot_work_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _connection(monkeypatch, "mcp_bad", conn_type="mcp", extra={"transport": "stdio"})
    with pytest.raises(ConfigurationError, match="extra 'command'"):
        MCPConnectionToolset("mcp_bad").build()
    _connection(monkeypatch, "mcp_nourl", conn_type="mcp")
    with pytest.raises(ConfigurationError, match="has no URL"):
        MCPConnectionToolset("mcp_nourl").build()
    with pytest.raises(ConfigurationError, match="airflow connections add mcp_none"):
        MCPConnectionToolset("mcp_none").build()
