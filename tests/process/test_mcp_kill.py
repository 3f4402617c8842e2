"""MCP toolsets in a real task process, killed with a real SIGTERM through the Task SDK's handler.

Each task process is ``task_scenarios.py`` under ``dag.test()``, forked from the session's zygote
(``tests/process/zygote.py``): a cold one spent 10-20 s importing and building the in-process
execution API before its agent started.

The servers are real (``mcp_server.py``, the ``mcp`` SDK's ``MCPServer``), reached through
pydantic-ai's ``MCPToolset``: over stdio (the task's own child) or streamable HTTP (a server this
test starts, not the task's child). The model calls the server's ``work`` tool, which blocks; the
test SIGTERMs the task once the server reports the tool started, then checks the MCP order: the
server's handler saw the cancel, its cleanup finished, the server exited on its closed stdin (or
was killed within the budget) and nothing it started is left, with the reaper on and off.
Latencies are printed (``-s``): the closing note's table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.run._mcp_servers import STDIN_GRACE
from cancellable_agents.run.tool_calls import IDEMPOTENCY_META_KEY
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.process.conftest import scenario_env
from tests.process.harness import TaskProcess
from tests.process.trees import eventually, survivors
from tests.process.zygote import ScenarioZygote
from tests.taskproc import GRACE, SETTLE, STARTUP, unwound_ms, wait_markers_gone

try:
    from fastmcp.client.transports import StdioTransport  # noqa: F401
    from pydantic_ai.mcp import MCPToolset  # noqa: F401
except ImportError:  # pydantic-ai's floor (2.58) has no fastmcp-based MCPToolset
    HAVE_MCP = False
else:
    HAVE_MCP = True

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not HAVE_MCP, reason="needs pydantic-ai's fastmcp MCPToolset (2.68+, the mcp extra)"),
]

SERVER = Path(__file__).with_name("mcp_server.py")


def server_events(path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The events the MCP server appended to ``path`` (all, or those called ``name``)."""
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if name is None or e["event"] == name]


Spawn = Callable[..., tuple[TaskProcess, Path]]


@pytest.fixture
def mcp_task(
    airflow_home: Path,
    model_server: ScriptedModelServer,
    tmp_path: Path,
    marker: str,
    scenario_zygote: ScenarioZygote,
) -> Iterator[Spawn]:
    """Start scenario ``mcp_*`` with its server's events file and ``marker``; SIGKILL it after."""
    started: list[TaskProcess] = []

    def spawn(scenario: str, url: str = "") -> tuple[TaskProcess, Path]:
        events = tmp_path / f"{scenario}.events.jsonl"
        overrides = {"MCP_EVENTS": str(events), "MCP_MARKER": marker, "MCP_URL": url}
        env = scenario_env(airflow_home, model_server.base_url, overrides)
        task = TaskProcess(scenario, env, tmp_path, zygote=scenario_zygote)
        started.append(task)
        return task, events

    yield spawn
    for task in started:
        task.close(timeout=0)


def _kill(task: TaskProcess, events: Path, marker: str, ready: str = "tool_started") -> dict[str, Any]:
    """SIGTERM ``task`` once its server reported ``ready``; return what happened, timed from the signal."""
    assert eventually(lambda: server_events(events, ready), timeout=STARTUP), task.tail()
    sent = task.sigterm()
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    record = failed["record"]
    assert unwound_ms(record) < GRACE * 1000, "the unwind must end inside Airflow's grace window"
    gone_at = wait_markers_gone(marker, sent + GRACE)
    closed = [e for e in record["timeline"] if e["event"] == "mcp_server_closed"]
    cancelled = server_events(events, "tool_cancelled")
    return {
        "sent": sent,
        "raised_at": failed["t"],
        "record": record,
        "closed": closed,
        "cancel_seen_ms": (cancelled[0]["t"] - sent) * 1000 if cancelled else None,
        "cleanup_done": bool(server_events(events, "cleanup_done")),
        "server_exit": bool(server_events(events, "server_exit")),
        "gone_ms": (gone_at - sent) * 1000 if gone_at is not None else None,
        "survivors": survivors(marker),
    }


def _report(name: str, result: dict[str, Any]) -> None:
    closed = result["closed"][0] if result["closed"] else {}
    print(
        f"\n[mcp] {name}: cancel seen by the server {result['cancel_seen_ms']} ms, "
        f"cleanup finished {result['cleanup_done']}, server exited on its own {result['server_exit']}, "
        f"server and children gone {result['gone_ms']} ms after SIGTERM "
        f"(outcome {closed.get('outcome')}, killed {closed.get('killed')}, "
        f"close took {closed.get('took_ms')} ms), "
        f"survivors {result['survivors']}"
    )


@pytest.mark.parametrize("reap", [True, False], ids=["reaper", "no_reaper"])
def test_stdio_server_hears_the_cancel_then_is_closed_with_its_tool_child(
    mcp_task: Spawn, marker: str, reap: bool
) -> None:
    """The tool's ``sleep`` child stays in the server's group after the server exits on EOF: it
    must be stopped too, also without the reaper (which would otherwise miss the server)."""
    scenario = "mcp_child" if reap else "mcp_child_noreap"
    task, events = mcp_task(scenario)
    result = _kill(task, events, marker)
    _report(scenario, result)
    assert result["cancel_seen_ms"] is not None, "the server's handler never saw the cancellation"
    assert result["server_exit"], "the server must exit on its closed stdin, not be killed first"
    assert result["gone_ms"] is not None, f"left running: {result['survivors']}"
    [closed] = result["closed"]
    assert closed["outcome"] == "exited" and closed["stdin_closed"], closed
    killed = result["record"]["killed"]
    assert any(k["source"] == "mcp_stdio" and "sleep" in k["command"] for k in killed), killed
    # The call carried its idempotency key in the request's _meta (issue 32, item 3).
    [started] = server_events(events, "tool_started")
    assert re.fullmatch(r"[0-9a-f]{32}", started["meta"].get(IDEMPOTENCY_META_KEY) or ""), started
    assert task.wait_exit(SETTLE), task.tail()


@pytest.mark.parametrize("reap", [True, False], ids=["reaper", "no_reaper"])
def test_stdio_server_cleanup_on_cancel_finishes(mcp_task: Spawn, marker: str, reap: bool) -> None:
    scenario = "mcp_cleanup" if reap else "mcp_cleanup_noreap"
    task, events = mcp_task(scenario)
    result = _kill(task, events, marker)
    _report(scenario, result)
    assert result["cancel_seen_ms"] is not None, "the server's handler never saw the cancellation"
    assert result["cleanup_done"], "the server was stopped before its cleanup on cancel finished"
    assert result["server_exit"] and result["gone_ms"] is not None, result["survivors"]
    assert result["closed"][0]["outcome"] == "exited", result["closed"]
    assert task.wait_exit(SETTLE), task.tail()


@pytest.mark.parametrize("reap", [True, False], ids=["reaper", "no_reaper"])
def test_setsid_grandchild_of_a_stdio_tool_is_stopped_with_its_server(
    mcp_task: Spawn, marker: str, reap: bool
) -> None:
    """A tool's double-forked ``setsid`` grandchild escapes the server's group and tree, not the
    environment it was started with: the server's close finds it by its tag, reaper or not."""
    scenario = "mcp_setsid" if reap else "mcp_setsid_noreap"
    task, events = mcp_task(scenario)
    result = _kill(task, events, marker)
    _report(scenario, result)
    assert result["cancel_seen_ms"] is not None and result["server_exit"]
    assert result["gone_ms"] is not None, f"left running: {result['survivors']}"
    [closed] = result["closed"]
    assert closed["outcome"] == "exited" and closed["killed"], closed
    killed = result["record"]["killed"]
    assert any(
        k["source"] == "mcp_stdio" and marker in k["command"] and k["pid"] in closed["killed"] for k in killed
    ), killed
    assert task.wait_exit(SETTLE), task.tail()


@pytest.mark.parametrize("reap", [True, False], ids=["reaper", "no_reaper"])
def test_stdio_server_killed_while_it_boots_stops(mcp_task: Spawn, marker: str, reap: bool) -> None:
    scenario = "mcp_boot" if reap else "mcp_boot_noreap"
    task, events = mcp_task(scenario)
    result = _kill(task, events, marker, ready="server_started")
    _report(scenario, result)
    assert result["gone_ms"] is not None, f"left running: {result['survivors']}"
    [closed] = result["closed"]
    assert closed["outcome"] == "killed", closed
    # It never answered the handshake: stopped at once, not after the stdin grace (1.5 s).
    assert closed["booting"] and not closed["stdin_closed"], closed
    assert closed["took_ms"] < STDIN_GRACE * 1000, closed
    raised_ms = (result["raised_at"] - result["sent"]) * 1000
    print(f"[mcp] {scenario}: SIGTERM -> task raised {raised_ms:.0f} ms")
    assert task.wait_exit(SETTLE), task.tail()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def http_server(tmp_path: Path, marker: str) -> Iterator[tuple[str, Path]]:
    """A streamable-HTTP MCP server on 127.0.0.1, started here (not the task's child)."""
    port, events = _free_port(), tmp_path / "http.events.jsonl"
    log = (tmp_path / "http_server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(events), marker, str(port)],
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def listening() -> bool:
        assert proc.poll() is None, (tmp_path / "http_server.log").read_text()[-3000:]
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        assert eventually(listening, timeout=STARTUP), "the MCP HTTP server never listened"
        yield f"http://127.0.0.1:{port}/mcp", events
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()


def test_streamable_http_tool_sees_the_cancellation(mcp_task: Spawn, http_server: tuple[str, Path]) -> None:
    url, events = http_server
    task, _ = mcp_task("mcp_http", url=url)
    assert eventually(lambda: server_events(events, "tool_started"), timeout=STARTUP), task.tail()
    sent = task.sigterm()
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert unwound_ms(failed["record"]) < GRACE * 1000
    cancelled = eventually(lambda: server_events(events, "tool_cancelled"), timeout=GRACE)
    assert cancelled, "the remote server's tool never saw the cancellation"
    seen_ms = (cancelled[0]["t"] - sent) * 1000
    print(f"\n[mcp] mcp_http: cancel seen by the server {seen_ms:.1f} ms after SIGTERM")
    assert seen_ms < GRACE * 1000
    assert not failed["record"]["killed"], "a remote server is nothing of ours to kill"
    assert task.wait_exit(SETTLE), task.tail()
