"""MCP stdio servers and a scope, without Airflow: a real server spawned through the ``mcp`` SDK's
``stdio_client`` (the path pydantic-ai's ``MCPToolset`` takes), a real scope (fast: no task process).

The task-process tests (``test_mcp_kill.py``) hold the kill paths; this holds the edges they cannot
time: a server spawned after the cancel (its transport was still starting when the kill landed)
is closed at once, and a server spawned outside any run is left alone.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents import TaskCancellation
from cancellable_agents.procs._proc import read_proc
from tests.process.test_mcp_kill import HAVE_MCP, server_events
from tests.process.trees import eventually, survivors

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not HAVE_MCP, reason="needs pydantic-ai's fastmcp MCPToolset (the mcp extra)"),
]

SERVER = Path(__file__).with_name("mcp_server.py")


async def _spawn_and_watch(
    events: Path, marker: str, timeout: float, scope: TaskCancellation | None = None
) -> dict[str, Any]:
    """Spawn the ``child`` server through ``stdio_client`` (in ``scope``'s run, if given); wait up to
    ``timeout`` for it to stop; return its pid and whether it still runs."""
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from cancellable_agents.run._mcp_servers import watch_spawns

    assert watch_spawns()
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER), "child", str(events), marker])
    async with stdio_client(params):
        if scope is not None:  # noted when spawned; it may be closed before it could say it started
            pid = next(e["pid"] for e in scope.summary()["timeline"] if e["event"] == "mcp_server_started")
        else:
            started = await asyncio.to_thread(eventually, lambda: server_events(events, "server_started"), 60)
            pid = started[0]["pid"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and _running(pid):
            await asyncio.sleep(0.01)  # this loop must keep running: the close uses it
        return {"pid": pid, "running": _running(pid)}


def _running(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and not info.exited


def test_a_server_spawned_after_the_cancel_is_closed_at_once(tmp_path: Path, marker: str) -> None:
    scope = TaskCancellation("late", budget=4.0)
    scope.cancel()
    with scope.activate():
        result = asyncio.run(_spawn_and_watch(tmp_path / "events.jsonl", marker, timeout=4.0, scope=scope))
    assert not result["running"], "a server spawned after the cancel kept running"
    assert scope.wait_released(5.0)
    closed = [e for e in scope.summary()["timeline"] if e["event"] == "mcp_server_closed"]
    assert [e["pid"] for e in closed] == [result["pid"]], closed
    assert closed[0]["took_ms"] < 4000, closed
    assert survivors(marker) == []


def test_a_server_spawned_outside_a_run_is_left_alone(tmp_path: Path, marker: str) -> None:
    result = asyncio.run(_spawn_and_watch(tmp_path / "events.jsonl", marker, timeout=0.5))
    assert result["running"], "a server no run started was stopped"
