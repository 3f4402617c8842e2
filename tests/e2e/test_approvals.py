"""Tool approval against a real Airflow 3.3 (the session's stack): the task waits in
``awaiting_input`` holding no worker slot, the answer given through the REST API the UI uses
(``PATCH .../hitlDetails``) resumes it, and the run goes on from its record.

``e2e_approval`` (``max_active_tasks=1``): the agent asks for ``send_line`` twice, each needing
approval; a second task ``other`` can only run in a slot the waiting agent does not hold.
Model requests are counted on the local model server: a run approved twice makes 3. One run is
answered by clicking the Required Actions form in headless Chromium (skipped, saying so, where
the Debian ``chromium`` package is not installed; screenshots in the test's tmp dir, printed
with ``-s``).

``e2e_approval_hold`` / ``e2e_approval_exec_timeout``: one call, approved, which holds on try 1
until the task is killed; three such runs go at once (``held_runs``): *Mark failed*, an eviction
(SIGTERM to the supervisor) and ``execution_timeout``, each while the approved call runs; the
timeout's run first waits for its answer longer than its ``execution_timeout``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.airflow.kill_record.document import unwound_ms
from tests.e2e.airflow_stack import ADMIN_USER, wait_until
from tests.e2e.browser import Chromium, Page, ui_cookie
from tests.e2e.conftest import E2EEnv
from tests.e2e.dags.approvals import EXECUTION_TIMEOUT_S
from tests.e2e.driver import (
    E2E_TEST_TIMEOUT,
    TASK_ID,
    PathResult,
    _await_settled,
    _collect_quietly,
    _ti_path,
    _trigger,
    clear,
    evict,
    explained,
    mark_failed,
)
from tests.e2e.procs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

DAG_ID = "e2e_approval"
WAIT_S = 120.0
#: Airflow SIGKILLs a task 5 s after its SIGTERM: a kill must have unwound before that.
BUDGET_MS = 5000.0


def _run(name: str, dag_id: str = DAG_ID) -> PathResult:
    return PathResult(name, dag_id, f"approval-{name}-{uuid.uuid4().hex[:8]}")


def _hitl(result: PathResult) -> str:
    return f"{_ti_path(result)}/-1/hitlDetails"


def _await_awaiting_input(
    env: E2EEnv, result: PathResult, asked: int, parks_this_try: int | None = None
) -> dict[str, Any]:
    """Until the agent waits for its ``asked``-th answer: the TI in awaiting_input after its
    ``asked``-th model request, the form there and not answered. (Airflow keeps a task
    instance's first form, body included, for its later pauses: the body says ``"n": 1``.)"""

    def probe() -> dict[str, Any] | None:
        env.stack.check_alive()
        ti = env.rest.json("GET", _ti_path(result))
        if ti["state"] != "awaiting_input" or _requests(env, result) != asked:
            return None
        if _parks_seen(env, ti["id"], ti["try_number"]) < (parks_this_try or asked):
            return None
        detail = env.rest.json("GET", _hitl(result))
        return detail if not detail.get("response_received") else None

    return wait_until(probe, WAIT_S, f"{result.run_id}: approval {asked} asked", interval=0.25)


def _parks_seen(env: E2EEnv, ti_id: str, try_number: int) -> int:
    """How often the scheduler has taken in the executor's end of a parked execution of ``ti_id``
    in try ``try_number``.

    An answer that comes before that is lost on Airflow 3.3.2: the scheduler then finds the
    resumed task queued with the parked workload's "success" and fails the try ("state changed
    externally"), so the next try asks again. A person never answers that fast; a test must wait.
    """
    log = (env.stack.home / "components" / "scheduler.log").read_text(errors="replace")
    return sum(
        1
        for line in log.splitlines()
        if "TaskInstance Finished" in line
        and ti_id in line
        and "state=awaiting_input" in line
        and f"try_number={try_number}," in line
    )


def _answer(env: E2EEnv, result: PathResult, option: str, params: dict[str, Any] | None = None) -> None:
    env.rest.json(
        "PATCH", _hitl(result), json={"chosen_options": [option], "params_input": params or {}}, expect=(200,)
    )


def _lines(env: E2EEnv, result: PathResult) -> list[dict[str, Any]]:
    path = env.state_dir / f"{result.dag_id}.{result.run_id}.lines"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _requests(env: E2EEnv, result: PathResult) -> int:
    return len(_conversation(env, result))


def _conversation(env: E2EEnv, result: PathResult) -> list[str]:
    """Each model request of this run, as the JSON of its messages."""
    tag = f"[{result.dag_id}/{result.run_id}]"
    return [text for r in env.model_server.requests if tag in (text := json.dumps(r.messages))]


def _task_state(env: E2EEnv, result: PathResult, task_id: str) -> str | None:
    path = f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/{task_id}"
    return env.rest.json("GET", path).get("state")


def _no_agent_process(env: E2EEnv, result: PathResult) -> bool:
    """No process of the waiting agent's try is left (its pid from the TI, gone or not running)."""
    pid = env.rest.json("GET", _ti_path(result)).get("pid")
    return not (isinstance(pid, int) and is_alive(pid))


def test_two_approvals_in_a_row_with_the_slot_free_while_waiting(e2e: E2EEnv) -> None:
    result = _run("approve")
    _trigger(e2e, result)
    form = _await_awaiting_input(e2e, result, 1)
    assert form["options"] == ["Approve", "Reject"]
    # What the reviewer reads: the model's reason, the tool and its arguments.
    assert "> The customer asked for it." in form["body"] and "**send_line**" in form["body"], form["body"]
    assert '"n": 1' in form["body"], form["body"]
    # max_active_tasks=1: `other` runs only because the waiting agent holds no slot.
    wait_until(lambda: _task_state(e2e, result, "other") == "success", WAIT_S, "other to run while waiting")
    assert _task_state(e2e, result, "agent") == "awaiting_input"
    assert _no_agent_process(e2e, result)
    assert (_requests(e2e, result), _lines(e2e, result)) == (1, [])

    _answer(e2e, result, "Approve")
    _await_awaiting_input(e2e, result, 2)
    assert (_requests(e2e, result), [x["n"] for x in _lines(e2e, result)]) == (2, [1])

    _answer(e2e, result, "Approve")
    _await_settled(e2e, result, lambda r: r.run_state == "success")
    assert result.final_ti["state"] == "success" and result.final_ti["try_number"] == 1
    assert _lines(e2e, result) == [{"n": 1, "try": 1, "rerun": False}, {"n": 2, "try": 1, "rerun": False}]
    assert _requests(e2e, result) == 3, "no model request repeated over the pauses"


def test_a_rejection_goes_back_to_the_model_and_the_tool_never_runs(e2e: E2EEnv) -> None:
    result = _run("reject")
    _trigger(e2e, result)
    _await_awaiting_input(e2e, result, 1)
    _answer(e2e, result, "Reject", {"message": "not today"})
    _await_awaiting_input(e2e, result, 2)  # the model goes on (it asks for line 2)
    _answer(e2e, result, "Reject", {"message": "not today either"})
    _await_settled(e2e, result, lambda r: r.run_state == "success")
    assert _lines(e2e, result) == []
    assert _requests(e2e, result) == 3


def test_mark_failed_while_waiting_ends_failed_without_a_retry(e2e: E2EEnv) -> None:
    result = _run("mark-failed")
    _trigger(e2e, result)
    _await_awaiting_input(e2e, result, 1)
    mark_failed(e2e, result)
    _await_settled(e2e, result, lambda r: r.run_state in ("failed", "success"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("failed", 1)
    assert _lines(e2e, result) == [] and _requests(e2e, result) == 1


def test_an_unanswered_approval_is_rejected_by_default_after_the_timeout(e2e: E2EEnv) -> None:
    result = _run("timeout", "e2e_approval_timeout")
    _trigger(e2e, result)
    # The scheduler's sweep (every trigger_timeout_check_interval, 15 s) answers the default. Not
    # waiting to see the form unanswered first: 1 s after the pause the sweep may answer before
    # a poll sees it (a CI run did). The form's answer says what happened instead.
    _await_settled(e2e, result, lambda r: r.run_state in ("failed", "success"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1)
    form = e2e.rest.json("GET", _hitl(result))
    assert form["response_received"] and form["chosen_options"] == ["Reject"], form
    assert _lines(e2e, result) == []
    requests = _conversation(e2e, result)
    assert len(requests) == 2 and "rejected by default" in requests[-1]


def test_a_clear_while_waiting_starts_fresh_and_asks_again(e2e: E2EEnv) -> None:
    result = _run("clear")
    _trigger(e2e, result)
    _await_awaiting_input(e2e, result, 1)
    clear(e2e, result)
    # A Clear is a user's stop: the new try starts fresh (one more model request) and asks again.
    _await_awaiting_input(e2e, result, 2, parks_this_try=1)
    assert e2e.rest.json("GET", _ti_path(result))["try_number"] == 2
    assert _lines(e2e, result) == []
    mark_failed(e2e, result)
    _await_settled(e2e, result, lambda r: r.run_state in ("failed", "success"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("failed", 2)


# -- the form in the UI --------------------------------------------------------------------------


#: The form's JSON editor (the call's arguments) has rendered its text; it loads after the form.
EDITOR_SHOWN = "!!document.querySelector('.monaco-editor .view-lines')?.innerText.includes('\"n\"')"


def _click_answer(page: Page, option: str) -> dict[str, Any]:
    """Click ``option`` on the form; the answer as the API server took it (the UI's PATCH)."""
    page.call("Network.enable")
    page.click_text("button", option)
    status, body = page.wait_for_response("/hitlDetails", method="PATCH", timeout=60)
    assert status == 200, body
    return dict(json.loads(body))


@pytest.mark.usefixtures("held_started")  # the kills below go on meanwhile
def test_approve_and_reject_by_clicking_the_form_in_the_ui(
    e2e: E2EEnv, chromium: Chromium, tmp_path: Path
) -> None:
    result = _run("ui")
    _trigger(e2e, result)
    _await_awaiting_input(e2e, result, 1)
    url = f"{e2e.stack.url}/dags/{result.dag_id}/runs/{result.run_id}/tasks/{TASK_ID}/required_actions"
    cookie = ui_cookie(e2e.stack.url, ADMIN_USER, e2e.stack.password)
    with chromium.page(cookie) as page:
        page.goto(url)
        form = page.wait_for_text("On Approve:", timeout=60)
        wait_until(lambda: page.evaluate(EDITOR_SHOWN), 30, "the arguments' JSON editor", interval=0.2)
        asked = page.screenshot(tmp_path / "approval_form.png")
        approved = _click_answer(page, "Approve")
    print(f"\n[e2e-ui] the Required Actions form: {asked}")
    # What the reviewer reads: the question, the tool, its arguments, where to write to the model.
    for shown in ("Approve send_line?", "send_line", '"n": 1', "Message to the model", "Arguments"):
        assert shown in form, f"{shown!r} is not on the form:\n{form}"
    assert (approved["chosen_options"], approved["responded_by"]["name"]) == (["Approve"], ADMIN_USER)
    _await_awaiting_input(e2e, result, 2)
    assert (_requests(e2e, result), _lines(e2e, result)) == (2, [{"n": 1, "try": 1, "rerun": False}])

    with chromium.page(cookie) as page:
        page.goto(url)
        page.wait_for_text("On Reject:", timeout=60)
        page.type_into("#element_message", "not today: the list is frozen")
        rejected = _click_answer(page, "Reject")
        answered = page.screenshot(tmp_path / "rejected.png")
    print(f"[e2e-ui] after Reject: {answered}")
    assert rejected["chosen_options"] == ["Reject"]
    assert rejected["params_input"]["message"] == "not today: the list is frozen"
    _await_settled(e2e, result, lambda r: r.run_state in ("failed", "success"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1)
    assert _lines(e2e, result) == [{"n": 1, "try": 1, "rerun": False}], "the rejected call ran"
    requests = _conversation(e2e, result)
    assert len(requests) == 3, "no model request repeated over the pauses"
    assert "not today: the list is frozen" in requests[-1], "the model was not told the reviewer's message"


# -- kills while the approved call runs ---------------------------------------------------------

HOLD_DAG = "e2e_approval_hold"
#: The approved call ran on try 1 until the kill, then once more on try 2, which knew it.
RUN_AGAIN = [{"n": 1, "try": 1, "rerun": False}, {"n": 1, "try": 2, "rerun": True}]
EXEC_TIMEOUT_DAG = "e2e_approval_exec_timeout"
#: How long past ``execution_timeout`` the timeout's run keeps waiting for its answer: beyond the
#: scheduler's sweep of timed-out waits (``trigger_timeout_check_interval``, 15 s), which is what
#: would end the wait if Airflow bounded it by ``execution_timeout`` (as it did deferrals in 2.x).
PAST_TIMEOUT_S = 18.0
#: Bound on the time from an answer to the resumed execution's start.
RESUME_WITHIN_S = 45.0


def _await_held(env: E2EEnv, result: PathResult) -> dict[str, Any]:
    """Until the approved ``hold_line`` runs on try 1: its pid and its supervisor's."""
    held = env.state_dir / f"{result.dag_id}.{result.run_id}.held.json"

    def started() -> bool:
        env.stack.check_alive()
        return held.exists()

    wait_until(started, WAIT_S, f"{result.run_id}: the approved call to run")
    info: dict[str, Any] = json.loads(held.read_text())
    result.task_pid, result.supervisor_pid = info["pid"], info["ppid"]
    return info


def _hold_past_execution_timeout(env: E2EEnv, result: PathResult) -> None:
    """Keep the answer back until ``execution_timeout`` (counted from when the task was seen
    waiting, so after its execution began) and one timeout sweep have passed; the task must wait
    all along."""
    until = time.monotonic() + EXECUTION_TIMEOUT_S + PAST_TIMEOUT_S
    while time.monotonic() < until:
        env.stack.check_alive()
        state = env.rest.json("GET", _ti_path(result))["state"]
        assert state == "awaiting_input", f"{result.run_id}: {state} while waiting past execution_timeout"
        time.sleep(0.5)  # a poll of a state that must not change, not a wait for an event
    result.notes["waited_s"] = EXECUTION_TIMEOUT_S + PAST_TIMEOUT_S


def _terminal(result: PathResult) -> bool:
    return result.run_state in ("failed", "success")


def _no_kill(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """``execution_timeout`` ends this one by itself: its clock starts with the answer."""
    answered: float = result.notes["answered_wall"]
    return answered, answered


Step = Callable[[E2EEnv, PathResult], Any]
#: name -> (DAG, what happens before the answer, the kill while the approved call runs).
HELD: dict[str, tuple[str, Step | None, Step]] = {
    "mark_failed": (HOLD_DAG, None, mark_failed),
    "eviction": (HOLD_DAG, None, evict),
    "execution_timeout": (EXEC_TIMEOUT_DAG, _hold_past_execution_timeout, _no_kill),
}


def _drive_held(env: E2EEnv, name: str) -> PathResult:
    dag_id, before_answer, kill = HELD[name]
    result = _run(f"held-{name}", dag_id)
    try:
        _trigger(env, result)
        _await_awaiting_input(env, result, 1)
        if before_answer is not None:
            before_answer(env, result)
        answered = time.time()
        _answer(env, result, "Approve")
        result.notes["answered_wall"] = answered
        result.notes["held"] = _await_held(env, result)
        result.click_wall, result.answered_wall = kill(env, result)
        _await_settled(env, result, _terminal)
    except BaseException as exc:
        result.error = exc
    _collect_quietly(env, result)
    result.notes["lines"] = _lines(env, result)
    result.notes["requests"] = _requests(env, result)
    return result


@pytest.fixture(scope="module")
def held_started(e2e: E2EEnv) -> Iterator[tuple[float, dict[str, Future[PathResult]]]]:
    """The three kills of an approved call in flight, started at once, in the background (the
    UI test runs meanwhile: most of their time is waiting for Airflow)."""
    with ThreadPoolExecutor(max_workers=len(HELD), thread_name_prefix="e2e-held") as pool:
        yield time.monotonic(), {name: pool.submit(_drive_held, e2e, name) for name in HELD}


@pytest.fixture(scope="module")
def held_runs(held_started: tuple[float, dict[str, Future[PathResult]]]) -> dict[str, PathResult]:
    started, futures = held_started
    results = {name: future.result() for name, future in futures.items()}
    print(f"\n[e2e] approvals: three kills took {time.monotonic() - started:.1f}s at once")
    for name, result in results.items():
        record = (result.records(1) or [{}])[0]
        print(
            f"[e2e] approval {name:<17} requests {result.notes.get('requests')} "
            f"tool runs {len(result.notes.get('lines', []))}; "
            f"cause {record.get('cause')}/{record.get('detail')}, "
            f"unwound {unwound_ms(record)} ms, kill {_kill_after_s(result, record)} s after the "
            f"{'answer' if name == 'execution_timeout' else 'click'}; TI {result.final_ti.get('state')} "
            f"try {result.final_ti.get('try_number')}"
        )
    return results


def _kill_after_s(result: PathResult, record: dict[str, Any]) -> str:
    """Seconds from the click (the answer, for the timeout) to the task's ``kill_received``."""
    return f"{record['wall_origin'] - result.click_wall:.1f}" if record and result.click_wall else "?"


def _one_record(result: PathResult, cause: str, detail: str) -> dict[str, Any]:
    """Try 1 logged exactly one kill record, with this cause; no later try logged one."""
    records = result.records(1)
    assert len(records) == 1, f"expected one record line in try 1's log, got {len(records)}"
    record = records[0]
    assert (record["cause"], record["detail"], record["outcome"]) == (cause, detail, "cancelled"), record
    assert record["stragglers"] == []
    at = unwound_ms(record)
    assert at is not None and 0 <= at < BUDGET_MS, f"unwound at {at} ms: {record['timeline']}"
    assert all(result.records(t) == [] for t in result.logs if t > 1)
    assert not is_alive(result.task_pid)
    return record


def _retried_without_asking_again(result: PathResult, ended: str) -> None:
    """Try 2 resumed from try 1's record, which held the answer before the call started: it ran
    the approved call again, once, knowing it is a re-run, made the one model request left, and
    succeeded without asking again."""
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2)
    assert (2, "awaiting_input") not in result.states_seen, "the retry asked again"
    assert result.notes["lines"] == RUN_AGAIN
    assert result.notes["requests"] == 2
    assert f"durable: resuming from try 1 (ended {ended})" in result.log_text(2)
    assert "1 tool call(s) in flight run again" in result.log_text(2)


def test_mark_failed_while_the_approved_call_runs_stops_it_without_a_retry(
    e2e: E2EEnv, held_runs: dict[str, PathResult]
) -> None:
    result = held_runs["mark_failed"]
    with explained(e2e, result):
        _one_record(result, "user", "marked failed")
        assert (result.final_ti["state"], result.final_ti["try_number"]) == ("failed", 1)
        assert [t for t, _ in result.states_seen] == [1] * len(result.states_seen), "a user stop retried"
        assert result.notes["lines"] == [{"n": 1, "try": 1, "rerun": False}]
        assert result.notes["requests"] == 1


def test_an_eviction_while_the_approved_call_runs_retries_it_without_asking_again(
    e2e: E2EEnv, held_runs: dict[str, PathResult]
) -> None:
    result = held_runs["eviction"]
    with explained(e2e, result):
        _one_record(result, "eviction", "worker shutdown")
        _retried_without_asking_again(result, "eviction")


def test_execution_timeout_counts_each_execution_not_the_wait_for_the_answer(
    e2e: E2EEnv, held_runs: dict[str, PathResult]
) -> None:
    result = held_runs["execution_timeout"]
    with explained(e2e, result):
        # It waited EXECUTION_TIMEOUT_S + PAST_TIMEOUT_S for the answer, in awaiting_input all along.
        assert result.notes["waited_s"] > EXECUTION_TIMEOUT_S
        record = _one_record(result, "timeout", "the run's deadline passed")
        assert "AirflowTaskTimeout" not in result.log_text(1), "SIGALRM fired: the graceful deadline lost"
        # The resumed execution's own execution_timeout ended it, counted from its start (after
        # the answer), less the run's timeout_margin (2 s).
        since_answer_s = result.kill_wall() - result.notes["answered_wall"]
        since_created_s = -(result.event_ms(record, "scope_created") or 0.0) / 1000
        # Late, not early, on a loaded machine (the deadline's wake came 1.7 s late once under both
        # CI lanes); that it came before SIGALRM is the log check above.
        assert EXECUTION_TIMEOUT_S - 2.5 < since_created_s < EXECUTION_TIMEOUT_S, since_created_s
        # From the answer to the resumed execution's start: the triggerer's and the scheduler's
        # loops and a task process's start (17 s on a loaded CI machine), not execution_timeout.
        assert since_created_s < since_answer_s < since_created_s + RESUME_WITHIN_S, since_answer_s
        assert (1, "up_for_retry") in result.states_seen
        _retried_without_asking_again(result, "timeout")
