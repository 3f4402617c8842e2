"""The Cancellations view without a server: the stored record's bound and its one write, the
pages built from records (escaping, the timeline's bars and lines, the fleet's summaries).

The pages in a real Airflow, in Chromium, with authorization: ``tests/e2e/test_cancellations_view.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cancellable_agents.airflow.cancellations_view._pages import (
    FleetQuery,
    StoredRow,
    fleet_page,
    task_instance_page,
)
from cancellable_agents.airflow.kill_record._stored import (
    KEY_PREFIX,
    MAX_BYTES,
    bounded,
    key_for_try,
    store_record,
    stored_document,
)
from cancellable_agents.durable._stores import MemoryStore

SCRIPT = "<script>document.title='owned'</script>"


def _record(**extra: Any) -> dict[str, Any]:
    return {
        "cause": "user",
        "detail": "marked failed",
        "outcome": "cancelled",
        "retry": "not retrying",
        "budget_s": 4.0,
        "timeline": [
            {"event": "run_started", "ms": -300.0},
            {"event": "kill_received", "ms": 0.0, "cause": "deciding"},
            {"event": "released", "ms": 8.2, "resource": "in-flight tools", "took_ms": 4.9},
            {"event": "cause_decided", "ms": 31.0, "cause": "user"},
            {"event": "released", "ms": 32.1, "resource": "sandbox f02 commands", "took_ms": 28.7},
            {"event": "resources_released", "ms": 40.0},
        ],
        "killed": [{"source": "sandbox", "pid": 4242, "command": "sleep 600", "signal": 15}],
        "stragglers": [],
        **extra,
    }


class _Ti:
    try_number = 2


def _row(
    record: dict[str, Any], dag_id: str = "dag_a", try_number: int = 1, at: float = 1_796_000_000
) -> StoredRow:
    return StoredRow(dag_id, "run_1", "agent", -1, stored_document(record, try_number, now=at))


# -- the stored record ------------------------------------------------------------------------


def test_a_record_that_fits_is_stored_as_the_task_log_has_it() -> None:
    record = _record()
    assert bounded(record) == record


def test_a_huge_record_is_cut_under_the_bound_saying_what_was_cut() -> None:
    huge = _record(
        killed=[{"source": "sandbox", "pid": i, "command": "x" * 5000, "signal": 9} for i in range(200)],
        timeline=[
            {"event": "released", "ms": float(i), "resource": "r" * 100, "took_ms": 1.0} for i in range(3000)
        ],
    )
    cut = bounded(huge)
    assert len(json.dumps(cut).encode()) <= MAX_BYTES
    assert cut["cause"] == "user"
    assert "long strings" in cut["truncated"]
    assert cut["timeline_total"] == 3000


def test_the_record_is_written_once_under_its_try_key_into_the_task_state_store() -> None:
    store = MemoryStore()
    where = store_record({"task_state_store": store}, _Ti(), _record())
    assert where == "task_state_store"
    assert list(store.data) == [key_for_try(2)] and key_for_try(2).startswith(KEY_PREFIX)
    document = store.get(key_for_try(2))
    assert document["try"] == 2 and document["record"]["cause"] == "user"


def test_turned_off_nothing_is_written() -> None:
    store = MemoryStore()
    assert store_record({"task_state_store": store}, _Ti(), _record(), enabled=False) is None
    assert store.writes == 0


def test_a_failing_write_is_logged_never_raised() -> None:
    class Refusing(MemoryStore):
        def set(self, key: str, value: Any) -> None:
            raise RuntimeError("the supervisor is gone")

    assert store_record({"task_state_store": Refusing()}, _Ti(), _record()) is None


# -- the pages --------------------------------------------------------------------------------


def test_the_task_instance_page_draws_a_bar_per_release_the_grace_line_and_the_kills() -> None:
    page = task_instance_page("dag_a / run_1 / agent", [_row(_record())], "/cancellations/fleet")
    assert page.count("class='bar'") == 2
    assert "class='grace'" in page and "5 s grace (SIGKILL)" in page
    assert "cause decided: user at 31 ms" in page
    assert "<td>4242</td><td><code>sleep 600</code></td><td>15</td>" in page
    assert "1 killed, 0 left" in page


def test_every_string_from_a_record_is_escaped() -> None:
    record = _record(
        detail=SCRIPT,
        killed=[{"source": SCRIPT, "pid": SCRIPT, "command": f"echo '{SCRIPT}'", "signal": SCRIPT}],
        stragglers=[SCRIPT],
        timeline=[{"event": "released", "ms": 5.0, "resource": SCRIPT, "took_ms": 1.0}],
        cause=SCRIPT,
    )
    pages = [
        task_instance_page(SCRIPT, [_row(record)], "/cancellations/fleet"),
        fleet_page(
            [_row(record, dag_id=SCRIPT)],
            [_row(record, dag_id=SCRIPT)],
            1,
            FleetQuery(dag_id=SCRIPT),
            50,
            "/ti",
            2000,
        ),
    ]
    for page in pages:
        assert "<script" not in page
        assert "&lt;script&gt;" in page


def test_a_resumed_durable_try_names_where_it_resumed_from() -> None:
    durable = {
        "resumed_from_try": 1,
        "messages_restored": 8,
        "tool_calls_rerun": ["work"],
        "recording": True,
        "usage_this_try": {"requests": 2},
    }
    page = task_instance_page("t", [_row(_record(attached={"durable": durable}), try_number=2)], "/f")
    assert "resumed from try 1 (8 messages restored, tool calls rerun: work)" in page
    assert "after this try&#x27;s 2 journaled model requests" in page


def test_the_fleet_page_sums_causes_unwinds_and_leftovers_by_dag() -> None:
    rows = [_row(_record(), "dag_a"), _row(_record(cause="eviction", processes_left=1), "dag_b")]
    page = fleet_page(rows, rows, 2, FleetQuery(), 50, "/cancellations/ti", 2000)
    assert "<th>eviction</th><th>user</th>" in page
    assert "<tr><td>dag_a</td><td>1</td><td>40 ms</td><td>40 ms</td></tr>" in page
    assert "<td class='leftovers'>1</td>" in page
    assert "page 1 of 1" in page


def test_the_fleet_page_pages_through_the_records_keeping_the_filter() -> None:
    page = fleet_page([], [], 120, FleetQuery(dag_id="dag_a", page=2), 50, "/ti", 2000)
    assert "page 2 of 3" in page
    assert "?dag_id=dag_a&amp;since=&amp;until=&amp;page=1'>previous" in page
    assert "page=3'>next" in page


def test_an_unmapped_task_instance_tab_takes_the_uis_unfilled_placeholder_as_minus_one() -> None:
    """Airflow 3.3's UI leaves ``{MAP_INDEX}`` in the tab's URL for an unmapped task (seen in
    the e2e stack's first run: the tab answered 422); anything else must be an index."""
    from fastapi import HTTPException

    from cancellable_agents.airflow.cancellations_view._app import _map_index

    assert [_map_index(t) for t in ("{MAP_INDEX}", "", "-1", "3")] == [-1, -1, -1, 3]
    for bad in ("x", "-2"):
        with pytest.raises(HTTPException) as refused:
            _map_index(bad)
        assert refused.value.status_code == 400 and "map_index" in str(refused.value.detail)
