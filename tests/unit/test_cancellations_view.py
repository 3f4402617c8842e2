"""The Cancellations view without a server: the stored record's bound and its one write, the
pages built from records (escaping, the timeline's bars and lines, the fleet's summaries); the
facts a try that was not killed stores at its end (resumed, wound down, waited), from real
operator runs, and how the pages show and sum them.

The pages in a real Airflow, in Chromium, with authorization: ``tests/e2e/test_cancellations_view.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents import AgentOperator, DurableOptions, TaskCancelled, WindDown
from cancellable_agents.airflow.cancellations_view._pages import (
    FleetQuery,
    StoredRow,
    fleet_page,
    task_instance_page,
)
from cancellable_agents.airflow.kill_record._stored import (
    FORMAT,
    KEY_PREFIX,
    MAX_BYTES,
    bounded,
    key_for_try,
    store_record,
    stored_document,
)
from cancellable_agents.airflow.kill_record._try_facts import ResumeFacts, TryFacts
from cancellable_agents.durable._stores import MemoryStore
from tests.unit.durable_runs import TI, operator_agent

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


# -- a try that was not killed: its facts ------------------------------------------------------
#
# Each try here is a real operator's execute (FunctionModel runs, a durable record in files): the
# facts are what the try itself wrote at its end, read back as the pages read them.


def _durable_try(tmp_path: Path, store: MemoryStore, try_number: int, kill_at: int | None) -> Any:
    box: list[Any] = []
    op = AgentOperator(
        task_id="agent",
        agent=operator_agent(kill_at, box),
        prompt="four steps",
        durable=DurableOptions(path=str(tmp_path)),
        classify_timeout=0.2,
    )
    box.append(op)
    try:
        return op.execute({"ti": TI(try_number), "task_state_store": store})
    except TaskCancelled as exc:
        return exc


def _rows_of(store: MemoryStore) -> list[StoredRow]:
    return [StoredRow("d", "manual__1", "agent", -1, store.get(key)) for key in sorted(store.data)]


def test_a_try_that_resumed_and_finished_stores_its_resume_and_the_pages_show_the_steps_saved(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    assert isinstance(_durable_try(tmp_path, store, 1, kill_at=3), TaskCancelled)
    killed = store.get(key_for_try(1))
    assert killed["kind"] == "killed" and killed["format"] == FORMAT
    writes = store.writes
    assert _durable_try(tmp_path, store, 2, kill_at=None) == "done"
    assert store.writes == writes + 1, "one write at the end of the try"
    document = store.get(key_for_try(2))
    assert (document["kind"], document["try"]) == ("facts", 2)
    facts = TryFacts.from_dict(document["record"])
    # Try 1 made three model requests (steps 1-3) before the kill: try 2 reused them all.
    assert isinstance(facts.resume, ResumeFacts)
    assert (facts.resume.from_try, facts.resume.steps_reused) == (1, 3)
    assert facts.resume.messages_restored >= 6 and facts.resume.tool_calls_rerun
    assert (facts.outcome, facts.wound_down, facts.waits) == ("completed", (), ())
    assert facts.usage["requests"] == 2, "tool 3's step again was not a request: steps 4 and the answer"

    tab = task_instance_page("d / manual__1 / agent", _rows_of(store), "/cancellations/fleet")
    assert "Try 2: not killed" in tab
    assert "from try 1: 3 journaled model requests reused instead of repeated" in tab
    assert "try 2 resumed from try 1 and reused 3 journaled model requests" in tab, "try 1's resume point"
    assert tab.index("data-try='2'") < tab.index("data-try='1'"), "newest first"
    rows = _rows_of(store)
    fleet = fleet_page(rows, rows, 2, FleetQuery(), 50, "/ti", 2000)
    assert "<td class='resumes'>1</td>" in fleet and "<td class='steps-saved'>3</td>" in fleet
    assert "<th>unknown</th>" in fleet, "try 1, the kill, is in the kills by cause"
    assert "completed; resumed from try 1, 3 steps saved" in fleet
    assert "<tr><td>d</td><td>1</td>" in fleet, "the unwind summary counts the kill alone"


def test_a_plain_successful_try_stores_nothing(tmp_path: Path) -> None:
    store = MemoryStore()
    assert _durable_try(tmp_path, store, 1, kill_at=None) == "done"
    assert store.writes == 0 and not store.data


def test_a_wound_down_try_stores_why_and_when(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_wind_down import Budgeted

    store = MemoryStore()
    op = Budgeted(task_id="budgeted", wind_down=WindDown(budget=True))
    started = time.time()
    assert op.execute({"ti": TI(1), "task_state_store": store}) == "best so far after 3 steps"
    facts = TryFacts.from_dict(store.get(key_for_try(1))["record"])
    (wound,) = facts.wound_down
    assert facts.outcome == "wound_down" and facts.resume is None
    assert (wound.reason, wound.requests_made, wound.requests_left) == ("request_limit", 3, 1)
    assert wound.at is not None and started <= wound.at <= time.time()
    assert wound.final_answer_s is not None
    rows = _rows_of(store)
    tab = task_instance_page("t", rows, "/f")
    assert "wound down: answered at its wind-down" in tab
    assert "at the request limit at " in tab and "after 3 requests, 1 requests left" in tab
    fleet = fleet_page(rows, rows, 1, FleetQuery(), 50, "/ti", 2000)
    assert "<td class='wind-downs'>1</td>" in fleet
    assert "<table class='by-cause'><tr><th>day</th></tr></table>" in fleet, "no kill counted"

    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__STORE_CANCELLATION_RECORD", "False")
    off = MemoryStore()
    Budgeted(task_id="budgeted", wind_down=WindDown(budget=True)).execute(
        {"ti": TI(1), "task_state_store": off}
    )
    assert off.writes == 0, "the setting turns the facts off too"


def test_waits_of_both_kinds_are_shown_and_summed() -> None:
    deferred = {
        "kind": "deferred",
        "waited_s": 12.5,
        "calls": ["run_job"],
        "timed_out": [],
        "ended_at": 1.8e9,
    }
    approval = {"kind": "approval", "waited_s": 30.0, "calls": [SCRIPT], "timed_out": [], "ended_at": 1.8e9}
    facts = {
        "outcome": "completed",
        "waits": [deferred, approval, approval],
        "wound_down": [],
        "resume": None,
    }
    finished = StoredRow("d", "r", "agent", -1, stored_document(facts, 1, now=1.8e9, kind="facts"))
    # A killed try that had waited (format 1's last deferral, before waits were kept as a list).
    killed = _row(
        _record(attached={"deferred": {"waited_s": 4.0, "calls": ["c1"], "timed_out": []}}), try_number=2
    )
    tab = task_instance_page("t", [finished, killed], "/f")
    assert "12.5 s deferred to a trigger for run_job, holding no worker slot" in tab
    assert "30.0 s awaiting approval for &lt;script&gt;" in tab and "<script" not in tab
    assert "4.0 s deferred to a trigger for c1" in tab, "the killed try's wait too"
    rows = [finished, killed]
    fleet = fleet_page(rows, rows, 2, FleetQuery(), 50, "/ti", 2000)
    assert "<td class='deferred-waits'>2 (16 s)</td>" in fleet
    assert "<td class='approval-waits'>2 (60 s)</td>" in fleet
    assert "completed; 1 deferred wait(s), 12 s; 2 approval wait(s), 60 s" in fleet


def test_a_format_1_document_is_a_kill_record() -> None:
    old = {"format": 1, "try": 1, "written_at": 1.8e9, "record": _record()}
    row = StoredRow("d", "r", "agent", -1, old)
    assert row.killed and row.facts.outcome == "cancelled"
    assert "1 killed, 0 left" in task_instance_page("t", [row], "/f")


# -- the app's queries, on this Airflow's own tables ---------------------------------------------

#: Run in a child with a migrated throwaway Airflow (SQLite): store each document where this
#: Airflow's tasks store it (the task state store's row on 3.3+, the XCom row the Task SDK's
#: ``xcom_push`` writes on 3.1/3.2: the value's JSON text), then read them back through the app's
#: queries. Foreign keys are off: the rows' DAG runs are not what is tested.
_QUERY_CHILD = """
import json, sys
from datetime import datetime, timedelta, timezone
from sqlalchemy import text
from airflow.utils.session import create_session
from cancellable_agents.airflow.cancellations_view._app import FleetFilter, Records
from cancellable_agents.airflow.kill_record._stored import key_for_try

records = Records.here()
model = records.model
start = datetime(2026, 12, 1, tzinfo=timezone.utc)
with create_session() as session:
    session.execute(text("PRAGMA foreign_keys=OFF"))
    for i, (dag_id, run_id, document) in enumerate(json.loads(sys.argv[1])):
        row = dict(dag_run_id=i + 1, task_id="agent", map_index=-1, key=key_for_try(document["try"]),
                   dag_id=dag_id, run_id=run_id, value=json.dumps(document))
        written = start + timedelta(minutes=i)
        row["updated_at" if records.id is not None else "timestamp"] = written
        session.add(model(**row))
with create_session() as session:
    tab = records.of_task_instance(session, "dag_a", "run_1", "agent", -1)
    window, listed, total = records.of_fleet(session, FleetFilter({"dag_a"}), 1)
    since = records.of_fleet(session, FleetFilter({"dag_a", "dag_b"}, since=start + timedelta(minutes=1)), 1)
print(json.dumps({
    "table": model.__tablename__,
    "tab": [r.document for r in tab],
    "fleet": [[r.dag_id, r.try_number] for r in window],
    "listed": len(listed),
    "total": total,
    "since": [[r.dag_id, r.try_number] for r in since[0]],
}))
"""


def test_the_apps_queries_read_the_records_where_this_airflow_keeps_them(tmp_path: Path) -> None:
    """Airflow 3.3+: the task state store (every try). Airflow 3.1/3.2 (the compat venvs run
    this): XCom, the same key scheme and documents, so the view works there too."""
    import subprocess
    import sys

    from cancellable_agents.airflow._adapter import has_task_state_store
    from tests.airflow_env import airflow_env, migrate

    env = airflow_env(tmp_path / "airflow_home")
    migrate(env)
    killed = stored_document(_record(), 1, now=1.8e9)
    resumed = {"outcome": "completed", "resume": {"from_try": 1, "steps_reused": 4}, "waits": []}
    documents = [
        ["dag_a", "run_1", killed],
        ["dag_b", "run_9", stored_document(_record(), 1, now=1.8e9)],
        ["dag_a", "run_1", stored_document(resumed, 2, now=1.8e9, kind="facts")],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _QUERY_CHILD, json.dumps(documents)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["table"] == ("task_state_store" if has_task_state_store() else "xcom")
    assert [d["try"] for d in seen["tab"]] == [2, 1], "the task instance's tries, newest first"
    assert seen["tab"][1] == json.loads(json.dumps(killed)), "the document as it was stored"
    assert (seen["fleet"], seen["listed"], seen["total"]) == ([["dag_a", 2], ["dag_a", 1]], 2, 2)
    assert seen["since"] == [["dag_a", 2], ["dag_b", 1]], "written since the filter's time, newest first"
    rows = [StoredRow("dag_a", "run_1", "agent", -1, d) for d in seen["tab"]]
    assert "from try 1: 4 journaled model requests reused" in task_instance_page("t", rows, "/f")
