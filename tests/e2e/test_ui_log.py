"""What a DAG author sees of a kill in the Airflow UI: the end of the killed try's log.

The logs are read the way the UI reads them (REST, ``Accept: application/x-ndjson``) from the
session's killed runs (``killed_runs``: the same runs ``test_kill_paths`` judges). A killed try
ends with three things of ours: the human line, the record (cause first), and ``TaskCancelled``
with a short traceback; every Airflow error line after the record must be one the record
announced as expected. The connection form's *Test* button is driven through the same REST call
the UI makes. A headless-Chromium check of the rendered pages is in ``test_ui_browser.py``.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest

from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX, SUMMARY_PREFIX, parse_record
from tests.e2e.airflow_stack import wait_until
from tests.e2e.conftest import E2EEnv, KilledRuns
from tests.e2e.driver import E2E_TEST_TIMEOUT, PathResult, diagnostics, fetch_log

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

#: Per kill path: how the human line starts and ends (between: unwind time and processes).
SUMMARIES = {
    "mark_failed": (
        "cancelled: user marked it failed · unwound in ",
        ' · not retrying · expected from Airflow next: "Task killed!" (why: in the record)',
    ),
    "clear": (
        "cancelled: user cleared it · unwound in ",
        ' · the next try starts · expected from Airflow next: "Failed to report terminal task state to '
        'supervisor", "Process exited abnormally", "Task killed!" (why: in the record)',
    ),
    "eviction": ("cancelled: the worker is shutting down (eviction) · unwound in ", " · retrying"),
    "timeout": ("cancelled: timed out (the run's deadline passed) · unwound in ", " · retrying"),
}
#: The message the Task SDK logs our TaskCancelled under.
TASK_FAILED = "Task failed with exception"
#: Frames from these in the shown traceback mean the internal unwind chain leaked into it.
INTERNAL = ("asyncio", "anyio", "pydantic_ai", "httpx", "httpcore", "openai")


def _events(result: PathResult, try_number: int = 1) -> list[dict[str, Any]]:
    return result.logs.get(try_number, [])


def _text(event: dict[str, Any]) -> str:
    return str(event.get("event", ""))


def _record_index(result: PathResult) -> int:
    indexes = [i for i, e in enumerate(_events(result)) if _text(e).startswith(RECORD_PREFIX)]
    assert len(indexes) == 1, f"expected one record in try 1's log, found {len(indexes)}"
    return indexes[0]


def rendered_lines(events: list[dict[str, Any]]) -> int:
    """Lines these events take in the UI's log view: the event's own lines, plus a header and a
    line per frame for every exception of a traceback."""
    lines = 0
    for event in events:
        lines += _text(event).count("\n") + 1
        for exc in event.get("error_detail") or ():
            lines += 1 + len(exc.get("frames") or ())
    return lines


def _judge(e2e: E2EEnv, result: PathResult) -> dict[str, Any]:
    if result.error is not None:
        raise AssertionError(f"{result.path}: {result.error!r}\n{diagnostics(e2e, result)}") from result.error
    events = _events(result)
    at = _record_index(result)
    record = parse_record(_text(events[at]))
    assert record is not None
    summary = _text(events[at - 1])
    assert summary.startswith(SUMMARY_PREFIX), f"the line before the record is not ours: {summary!r}"
    tail = events[at:]
    print(
        f"\n[e2e-ui] {result.path}: from the record to the end of try 1's log: {len(tail)} events, "
        f"{rendered_lines(tail)} rendered lines\n  {summary}"
    )
    return {"events": events, "at": at, "record": record, "summary": summary}


def _shown_traceback(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The exceptions of the Task SDK's ``Task failed with exception`` event after the record."""
    failed = [e for e in events if _text(e) == TASK_FAILED]
    assert len(failed) == 1, f"expected one {TASK_FAILED!r} event, found {len(failed)}"
    return list(failed[0].get("error_detail") or [])


@pytest.mark.parametrize("path", list(SUMMARIES))
def test_a_killed_try_ends_with_the_line_the_record_and_a_short_traceback(
    e2e: E2EEnv, killed_runs: KilledRuns, path: str
) -> None:
    result = killed_runs.results[path]
    seen = _judge(e2e, result)
    start, end = SUMMARIES[path]
    summary, record = seen["summary"], seen["record"]
    assert summary.startswith(start) and summary.endswith(end), summary
    assert re.search(r" · \d+ processes killed, 0 left · ", summary), summary
    assert list(record)[:3] == ["cause", "detail", "outcome"], list(record)
    assert record["outcome"] == "cancelled"

    exceptions = _shown_traceback(seen["events"][seen["at"] :])
    assert [e["exc_type"] for e in exceptions] == ["TaskCancelled"], "the unwind chain is shown"
    frames = exceptions[0]["frames"]
    leaked = [f["filename"] for f in frames if any(part in f["filename"] for part in INTERNAL)]
    assert not leaked, f"internal frames in the shown traceback: {leaked}"
    assert len(frames) <= 16, f"{len(frames)} frames shown"


@pytest.mark.parametrize("path", list(SUMMARIES))
def test_every_airflow_error_after_the_record_was_announced(
    e2e: E2EEnv, killed_runs: KilledRuns, path: str
) -> None:
    """What the record calls expected is what Airflow then logs: no more, no less."""
    result = killed_runs.results[path]
    seen = _judge(e2e, result)
    announced = [line["line"] for line in seen["record"].get("airflow_logs_next", [])]

    def airflow_lines() -> list[str]:
        events = fetch_log(e2e, result, 1)
        after = events[[_text(e) for e in events].index(_text(seen["events"][seen["at"]])) + 1 :]
        loud = ("error", "warning", "critical")
        noisy = [_text(e) for e in after if e.get("level") in loud and _text(e) != TASK_FAILED]
        # The e2e DAG's own callbacks log at WARNING; they are the test's, not Airflow's.
        return [text for text in noisy if not text.startswith("E2E_")]

    # The supervisor writes "Task killed!" once it has reaped the task: possibly after the run
    # settled. Read the log again until Airflow's lines are all there (or the wait runs out).
    with contextlib.suppress(AssertionError):
        wait_until(lambda: len(airflow_lines()) >= len(announced), 15, "Airflow's lines", interval=0.5)
    logged = airflow_lines()
    assert logged == announced, f"announced {announced}, Airflow logged {logged}"


def test_the_connection_forms_test_button_asks_the_model(e2e: E2EEnv) -> None:
    """``POST /api/v2/connections/test``, what the form's *Test* button sends: a real request to
    the local model server through the API server's own hook, and the ``test`` model."""
    body = {
        "connection_id": "ui_test_button",
        "conn_type": "cancellable_agents_model",
        "host": e2e.model_server.base_url,
        "schema": "openai:echo",
    }
    before = len(e2e.model_server.requests)
    answer = e2e.rest.json("POST", "/api/v2/connections/test", json=body)
    assert answer["status"] is True, answer
    assert "echo: Reply with: ok" in answer["message"], answer
    assert len(e2e.model_server.requests) == before + 1

    bad = e2e.rest.json("POST", "/api/v2/connections/test", json={**body, "schema": "openai:no-such-model"})
    assert bad["status"] is False and "no-such-model" in bad["message"], bad

    keyless = {"connection_id": "ui_test_model", "conn_type": "cancellable_agents_model", "schema": "test"}
    answer = e2e.rest.json("POST", "/api/v2/connections/test", json=keyless)
    assert answer["status"] is True, answer
