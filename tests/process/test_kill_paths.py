"""Real task processes killed with real SIGTERMs through the Task SDK's own handler.

Each test starts ``task_scenarios.py`` (``dag.test()`` -> Task SDK ``run()``; forked from the
session's zygote, ``tests/process/zygote.py``, which paid the imports once), waits for the
moment to kill, sends SIGTERM to the task pid only, and asserts on what the task reported, on
what the local model server saw, and on the timeline. Latencies are printed (``-s``) for the
closing note; budgets are asserted only where they are the contract (the 5 s grace window), on
what the kill itself does: the task's own timeline (``kill_received`` -> unwound) and what the
server saw after the signal. Airflow's own work around the kill (the Task SDK's failure handling,
callbacks, the process's exit) is awaited with :data:`SETTLE`: a loaded machine slows it, and it
is not the provider's.
"""

from __future__ import annotations

from typing import Any

import pytest

from cancellable_agents.airflow.kill_record.document import parse_records
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.taskproc import SETTLE, STARTUP, unwound_ms

pytestmark = pytest.mark.process

#: Airflow SIGKILLs the task 5 s after SIGTERM; everything must be done before that.
GRACE = 5.0
#: Non-daemon threads a finished task process may still have: the main thread, and asyncio's
#: default executor's idle workers (``asyncio_N``), which ``concurrent.futures`` joins at exit.
EXIT_JOINED = ("MainThread", "asyncio_")


def _event_ms(record: dict[str, Any], name: str) -> float:
    return next(e["ms"] for e in record["timeline"] if e["event"] == name)


def _failed_with_task_cancelled(task: Any) -> dict[str, Any]:
    """The task's failure report; its unwind (on its own timeline) fit in Airflow's grace."""
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    unwound = unwound_ms(failed["record"])
    assert unwound < GRACE * 1000, f"kill_received -> unwound took {unwound:.0f} ms"
    return failed


def _logged_records(task: Any) -> list[dict[str, Any]]:
    """The ``cancellable_agents.record {json}`` records of the task's log (read once it exited);
    each is one JSON object that may span several lines."""
    return parse_records(task.tail(2000))


def _report(name: str, sent: float, failed: dict[str, Any]) -> float:
    latency_ms = (failed["t"] - sent) * 1000
    print(f"\n[latency] {name}: SIGTERM -> TaskCancelled reported {latency_ms:.1f} ms")
    return latency_ms


def test_streaming_request_is_closed(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    before = model_server.request_count
    task = spawn_task("stream")
    assert model_server.wait_for_request(before + 1, timeout=STARTUP), task.tail()
    assert model_server.wait_for_tokens(5, timeout=20)
    sent = task.sigterm()
    failed = _failed_with_task_cancelled(task)
    disconnect = model_server.wait_for_disconnect(timeout=GRACE)
    assert disconnect is not None, "the server never saw the streaming request closed"
    assert disconnect.disconnected_at - sent < GRACE
    assert task.wait_exit(SETTLE), task.tail()
    record = failed["record"]
    assert record["outcome"] == "cancelled"
    assert [e["event"] for e in record["timeline"]].count("kill_received") == 1
    # dag.test() has no worker: the server still has the try running, as on an eviction.
    assert failed["cause"] == "eviction"
    (logged,) = _logged_records(task)  # exactly one structured line, for the task log in the UI
    assert (logged["cause"], logged["outcome"]) == ("eviction", "cancelled"), logged
    assert _report("streaming request", sent, failed) < GRACE * 1000
    gone_ms = (disconnect.disconnected_at - sent) * 1000
    print(f"[latency] streaming request: SIGTERM -> server saw disconnect {gone_ms:.1f} ms")


def test_non_streaming_request_is_closed(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    before = model_server.request_count
    task = spawn_task("nonstream")
    assert model_server.wait_for_request(before + 1, timeout=STARTUP), task.tail()
    sent = task.sigterm()
    failed = _failed_with_task_cancelled(task)
    record = model_server.wait_for_disconnect(timeout=GRACE)
    assert record is not None and record.stream is False
    _report("non-streaming request", sent, failed)


def test_async_tool_gets_cancelled_error(spawn_task: Any) -> None:
    task = spawn_task("async_tool")
    task.expect("tool_started", timeout=STARTUP)
    sent = task.sigterm()
    failed = _failed_with_task_cancelled(task)
    cancelled = task.expect("tool_cancelled", timeout=GRACE)
    assert cancelled["t"] - sent < GRACE
    timeline = [e["event"] for e in failed["record"]["timeline"]]
    assert timeline.index("token_cancelled") < timeline.index("toolset_teardown")
    _report("async tool", sent, failed)


def test_cooperative_sync_tool_notices(spawn_task: Any) -> None:
    task = spawn_task("sync_coop")
    task.expect("tool_started", timeout=STARTUP)
    sent = task.sigterm()
    noticed = task.expect("tool_noticed", timeout=GRACE)
    assert noticed["noticed"] is True
    failed = _failed_with_task_cancelled(task)
    assert failed["record"]["stragglers"] == []
    _report("cooperative sync tool", sent, failed)


def test_uncooperative_sync_tool_is_named_and_does_not_block(spawn_task: Any) -> None:
    task = spawn_task("sync_uncoop")
    task.expect("tool_started", timeout=STARTUP)
    sent = task.sigterm()
    failed = _failed_with_task_cancelled(task)  # the unwind did not wait for the tool past the grace
    assert failed["record"]["stragglers"] == ["sync tool 'ignore_cancellation'"]
    assert task.wait_exit(SETTLE), task.tail()
    assert "ignore_cancellation" in task.tail(400) and "left behind" in task.tail(400)
    _report("uncooperative sync tool", sent, failed)


def test_kill_before_the_run_is_remembered(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    task = spawn_task("before_run")
    task.expect("pre_execute", timeout=STARTUP)
    before = model_server.request_count
    sent = task.sigterm()
    failed = _failed_with_task_cancelled(task)
    assert task.wait_exit(SETTLE), task.tail()
    assert model_server.request_count == before, "a killed task must not call the model"
    events = [e["event"] for e in failed["record"]["timeline"]]
    assert "execute_refused" in events and "run_started" not in events
    _report("kill before the run", sent, failed)


def test_kill_after_the_run_is_a_logged_no_op(spawn_task: Any) -> None:
    task = spawn_task("after_run")
    task.expect("post_execute", timeout=STARTUP)
    task.sigterm()
    succeeded = task.expect("task_succeeded", timeout=SETTLE)
    events = [e["event"] for e in succeeded["record"]["timeline"]]
    assert "cancel_ignored" in events and "kill_received" not in events
    # Nothing outlives the task that would hold the process at its exit: the only non-daemon
    # threads left are the main one and the event loop's idle executor workers (joined at once).
    exited = task.expect("exited", timeout=SETTLE)
    holding = [name for name, daemon in exited["threads"] if not daemon and not name.startswith(EXIT_JOINED)]
    assert holding == [], f"non-daemon threads still running after the task succeeded: {holding}"
    assert task.wait_exit(SETTLE), task.tail()
    assert task.event("task_failed") is None
    gone_ms = (task.exited_at - exited["t"]) * 1000
    print(f"\n[latency] kill after the run: task over -> process gone {gone_ms:.1f} ms")


def test_sigterm_burst_cancels_once(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    before = model_server.request_count
    task = spawn_task("burst")
    assert model_server.wait_for_request(before + 1, timeout=STARTUP), task.tail()
    assert model_server.wait_for_tokens(5, timeout=20)
    sent = task.sigterm(times=20)
    failed = _failed_with_task_cancelled(task)
    events = [e["event"] for e in failed["record"]["timeline"]]
    assert events.count("kill_received") == 1
    assert events.count("token_cancelled") == 1
    assert task.wait_exit(SETTLE), task.tail()
    assert "on_kill failed" not in task.tail(400)
    assert len(_logged_records(task)) == 1, "20 SIGTERMs, one cancellation, one record line"
    _report("20 SIGTERMs", sent, failed)


def test_execution_timeout_unwinds_before_sigalrm(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    before = model_server.request_count
    task = spawn_task("timeout")
    assert model_server.wait_for_request(before + 1, timeout=STARTUP), task.tail()
    failed = task.expect("task_failed", timeout=STARTUP)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert failed["cause"] == "timeout"
    assert model_server.wait_for_disconnect(timeout=GRACE) is not None
    assert "AirflowTaskTimeout" not in task.tail(400)


def test_on_kill_after_sigalrm_records_timeout_and_releases(spawn_task: Any) -> None:
    task = spawn_task("timeout_sigalrm")
    task.expect("busy_started", timeout=STARTUP)
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "AirflowTaskTimeout"
    task.expect("resource_released", timeout=GRACE)
    record = failed["record"]
    assert record["cause"] == "timeout"
    assert "on_kill failed" not in task.tail(400)
