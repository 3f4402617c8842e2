"""Sub-agents in a real task process, killed with a real SIGTERM through the Task SDK's handler.

The scenarios (``task_scenarios.py``, ``subagent_*``) chain agents through ``SubagentToolset``;
every level holds a toolset whose teardown takes ``SUBAGENT_TEARDOWN`` seconds and the deepest
level is blocked on a slow streaming request to the local model server. Unwinding must close
that stream, report ``PARENT`` (with the task's own cause as root cause) at every level, finish
within Airflow's 5 s grace, and take about one teardown whatever the depth: teardowns overlap,
they do not add up. Latencies are printed (``-s``).
"""

from __future__ import annotations

from typing import Any

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.taskproc import SETTLE, STARTUP, unwound_ms

pytestmark = pytest.mark.process

#: Airflow SIGKILLs the task 5 s after SIGTERM; everything must be done before that.
GRACE = 5.0


def _event_ms(record: dict[str, Any], name: str) -> float:
    return next(e["ms"] for e in record["timeline"] if e["event"] == name)


def _levels(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's scopes from the task down the delegation chain."""
    chain = [record]
    while chain[-1]["children"]:
        assert len(chain[-1]["children"]) == 1, chain[-1]["children"]
        chain.append(chain[-1]["children"][0])
    return chain


def _kill_blocked_chain(spawn_task: Any, server: ScriptedModelServer, depth: int) -> dict[str, float]:
    """Run the depth-``depth`` chain, SIGTERM it mid-stream, assert the unwind, return timings."""
    server.reset()
    task = spawn_task(f"subagent_depth{depth}")
    # depth - 1 delegation requests complete, then the leaf's stream starts sending tokens.
    assert server.wait_for_request(depth, timeout=STARTUP), task.tail()
    assert server.wait_for_tokens(5, timeout=20), task.tail()
    sent = task.sigterm()
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert unwound_ms(failed["record"]) < GRACE * 1000, "the unwind must end inside Airflow's grace window"

    closed = server.wait_for_disconnect(timeout=GRACE)
    assert closed is not None, "the server never saw the deepest level's stream closed"
    assert closed.model.startswith("slow") and closed.stream
    assert closed.disconnected_at - sent < GRACE

    record = failed["record"]
    levels = _levels(record)
    assert [lvl["scope"] for lvl in levels] == ["agent", *(f"level{i}" for i in range(2, depth + 1))]
    assert record["outcome"] == "cancelled" and record["cause"] is not None
    for child in levels[1:]:
        assert child["cause"] == "parent", child
        assert child["root_cause"] == record["cause"], child
        assert child["outcome"] == "cancelled", child
        assert child["attached"]["messages"] >= 1 and child["attached"]["transcript"], child["attached"]

    starts = [e for e in task.events if e["event"] == "teardown_started"]
    ends = [e for e in task.events if e["event"] == "teardown_finished"]
    assert sorted(e["level"] for e in ends) == [f"level{i}" for i in range(1, depth + 1)]
    overlap = max(e["t"] for e in starts) < min(e["t"] for e in ends)
    assert overlap, "every level's teardown must start before any of them ends (no adding up)"

    assert task.wait_exit(SETTLE), task.tail()
    return {
        "teardown_ms": starts[0]["seconds"] * 1000,
        "unwind_ms": _event_ms(record, "run_unwound"),
        "reported_ms": (failed["t"] - sent) * 1000,
        "closed_ms": (closed.disconnected_at - sent) * 1000,
    }


def test_nested_delegation_unwinds_in_one_teardown_at_any_depth(
    spawn_task: Any, model_server: ScriptedModelServer
) -> None:
    timings = {depth: _kill_blocked_chain(spawn_task, model_server, depth) for depth in (1, 2, 3)}
    for depth, t in timings.items():
        print(
            f"\n[latency] sub-agents depth {depth}: kill -> run unwound {t['unwind_ms']:.1f} ms, "
            f"SIGTERM -> TaskCancelled reported {t['reported_ms']:.1f} ms, "
            f"SIGTERM -> deepest stream closed {t['closed_ms']:.1f} ms"
        )
    teardown_ms = timings[1]["teardown_ms"]
    # Adding up would cost one more teardown per level (+600 ms at depth 3); allow under one.
    assert timings[3]["unwind_ms"] < timings[1]["unwind_ms"] + teardown_ms, timings
    assert timings[2]["unwind_ms"] < timings[1]["unwind_ms"] + teardown_ms, timings


def test_thread_driven_child_is_cancelled_and_leaves_no_working_thread(
    spawn_task: Any, model_server: ScriptedModelServer
) -> None:
    task = spawn_task("subagent_thread")
    started = task.expect("work_started", timeout=STARTUP)
    assert started["scope"] == "worker", "the child's sync tool must see the child's scope"
    task.expect("work_tick", timeout=STARTUP)
    sent = task.sigterm()

    stopped = task.expect("work_stopped", timeout=GRACE)
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert unwound_ms(failed["record"]) < GRACE * 1000
    assert stopped["t"] < failed["t"], "the child's tool must stop before the task reports"

    child = failed["record"]["children"][0]
    assert child["scope"] == "worker" and child["cause"] == "parent"
    assert child["root_cause"] == failed["record"]["cause"]
    assert failed["record"]["stragglers"] == [] and child["stragglers"] == []

    after = task.expect("threads_after", timeout=SETTLE)
    working = [name for name in after["names"] if name.startswith(("tool-", "subagent-"))]
    assert working == [], f"threads still alive 1 s after the task raised: {working}"
    ticks = [e["t"] for e in task.events if e["event"] == "work_tick"]
    assert max(ticks) < failed["t"], "the child's tool kept working after the task raised"
    assert task.wait_exit(SETTLE), task.tail()
    stop_ms, report_ms = (stopped["t"] - sent) * 1000, (failed["t"] - sent) * 1000
    print(
        f"\n[latency] thread-driven sub-agent: SIGTERM -> child tool stopped {stop_ms:.1f} ms, "
        f"SIGTERM -> TaskCancelled reported {report_ms:.1f} ms"
    )
