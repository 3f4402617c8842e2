"""Tool approval against a real Airflow 3.3 (the session's stack): the task waits in
``awaiting_input`` holding no worker slot, the answer given through the REST API the UI uses
(``PATCH .../hitlDetails``) resumes it, and the run goes on from its record.

``e2e_approval`` (``max_active_tasks=1``): the agent asks for ``send_line`` twice, each needing
approval; a second task ``other`` can only run in a slot the waiting agent does not hold.
Model requests are counted on the local model server: a run approved twice makes 3.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.e2e.airflow_stack import wait_until
from tests.e2e.conftest import E2EEnv
from tests.e2e.driver import PathResult, _await_settled, _ti_path, _trigger, clear, mark_failed
from tests.e2e.procs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DAG_ID = "e2e_approval"
WAIT_S = 120.0


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
    _await_awaiting_input(e2e, result, 1)
    # The scheduler's sweep (every trigger_timeout_check_interval, 15 s) answers the default.
    _await_settled(e2e, result, lambda r: r.run_state in ("failed", "success"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1)
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
