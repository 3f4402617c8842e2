"""Wind-down on a real Airflow (issue 41, item 6): three runs of an agent whose model keeps calling
its tool while it is offered (``tests/e2e/dags/wind_down.py``), in parallel on the session's stack.

- ``execution_timeout=40s, wind_down=15s``: the task ends **success**, its XCom holds the final
  answer, the last request the model server saw offered no tools, no kill record, and the log
  says it wound down;
- the same task without ``wind_down``: failed as ``timeout`` (its kill record);
- *Mark failed* while the wind-down's final answer is awaited: failed, cause ``user``, no retry.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.airflow_stack import ADMIN_USER, wait_until
from tests.e2e.browser import Chromium, ui_cookie
from tests.e2e.conftest import E2EEnv, _await_dags
from tests.e2e.driver import E2E_TEST_TIMEOUT, FINISHED, PathResult, _trigger, fetch_log, mark_failed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

DAG_IDS = ("e2e_wind_down", "e2e_wind_down_off", "e2e_wind_down_slow")
#: The DAGs' ``execution_timeout``, plus a try's start on a loaded machine and its settling.
SETTLE_S = 40.0 + 60.0


def _ti(env: E2EEnv, result: PathResult) -> dict[str, Any]:
    path = f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/agent"
    return dict(env.rest.json("GET", path))


def _requests(env: E2EEnv, result: PathResult) -> list[Any]:
    """The model requests of this run's try 1 (its prompt carries the try's tag)."""
    tag = result.tag(1)
    return [r for r in env.model_server.requests if tag in json.dumps(r.messages)]


def _settled(env: E2EEnv, result: PathResult) -> dict[str, Any]:
    """Until the task instance is finished (and a failed try is not about to retry); its state."""

    def probe() -> dict[str, Any] | None:
        env.stack.check_alive()
        ti = _ti(env, result)
        run = env.rest.json("GET", f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}")
        return ti if ti["state"] in FINISHED and run["state"] in ("success", "failed") else None

    ti = wait_until(probe, SETTLE_S, f"{result.dag_id} to settle", interval=0.25)
    for try_number in range(1, ti["try_number"] + 1):
        result.logs[try_number] = fetch_log(env, result, try_number)
    return ti


def _mark_failed_in_the_wind_down(env: E2EEnv, result: PathResult) -> dict[str, Any]:
    """Wait for the wind-down's tool-less request, then *Mark failed*; the settled state."""

    def final_request() -> bool:
        env.stack.check_alive()
        return any(r.tools == [] for r in _requests(env, result))

    wait_until(final_request, SETTLE_S, f"{result.dag_id}'s final request", interval=0.1)
    mark_failed(env, result)
    ti = _settled(env, result)

    # The PATCH sets the state at once; the task learns of it at its next heartbeat, unwinds and
    # then writes its record: until that line is in try 1's log.
    def recorded() -> bool:
        result.logs[1] = fetch_log(env, result, 1)
        return bool(result.records(1))

    wait_until(recorded, SETTLE_S, f"{result.dag_id}'s kill record", interval=0.5)
    return ti


WindRuns = tuple[dict[str, PathResult], dict[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def wind_runs(e2e: E2EEnv) -> WindRuns:
    """The three runs, side by side on the session's stack, settled: each run and its task state."""
    _await_dags(e2e.stack, e2e.rest, dag_ids=DAG_IDS)
    runs = {dag_id: PathResult(dag_id, dag_id, f"{dag_id}-{uuid.uuid4().hex[:8]}") for dag_id in DAG_IDS}
    for result in runs.values():
        _trigger(e2e, result)
    with ThreadPoolExecutor(max_workers=3) as pool:
        wound = pool.submit(_settled, e2e, runs["e2e_wind_down"])
        off = pool.submit(_settled, e2e, runs["e2e_wind_down_off"])
        marked = pool.submit(_mark_failed_in_the_wind_down, e2e, runs["e2e_wind_down_slow"])
        return runs, {"wound": wound.result(), "off": off.result(), "marked": marked.result()}


def test_wind_down_ends_success_where_the_timeout_fails_and_mark_failed_still_kills(
    e2e: E2EEnv, wind_runs: WindRuns
) -> None:
    runs, states = wind_runs

    # Wound down: success, the final answer in XCom, a tool-less last request, no kill.
    result = runs["e2e_wind_down"]
    assert (states["wound"]["state"], states["wound"]["try_number"]) == ("success", 1), states["wound"]
    xcom = e2e.rest.json(
        "GET",
        f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/agent/xcomEntries/return_value",
    )
    assert "final answer (after " in json.dumps(xcom), xcom
    requests = _requests(e2e, result)
    assert len(requests) > 2 and requests[-1].tools == [], [r.tools for r in requests]
    assert all(r.tools == ["work"] for r in requests[:-1])
    assert result.records(1) == [], "a wound-down task writes no kill record"
    text = result.log_text(1)
    assert "wound down" in text and "cancellable_agents.wind_down" in text
    assert "AirflowTaskTimeout" not in text

    # Without wind_down: failed as timeout.
    result = runs["e2e_wind_down_off"]
    assert states["off"]["state"] == "failed", states["off"]
    (record,) = result.records(1)
    assert record["cause"] == "timeout", record
    assert all(r.tools == ["work"] for r in _requests(e2e, result))

    # Mark failed during the wind-down: a kill as any other, user, no retry.
    result = runs["e2e_wind_down_slow"]
    assert (states["marked"]["state"], states["marked"]["try_number"]) == ("failed", 1), states["marked"]
    (record,) = result.records(1)
    assert record["cause"] == "user", record
    timeline = [e["event"] for e in record["timeline"]]
    assert "wind_down_started" in timeline, timeline
    print(f"\n[e2e wind-down] wound: {states['wound']['duration']} s; off: {states['off']['duration']} s")


def test_the_log_page_of_a_wound_down_try_says_so(
    e2e: E2EEnv, wind_runs: WindRuns, chromium: Chromium, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """What a DAG author sees in the UI: the try's log page names the wind-down in words (when,
    why, what it had left) and shows no timeout."""
    result = wind_runs[0]["e2e_wind_down"]
    url = f"{e2e.stack.url}/dags/{result.dag_id}/runs/{result.run_id}/tasks/agent?try_number=1"
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        page.goto(url)
        text = page.wait_for_text("wound down", timeout=60)
        shot = page.screenshot(tmp_path_factory.mktemp("screenshots") / "wound_down_log.png")
    print(f"\n[e2e-ui] wound-down log page: {shot}")
    assert "AirflowTaskTimeout" not in text and "TaskCancelled" not in text
