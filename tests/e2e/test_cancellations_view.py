"""The Cancellations view in the session's real Airflow 3.3, from real kills: the stored record
of a marked-failed try, an evicted one and a durable try whose retry resumed, each opened in
headless Chromium as its tab (the plugin's page the task instance's iframe loads) and on the fleet
page; the resumed retry (try 2, not killed) with the facts it stored at its end: the try it
resumed from and the steps that saved, and a try that waited deferred (``e2e_deferred_timeout``),
each on its tab and counted on the fleet page; authorization
with a second user the auth manager grants no DAG; a command line holding ``<script>`` shown as
text.

Screenshots go to ``tests/e2e/artifacts/cancellations_view/`` (gitignored); their paths are
printed. Adds ~30-40 s to the e2e session: one durable run (its kill and resumed retry) beside the
session's kill paths, which it shares, and one browser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from cancellable_agents.airflow.kill_record._stored import key_for_try
from tests.e2e.airflow_stack import ADMIN_USER, NO_ACCESS_USER, wait_until
from tests.e2e.browser import Chromium, ui_cookie
from tests.e2e.conftest import E2EEnv, KilledRuns
from tests.e2e.driver import E2E_TEST_TIMEOUT, TASK_ID, PathResult, _ti_path
from tests.e2e.test_deferred import _drive_to_the_end, _run
from tests.e2e.test_durable import DurableResult, _drive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

ARTIFACTS = Path(__file__).with_name("artifacts") / "cancellations_view"
SCRIPT = "<script>document.title='owned'</script>"
#: The text the task instance page's Cancellations tab shows (its iframe is of the same origin).
IFRAME_TEXT = "(() => { const f = document.querySelector('iframe'); "
IFRAME_TEXT += (
    "return (f && f.contentDocument && f.contentDocument.body) ? f.contentDocument.body.innerText : ''; })()"
)
#: The tries a task instance's tab shows, in its order.
SECTIONS = "Array.from(document.querySelectorAll('section.try')).map(s => s.dataset.try)"
#: The DOM after the page loaded: no script element, the title untouched.
NO_SCRIPT_RAN = (
    "document.querySelectorAll('script').length === 0 && document.title.startsWith('Cancellations')"
)


@pytest.fixture(scope="module")
def screenshots() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def resumed(e2e: E2EEnv) -> DurableResult:
    """One durable run evicted at its 4th tool; its retry resumes from the journal."""
    run = _drive(e2e, "evicted")
    if run.result.error is not None:
        pytest.fail(f"the durable run did not complete: {run.result.error!r}")
    return run


def _stored(e2e: E2EEnv, result: PathResult, try_number: int = 1) -> dict[str, Any]:
    """The stored document of ``try_number``, through Airflow's own REST API."""
    path = f"{_ti_path(result)}/state-store/{key_for_try(try_number)}"

    def found() -> dict[str, Any] | None:
        response = e2e.rest.request("GET", path)
        return response.json()["value"] if response.status_code == 200 else None

    return wait_until(found, 30, f"{result.path}: the stored record of try {try_number}", interval=0.2)


def _ti_page(e2e: E2EEnv, result: PathResult) -> str:
    params = {"dag_id": result.dag_id, "run_id": result.run_id, "task_id": TASK_ID, "map_index": -1}
    return f"{e2e.stack.url}/cancellations/ti?{urlencode(params)}"


def _token(e2e: E2EEnv, user: str) -> str:
    return ui_cookie(e2e.stack.url, user, e2e.stack.password)[1]


@pytest.fixture(scope="module")
def waited(e2e: E2EEnv) -> Iterator[Future[PathResult]]:
    """A try that waited deferred and was not killed: ``e2e_deferred_timeout``'s wait (12 s, no
    worker slot) times out, the model is told, the task succeeds. Driven beside the module's
    other runs (it mostly waits), so it costs the session little time."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-view-deferred") as pool:
        yield pool.submit(_drive_to_the_end, e2e, _run("view", "e2e_deferred_timeout"))


@pytest.fixture(scope="module")
def results(
    waited: Future[PathResult], killed_runs: KilledRuns, resumed: DurableResult
) -> Iterator[dict[str, PathResult]]:
    found = {name: killed_runs.results[name] for name in ("mark_failed", "eviction")}
    for name, result in found.items():
        if result.error is not None:
            pytest.fail(f"the {name} run did not complete: {result.error!r}")
    yield {**found, "resumed": resumed.result}


@pytest.mark.parametrize(
    ("path", "cause"), [("mark_failed", "user"), ("eviction", "eviction"), ("resumed", "eviction")]
)
def test_the_task_instance_tab_draws_the_kill(
    e2e: E2EEnv, results: dict[str, PathResult], chromium: Chromium, screenshots: Path, path: str, cause: str
) -> None:
    result = results[path]
    stored = _stored(e2e, result)
    assert stored["record"]["cause"] == cause and stored["try"] == 1
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        # As the UI shows it: the plugin's tab on the task instance page, an iframe of the view.
        page.goto(
            f"{e2e.stack.url}/dags/{result.dag_id}/runs/{result.run_id}/tasks/{TASK_ID}/plugin/cancellations_ti"
        )
        frame = wait_until(
            lambda: page.evaluate("(document.querySelector('iframe') || {}).src || ''"),
            60,
            "the tab's iframe",
        )
        in_ui = page.screenshot(screenshots / f"{path}_tab_in_ui.png")
        page.goto(_ti_page(e2e, result))
        text = page.wait_for_text("Resume point", timeout=30)  # the section's last line: all rendered
        bars = page.evaluate("document.querySelectorAll('svg.timeline rect.bar').length")
        grace = page.evaluate("document.querySelectorAll('svg.timeline line.grace').length")
        killed = page.evaluate("Math.max(0, document.querySelectorAll('table.killed tr').length - 1)")
        shot = page.screenshot(screenshots / f"{path}_tab.png")
    print(f"\n[e2e-ui] {path}: the tab in the UI {in_ui}, the view {shot}")
    assert "/cancellations/ti?" in frame and result.run_id in frame, frame
    assert f"cause\t{cause}" in text or f"cause {cause}" in text, text[:2000]
    assert bars >= 1 and grace == 1, (bars, grace)
    assert killed == len(stored["record"].get("killed") or ())
    assert f"{killed} killed, 0 left" in text
    if path == "resumed":
        assert "the next try resumes after this try's 4 journaled model requests" in text, text[-2000:]


def test_the_fleet_page_counts_the_kills(
    e2e: E2EEnv, results: dict[str, PathResult], chromium: Chromium, screenshots: Path
) -> None:
    for result in results.values():
        _stored(e2e, result)
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        page.goto(f"{e2e.stack.url}/cancellations/fleet")
        text = page.wait_for_text("page 1 of", timeout=30)  # the page's last line
        leftovers = page.evaluate("document.querySelector('td.leftovers').innerText")
        shot = page.screenshot(screenshots / "fleet.png")
        page.goto(f"{e2e.stack.url}/cancellations/fleet?dag_id=e2e_eviction")
        filtered = page.wait_for_text("page 1 of", timeout=30)
    print(f"\n[e2e-ui] fleet page: {shot}")
    for result in results.values():
        assert result.dag_id in text and result.run_id in text
    assert leftovers == "0"
    assert "e2e_mark_failed" not in filtered and results["eviction"].run_id in filtered


def test_the_resumed_try_2_shows_its_resume_on_the_tab_and_on_the_fleet_page(
    e2e: E2EEnv, results: dict[str, PathResult], chromium: Chromium, screenshots: Path
) -> None:
    """The evicted durable run's try 2 was not killed: it resumed try 1's journal and finished,
    and stored those facts at its end. The steps it saved are try 1's journaled model requests."""
    result = results["resumed"]
    killed, finished = _stored(e2e, result, 1), _stored(e2e, result, 2)
    journaled = killed["record"]["attached"]["durable"]["usage_this_try"]["requests"]
    assert (finished["kind"], finished["try"], finished["record"]["outcome"]) == ("facts", 2, "completed")
    resume = finished["record"]["resume"]
    assert (resume["from_try"], resume["steps_reused"]) == (1, journaled), finished
    resumed_words = f"from try 1: {journaled} journaled model requests reused instead of repeated"
    listed_words = f"completed; resumed from try 1, {journaled} steps saved"
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        page.goto(_ti_page(e2e, result))
        text = page.wait_for_text("Resume point", timeout=30)
        sections = page.evaluate(SECTIONS)
        resumed_cell = page.evaluate("(document.querySelector('section.facts td.resumed') || {}).innerText")
        tab = page.screenshot(screenshots / "resumed_try2_tab.png")
        page.goto(f"{e2e.stack.url}/cancellations/fleet?{urlencode({'dag_id': result.dag_id})}")
        fleet = page.wait_for_text("page 1 of", timeout=30)
        resumes = int(page.evaluate("document.querySelector('td.resumes').innerText"))
        saved = int(page.evaluate("document.querySelector('td.steps-saved').innerText"))
        shot = page.screenshot(screenshots / "resumed_try2_fleet.png")
    print(f"\n[e2e-ui] resumed try 2: the tab {tab}, the fleet page {shot}")
    assert sections == ["2", "1"], sections
    assert "Try 2: not killed" in text and resumed_words in (resumed_cell or ""), text[:2000]
    assert f"try 2 resumed from try 1 and reused {journaled} journaled model requests" in text
    # Other durable runs of the session may be in this DAG too: at least this one's.
    assert resumes >= 1 and saved >= journaled, (resumes, saved)
    assert listed_words in fleet and result.run_id in fleet


def test_a_try_that_waited_deferred_shows_its_wait_on_the_tab_and_on_the_fleet_page(
    e2e: E2EEnv,
    results: dict[str, PathResult],
    waited: Future[PathResult],
    chromium: Chromium,
    screenshots: Path,
) -> None:
    """A try that was not killed but waited deferred (12 s, then its wait timed out and the model
    was told): its wait stored at its end, shown on its tab and counted on the fleet page."""
    result = waited.result(timeout=E2E_TEST_TIMEOUT)
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1), result.final_ti
    stored = _stored(e2e, result, 1)
    assert (stored["kind"], stored["record"]["outcome"]) == ("facts", "completed"), stored
    (wait,) = stored["record"]["waits"]
    # Its 12 s timeout counts from when the task deferred (the stored seconds are rounded).
    assert wait["kind"] == "deferred" and wait["timed_out"] == wait["calls"], wait
    assert wait["waited_s"] >= 11.99, wait
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        page.goto(_ti_page(e2e, result))
        text = page.wait_for_text("Try 1: not killed", timeout=30)
        cell = page.evaluate("(document.querySelector('section.facts td.wait.deferred') || {}).innerText")
        tab = page.screenshot(screenshots / "deferred_wait_tab.png")
        page.goto(f"{e2e.stack.url}/cancellations/fleet?{urlencode({'dag_id': result.dag_id})}")
        fleet = page.wait_for_text("page 1 of", timeout=30)
        counted = page.evaluate("document.querySelector('td.deferred-waits').innerText")
        shot = page.screenshot(screenshots / "deferred_wait_fleet.png")
    print(f"\n[e2e-ui] a deferred wait: the tab {tab}, the fleet page {shot}")
    assert f"{wait['waited_s']:.1f} s deferred to a trigger" in (cell or ""), text[:2000]
    assert "holding no worker slot; timed out" in (cell or "")
    waits, seconds = int(counted.split()[0]), float(counted.split("(")[1].split()[0])
    assert waits >= 1 and seconds >= 11, counted
    assert "completed; 1 deferred wait(s)" in fleet and result.run_id in fleet


def test_a_user_who_may_not_read_the_dag_gets_403_and_sees_no_record(
    e2e: E2EEnv, results: dict[str, PathResult]
) -> None:
    url = _ti_page(e2e, results["mark_failed"])
    outsider = {"Authorization": f"Bearer {_token(e2e, NO_ACCESS_USER)}"}
    admin = {"Authorization": f"Bearer {_token(e2e, ADMIN_USER)}"}
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers=outsider, timeout=30).status_code == 403
    assert httpx.get(url, headers=admin, timeout=30).status_code == 200
    fleet = f"{e2e.stack.url}/cancellations/fleet"
    hidden = httpx.get(fleet, headers=outsider, timeout=30)
    assert hidden.status_code == 200 and "0 records match" in hidden.text
    assert results["mark_failed"].run_id not in hidden.text
    # Airflow's own REST API agrees: the same user may not read the task instance.
    api = httpx.get(f"{e2e.stack.url}{_ti_path(results['mark_failed'])}", headers=outsider, timeout=30)
    assert api.status_code == 403


def test_a_command_holding_a_script_tag_shows_as_text(
    e2e: E2EEnv, results: dict[str, PathResult], chromium: Chromium, screenshots: Path
) -> None:
    """A stored record whose killed command line (a model chose it) holds markup: written where
    the task writes it, the view shows the text and runs nothing."""
    result = results["eviction"]
    document = _stored(e2e, result)
    document["try"] = 9
    document["record"]["killed"] = [
        {"source": "sandbox", "pid": 1, "command": f"echo '{SCRIPT}'", "signal": 9}
    ]
    document["record"]["detail"] = SCRIPT
    store = f"{_ti_path(result)}/state-store/{key_for_try(9)}"
    e2e.rest.json("PUT", store, json={"value": document}, expect=(200, 204))
    try:
        cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
        with chromium.page(cookie) as page:
            page.goto(_ti_page(e2e, result))
            text = page.wait_for_text("Resume point", timeout=30)
            clean = page.evaluate(NO_SCRIPT_RAN)
            shot = page.screenshot(screenshots / "script_as_text.png")
        served = httpx.get(
            _ti_page(e2e, result), headers={"Authorization": f"Bearer {_token(e2e, ADMIN_USER)}"}
        )
    finally:
        e2e.rest.request("DELETE", store)
    print(f"\n[e2e-ui] a <script> command line as text: {shot}")
    assert f"echo '{SCRIPT}'" in text and clean is True
    assert "script-src" not in served.headers["content-security-policy"]
    assert "default-src 'none'" in served.headers["content-security-policy"]


def test_the_stored_document_is_the_task_logs_record(e2e: E2EEnv, results: dict[str, PathResult]) -> None:
    """One format: what is stored is the record the task log has, wrapped."""
    result = results["mark_failed"]
    logged = result.records(1)[0]
    assert _stored(e2e, result)["record"] == json.loads(json.dumps(logged))
