"""One provider's request killed with a real SIGTERM, and what the kill did: shared by the
per-provider kill test (``test_provider_kills.py``) and its benchmark (``benchmarks/provider_kills.py``).

The task process is ``dags/task_scenarios.py provider_NAME_MOMENT`` (an ``LLMOperator`` whose model
is the provider's real SDK against the scripted server, ``tests/provider_models.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.taskproc import GRACE, SETTLE, STARTUP

#: Threads a task process may still have at its very end: the main thread, asyncio's default
#: executor's idle workers (joined at once at exit), and daemon threads (they never hold it).
EXIT_JOINED = ("MainThread", "asyncio_")


def kill_request(
    spawn_task: Callable[[str], Any], server: ScriptedModelServer, provider: str, moment: str
) -> dict[str, Any]:
    """Start ``provider``'s task and SIGTERM it at ``moment`` of its request (``stream``: once
    tokens flow; ``first``, ``whole``: once the request arrived); what happened, in ms from the
    signal (``raised_ms``, ``closed_ms``, ``exit_ms``), and what outlived the unwind."""
    before = server.request_count
    task = spawn_task(f"provider_{provider}_{moment}")
    assert server.wait_for_request(before + 1, timeout=STARTUP), task.tail()
    if moment == "stream":
        assert server.wait_for_tokens(5, timeout=STARTUP), task.tail()
    sent = task.sigterm()
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    disconnect = server.wait_for_disconnect(timeout=GRACE)
    after = task.expect("resources_after_unwind", timeout=SETTLE)
    exited = task.expect("exited", timeout=SETTLE)
    assert task.wait_exit(SETTLE), task.tail()
    assert task.exited_at is not None
    timeline = failed["record"]["timeline"]
    return {
        "requests": server.request_count - before,
        "closed_on_the_socket": [e for e in timeline if e["event"] == "blocking_requests_closed"],
        "provider": provider,
        "moment": moment,
        "record": failed["record"],
        "raised_ms": (failed["t"] - sent) * 1000,
        "closed_ms": None if disconnect is None else (disconnect.disconnected_at - sent) * 1000,
        "exit_ms": (task.exited_at - sent) * 1000,
        "connections": after["connections"],
        "holding": [n for n, daemon in exited["threads"] if not daemon and not n.startswith(EXIT_JOINED)],
    }
