"""The Airflow UI itself, in headless Chromium: a marked-failed try's log page and the connection
form, as a DAG author sees them. Screenshots are kept in the test's tmp dir (printed with ``-s``).

Needs the Debian ``chromium`` package (``make system-deps`` installs it); skipped, saying so,
where it is not installed. Adds ~20-30 s to the e2e session (one browser, four pages).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.e2e.airflow_stack import ADMIN_USER
from tests.e2e.browser import Chromium
from tests.e2e.conftest import E2EEnv, KilledRuns
from tests.e2e.driver import TASK_ID

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONN_ID = "ui_form_llm"
WRONG_KEY_CONN_ID = "ui_form_wrong_key"
#: Standard fields of the form, in the order the UI shows them, and the ones hidden.
SHOWN = ("Description", "Base URL", "Model id", "API key", "Port")
HIDDEN = ("Login",)

#: Click the button labelled LABEL on the connection list's row of connection ID.
ON_ROW = """
(id, label) => { const cell = [...document.querySelectorAll('*')].find(e =>
  e.childElementCount === 0 && (e.textContent || '').trim() === id);
  const row = cell && cell.closest('tr'); if (!row) return false;
  const button = [...row.querySelectorAll('button')].find(b =>
    b.getAttribute('aria-label') === label || (b.innerText || '').trim() === label);
  if (!button) return false; button.click(); return true; }
"""

#: For every input with a placeholder: does the placeholder's text fit the input's width?
PLACEHOLDERS_FIT = """
(() => [...document.querySelectorAll('input[placeholder]')].map(input => {
  const style = getComputedStyle(input);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = style.font;
  const room = input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return [input.placeholder, ctx.measureText(input.placeholder).width <= room];
}))()
"""


#: Scroll the log view so our human line is at its top (the page opens at the end of the log).
SCROLL_TO_SUMMARY = """
(() => { const el = [...document.querySelectorAll('*')].find(e =>
  e.childElementCount === 0 && (e.textContent || '').includes('cancelled: user marked it failed'));
  if (!el) return false;
  el.scrollIntoView({block: 'start', inline: 'nearest'});
  document.querySelectorAll('*').forEach(e => { if (e.scrollLeft) e.scrollLeft = 0; });
  return true; })()
"""


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def _ui_cookie(e2e: E2EEnv) -> tuple[str, str, str]:
    """The UI's session cookie, as its login page sets it."""
    response = httpx.post(
        f"{e2e.stack.url}/auth/token",
        json={"username": ADMIN_USER, "password": e2e.stack.password},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return "_token", response.json()["access_token"], e2e.stack.url


def test_the_log_page_of_a_marked_failed_try_reads_at_a_glance(
    e2e: E2EEnv, killed_runs: KilledRuns, chromium: Chromium, screenshots: Path
) -> None:
    result = killed_runs.results["mark_failed"]
    if result.error is not None:
        pytest.fail(f"the mark_failed run did not complete: {result.error!r}")
    url = f"{e2e.stack.url}/dags/{result.dag_id}/runs/{result.run_id}/tasks/{TASK_ID}?try_number=1"
    with chromium.page(_ui_cookie(e2e)) as page:
        page.goto(url)
        text = page.wait_for_text("cancelled: user marked it failed", timeout=60)
        text = page.wait_for_text("TaskCancelled", timeout=20)
        shot = page.screenshot(screenshots / "mark_failed_log.png")
        page.evaluate(SCROLL_TO_SUMMARY)
        top = page.screenshot(screenshots / "mark_failed_log_summary.png")
    print(f"\n[e2e-ui] log page screenshots: {shot} (as it opens), {top} (scrolled to our line)")
    # The page opens at the end of the log: what it shows there is ours, and reads as a stop.
    assert '"cause": "user", "detail": "marked failed", "outcome": "cancelled"' in text
    for internal in ("WouldBlock", "CancelledError", "RunCancelled", "anyio", "asyncio"):
        assert internal not in text, f"{internal} is on the log page"


def _press_test(chromium: Chromium, e2e: E2EEnv, conn_id: str, screenshot: Path) -> tuple[int, str, str]:
    """Press *Test* on ``conn_id``'s row of the connection list; the API's answer and the page."""
    with chromium.page(_ui_cookie(e2e)) as page:
        page.goto(f"{e2e.stack.url}/connections")
        page.wait_for_text(conn_id, timeout=60)
        page.call("Network.enable")
        assert page.evaluate(f"({ON_ROW})({json.dumps(conn_id)}, 'Test Connection')"), page.text()[-2000:]
        status, body = page.wait_for_response("/api/v2/connections/test", timeout=60)
        if status == 200:  # the toast shows the hook's message
            page.wait_for_text(json.loads(body)["message"][:40], timeout=30)
        text = page.text()
        page.screenshot(screenshot)
    return status, body, text


def test_the_connection_form_shows_the_model_id_and_its_test_button_works(
    e2e: E2EEnv, chromium: Chromium, screenshots: Path
) -> None:
    conn = {
        "connection_id": CONN_ID,
        "conn_type": "cancellable_agents_model",
        "host": e2e.model_server.base_url,
        "port": e2e.model_server.port,  # what Airflow 3.3.1-3.3.2's Test button needs stored
        "schema": "openai:echo",
    }
    e2e.rest.json("POST", "/api/v2/connections", json=conn, expect=(201, 409))
    with chromium.page(_ui_cookie(e2e)) as page:
        page.goto(f"{e2e.stack.url}/connections")
        page.wait_for_text(CONN_ID, timeout=60)
        assert page.evaluate(f"({ON_ROW})({json.dumps(CONN_ID)}, 'Edit Connection')"), page.text()[-2000:]
        form = page.wait_for_text("Model id", timeout=30)
        fits = page.evaluate(PLACEHOLDERS_FIT)
        shot = page.screenshot(screenshots / "connection_form.png")
    before = len(e2e.model_server.requests)
    status, body, text = _press_test(chromium, e2e, CONN_ID, screenshots / "connection_tested.png")
    print(f"\n[e2e-ui] connection form screenshots: {shot}, {screenshots / 'connection_tested.png'}")
    positions = [form.find(label) for label in SHOWN]
    assert all(p >= 0 for p in positions), f"missing fields: {dict(zip(SHOWN, positions, strict=True))}"
    for label in HIDDEN:
        assert f"\n{label}\n" not in form, f"{label} is shown"
    assert "Extra Fields JSON" in form  # the only extra is the raw JSON editor, collapsed
    assert fits and all(ok for _, ok in fits), f"placeholders cut off: {fits}"
    assert status == 200 and json.loads(body)["status"] is True, (status, body)
    assert "Model 'echo' answered" in text
    assert len(e2e.model_server.requests) == before + 1, "the Test button did not reach the model server"


def test_the_test_button_says_a_wrong_key_is_wrong(
    e2e: E2EEnv, chromium: Chromium, screenshots: Path
) -> None:
    with ScriptedModelServer(api_key="the-right-key") as server:
        conn = {
            "connection_id": WRONG_KEY_CONN_ID,
            "conn_type": "cancellable_agents_model",
            "host": server.base_url,
            "port": server.port,
            "schema": "openai:echo",
            "password": "a-wrong-key",
        }
        e2e.rest.json("POST", "/api/v2/connections", json=conn, expect=(201, 409))
        status, body, text = _press_test(
            chromium, e2e, WRONG_KEY_CONN_ID, screenshots / "connection_wrong_key.png"
        )
    assert status == 200, (status, body)
    answer = json.loads(body)
    assert answer["status"] is False and "401" in answer["message"], answer
    assert "Incorrect API key provided" in text, "the page does not say the key is wrong"
