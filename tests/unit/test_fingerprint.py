"""The fingerprint a record is kept under, and what a run's toolsets say about themselves."""

from __future__ import annotations

import logging

import pytest
from pydantic_ai.toolsets import CombinedToolset, FunctionToolset, WrapperToolset

from cancellable_agents.durable import MemoryStore
from cancellable_agents.durable._fingerprint import workspace_lost_on_retry
from cancellable_agents.toolsets.sandbox import SandboxToolset
from tests.unit.durable_runs import STEPS, Task, killed_at


def test_a_changed_prompt_starts_fresh_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    task = Task(prompt="something else entirely")
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.durable"):
        _result, journal, _ = task.run(MemoryStore(killed_at(7)), 2)
    assert journal.resume is None and task.script.requests == STEPS + 1
    warnings = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    assert len(warnings) == 1 and "different run" in warnings[0], warnings


def test_a_sandbox_says_its_workspace_is_lost_however_deeply_it_is_wrapped() -> None:
    plain = FunctionToolset[None]()
    assert not workspace_lost_on_retry([plain])
    assert workspace_lost_on_retry([SandboxToolset()])
    wrapped = WrapperToolset(CombinedToolset([plain, WrapperToolset(SandboxToolset())]))
    assert workspace_lost_on_retry([plain, wrapped])


def test_an_mcp_toolset_without_an_id_is_fingerprinted_by_its_server_not_its_address() -> None:
    """Every try builds its toolset anew (another process): pydantic-ai labels one without an id by
    its client's repr (a memory address), so a record could never be resumed (issue 32)."""
    mcp = pytest.importorskip("pydantic_ai.mcp", reason="the mcp extra")
    transports = pytest.importorskip("fastmcp.client.transports", reason="the mcp extra")
    from pydantic_ai import Agent

    from cancellable_agents.durable._fingerprint import fingerprint

    def agent(*args: str) -> Agent[None, str]:
        toolset = mcp.MCPToolset(transports.StdioTransport("python", ["server.py", *args]))
        return Agent("test", toolsets=[toolset])

    assert fingerprint(agent("a"), "go", {}) == fingerprint(agent("a"), "go", {})
    assert fingerprint(agent("a"), "go", {}) != fingerprint(agent("b"), "go", {})
