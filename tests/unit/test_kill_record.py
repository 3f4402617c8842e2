"""What a killed task writes at the end of its log: the human line, the record, a short traceback."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import traceback
from typing import Any

import pytest
from airflow.sdk.bases.operator import BaseOperator
from pydantic_ai import Agent
from pydantic_ai.exceptions import RunCancelled
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents import CancellableAgentMixin, TaskCancelled
from cancellable_agents.airflow.kill_record.document import (
    RECORD_PREFIX,
    SUMMARY_PREFIX,
    ExpectedLine,
    KillReport,
    RetryOutlook,
    hide_unwind_chain,
    parse_record,
    parse_records,
    render_record,
    summary_line,
)
from cancellable_agents.core.causes import UserAction

#: What ``TaskCancellation.summary()`` returns, in its own key order (cause is not first).
SUMMARY: dict[str, Any] = {
    "scope": "agent",
    "cause": "user",
    "root_cause": "user",
    "detail": "marked failed",
    "outcome": "cancelled",
    "budget_s": 4.0,
    "wall_origin": 1796131260.7,
    "timeline": [
        {"event": "kill_received", "ms": 0.0, "cause": "unknown"},
        {"event": "run_unwound", "ms": 8.6},
        {"event": "resources_released", "ms": 9.4, "remaining_s": 3.99},
    ],
    "killed": [{"pid": p, "source": "sandbox", "command": "sleep 600", "signal": 15} for p in (11, 12, 13)],
    "stragglers": [],
    "attached": {},
    "children": [],
}


def test_the_human_line_says_what_happened_in_one_short_line() -> None:
    report = KillReport(SUMMARY, action=UserAction.MARKED_FAILED, retry=RetryOutlook.NOT_RETRYING)
    assert summary_line(report) == (
        "cancelled: user marked it failed · unwound in 9 ms · 3 processes killed, 0 left · not retrying"
    )


def test_the_human_line_names_what_airflow_logs_next_and_what_is_left() -> None:
    report = KillReport(
        {**SUMMARY, "stragglers": ["slow_tool"]},
        action=UserAction.CLEARED,
        processes_left=1,
        retry=RetryOutlook.NEXT_TRY_STARTS,
        airflow_logs_next=[ExpectedLine("Task killed!", "the supervisor says so after the exit")],
    )
    line = summary_line(report)
    assert line.startswith(f"{SUMMARY_PREFIX}user cleared it · ")
    assert "3 processes killed, 1 left" in line
    assert "1 still running after the budget: slow_tool" in line
    assert line.endswith(
        ' · the next try starts · expected from Airflow next: "Task killed!" (why: in the record)'
    )


def test_the_human_line_says_what_happened_to_each_mcp_server() -> None:
    closed = {"event": "mcp_server_closed", "ms": 800.0, "server": "python server.py", "pid": 41}
    child = {**SUMMARY, "timeline": [{**closed, "pid": 42, "outcome": "killed", "took_ms": 1512.2}]}
    record = {
        **SUMMARY,
        "timeline": [*SUMMARY["timeline"], {**closed, "outcome": "exited", "took_ms": 754.7}],
        "children": [child],
    }
    line = summary_line(KillReport(record, action=UserAction.MARKED_FAILED))
    assert " · MCP servers pid 41 exited in 755 ms, pid 42 killed in 1512 ms" in line, line


def test_the_record_puts_cause_and_outcome_first_and_one_event_per_line() -> None:
    expected = ExpectedLine("Task killed!", "the supervisor says so after the exit")
    report = KillReport(SUMMARY, retry=RetryOutlook.NOT_RETRYING, airflow_logs_next=[expected])
    text = render_record(report.full_record())
    record = parse_record(text)
    assert record is not None
    assert list(record)[:4] == ["cause", "detail", "outcome", "retry"]
    assert record["airflow_logs_next"] == [{"line": "Task killed!", "why": expected.why}]
    assert {k: record[k] for k in SUMMARY} == SUMMARY, "nothing of the scope's record is lost"
    lines = text.splitlines()
    assert lines[0].startswith(f'{RECORD_PREFIX}{{"cause": "user", "detail": "marked failed", "outcome"')
    for event in SUMMARY["timeline"]:
        assert f"    {json.dumps(event)}" in [line.rstrip(",") for line in lines], (
            f"{event} not on its own line"
        )
    assert max(len(line) for line in lines[1:]) < 120, "every line after the first fits a log viewer"


def test_parse_record_ignores_other_events() -> None:
    assert parse_record("cancelled: user marked it failed") is None


def test_parse_records_finds_every_whole_record_in_a_log() -> None:
    rendered = render_record(KillReport(SUMMARY).full_record())
    one_line = RECORD_PREFIX + json.dumps({"cause": "eviction"})
    log = "\n".join(
        [
            "INFO starting",
            f"the docs say: lines that start {RECORD_PREFIX}hold the record",  # the prefix in prose
            rendered,
            "WARNING Task killed!",
            one_line,
            RECORD_PREFIX + '{"cause": "us',  # a record still being written
        ]
    )
    records = parse_records(log)
    assert [r["cause"] for r in records] == ["user", "eviction"]
    assert records[0]["timeline"] == SUMMARY["timeline"], "a record over several lines is read whole"


# -- the shown traceback ------------------------------------------------------------------


def _raise_like_a_cancelled_run() -> TaskCancelled:
    """A TaskCancelled chained the way the runner chains it: RunCancelled from CancelledError."""

    async def inner() -> None:
        try:
            raise asyncio.CancelledError
        except asyncio.CancelledError as exc:
            raise RunCancelled("The agent run was cancelled.") from exc

    try:
        try:
            asyncio.run(inner())
        except RunCancelled as exc:
            raise TaskCancelled("agent: the run was cancelled") from exc
    except TaskCancelled as cancelled:
        return cancelled
    raise AssertionError("unreachable")


def test_the_internal_chain_is_hidden_but_kept(caplog: pytest.LogCaptureFixture) -> None:
    exc = _raise_like_a_cancelled_run()
    with caplog.at_level(logging.DEBUG, logger="cancellable_agents.airflow.kill_record.document"):
        assert hide_unwind_chain(exc)
    shown = "".join(traceback.format_exception(exc))
    assert "RunCancelled" not in shown and "asyncio" not in shown, shown
    assert isinstance(exc.unwind_chain, RunCancelled)  # type: ignore[attr-defined]
    assert "CancelledError" in caplog.text, "the hidden chain is in the DEBUG log"


def test_a_real_error_in_the_chain_is_shown_in_full() -> None:
    try:
        try:
            raise ConnectionResetError("the tool's socket broke while unwinding")
        except ConnectionResetError as exc:
            raise TaskCancelled("killed; then execute failed") from exc
    except TaskCancelled as cancelled:
        assert not hide_unwind_chain(cancelled)
        assert "ConnectionResetError" in "".join(traceback.format_exception(cancelled))


class Streaming(CancellableAgentMixin, BaseOperator):
    """An agent task whose model answers only after it is killed (it never does)."""

    def __init__(self, *, started: threading.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started = started

    def execute(self, context: Any) -> Any:
        async def slow(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            self.started.set()
            await asyncio.sleep(60)
            return ModelResponse(parts=[TextPart("too late")])

        return self.run_agent_sync(Agent(FunctionModel(slow)), "hi").output


def test_a_task_killed_mid_run_writes_the_line_the_record_and_a_short_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = threading.Event()
    op = Streaming(started=started, task_id="agent")
    killer = threading.Thread(target=lambda: started.wait(10) and op.on_kill(), daemon=True)
    killer.start()
    with caplog.at_level(logging.WARNING), pytest.raises(TaskCancelled) as info:
        op.execute({})
    killer.join(5)
    ours = [r.getMessage() for r in caplog.records if r.name == "cancellable_agents.airflow.mixin"]
    assert [m.split(" ")[0] for m in ours] == ["cancelled:", RECORD_PREFIX.strip()]
    assert ours[0].startswith("cancelled: cause unknown · unwound in "), ours[0]
    record = parse_record(ours[1])
    assert record is not None and (record["cause"], record["outcome"]) == ("unknown", "cancelled")
    shown = "".join(traceback.format_exception(info.value))
    assert info.value.__cause__ is None and info.value.__suppress_context__
    for internal in ("asyncio", "anyio", "pydantic_ai", "RunCancelled", "CancelledError"):
        assert internal not in shown, f"{internal} in the shown traceback:\n{shown}"
    assert isinstance(info.value.unwind_chain, RunCancelled)  # type: ignore[attr-defined]


# -- the Airflow facts behind it -----------------------------------------------------------


def test_the_noise_table_names_what_airflow_logs_after_each_user_stop() -> None:
    from cancellable_agents.airflow.kill_record._outlook import airflow_logs_next
    from cancellable_agents.core.causes import CancelCause

    def texts(cause: CancelCause, action: UserAction | None) -> list[str]:
        return [line.text for line in airflow_logs_next(cause, action)]

    assert texts(CancelCause.USER, UserAction.MARKED_FAILED) == ["Task killed!"]
    assert texts(CancelCause.USER, UserAction.CLEARED) == [
        "Failed to report terminal task state to supervisor",
        "Process exited abnormally",
        "Task killed!",
    ]
    assert texts(CancelCause.EVICTION, None) == texts(CancelCause.TIMEOUT, None) == []


def test_the_retry_outlook_follows_the_cause_and_the_servers_word() -> None:
    from types import SimpleNamespace

    from cancellable_agents.airflow.kill_record._outlook import retry_outlook
    from cancellable_agents.core.causes import CancelCause

    class Op(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> None:
            return None

    policy = Op(task_id="t").retry_policy
    outlook = functools.partial(retry_outlook, policy)
    assert outlook(None, CancelCause.USER, UserAction.CLEARED) is RetryOutlook.NEXT_TRY_STARTS
    assert outlook(None, CancelCause.USER, UserAction.MARKED_FAILED) is RetryOutlook.NOT_RETRYING
    assert outlook(None, CancelCause.EVICTION, None) is RetryOutlook.UNDECIDED  # no task instance
    # What the server sent with the task's start (the Task SDK's RuntimeTaskInstance holds it).
    ti = SimpleNamespace(_ti_context_from_server=SimpleNamespace(should_retry=True))
    assert outlook(ti, CancelCause.EVICTION, None) is RetryOutlook.RETRYING
    ti = SimpleNamespace(_ti_context_from_server=SimpleNamespace(should_retry=False))
    assert outlook(ti, CancelCause.TIMEOUT, None) is RetryOutlook.NO_RETRIES_LEFT
