"""Deferred tool calls against a real Airflow 3.3 with a real ``airflow triggerer`` (the session's
stack): the tool starts an outside job and defers; the task waits DEFERRED holding no worker
slot (``max_active_tasks=1``: ``other`` runs meanwhile; no process of the agent's try is left);
the trigger's event is the tool's result; *Mark failed* and *Clear* while deferred run the
trigger's ``on_kill``, which cancels the job (timed from the REST call to the job's
``cancelled_at``); a call whose wait times out has its job stopped and the model told.

Model requests are counted on the local model server, tool runs by the job starts the tool
appends, over the whole task (all executions, all tries).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cancellable_agents.testing import jobs
from tests.e2e.airflow_stack import wait_until
from tests.e2e.conftest import E2EEnv
from tests.e2e.driver import (
    E2E_TEST_TIMEOUT,
    PathResult,
    _await_settled,
    _trigger,
    clear,
    evict,
    fetch_log,
    mark_failed,
)
from tests.e2e.procs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

WAIT_S = 120.0


def _run(name: str, dag_id: str = "e2e_deferred") -> PathResult:
    return PathResult(name, dag_id, f"deferred-{name}-{uuid.uuid4().hex[:8]}")


def _requests(env: E2EEnv, result: PathResult) -> list[str]:
    tag = f"[{result.dag_id}/{result.run_id}]"
    return [text for r in env.model_server.requests if tag in (text := json.dumps(r.messages))]


def _tool_results(request: str) -> list[Any]:
    """The tool results a model request carried (its messages as JSON)."""
    return [json.loads(m["content"]) for m in json.loads(request) if m.get("role") == "tool"]


def _starts(env: E2EEnv, result: PathResult) -> list[dict[str, Any]]:
    path = env.state_dir / f"{result.dag_id}.{result.run_id}.starts"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _state(env: E2EEnv, result: PathResult, task_id: str = "agent") -> dict[str, Any]:
    path = f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/{task_id}"
    return dict(env.rest.json("GET", path))


def _await_deferred(env: E2EEnv, result: PathResult, try_number: int = 1) -> dict[str, Any]:
    """Until try ``try_number`` is DEFERRED, the triggerer runs its trigger (the trigger polled the
    job: :func:`_polled`), and the scheduler has taken in the end of the execution that deferred
    (:func:`_deferrals_seen`)."""

    def probe() -> dict[str, Any] | None:
        env.stack.check_alive()
        ti = _state(env, result)
        started = [s for s in _starts(env, result) if s["try"] == try_number]
        if ti["state"] != "deferred" or ti["try_number"] != try_number or not started:
            return None
        if not _polled(env, started[0]["job"]):
            return None
        return ti if _deferrals_seen(env, ti["id"], try_number) else None

    return wait_until(
        probe,
        WAIT_S,
        f"{result.run_id}: try {try_number} deferred",
        interval=0.25,
        on_timeout=lambda: _where_it_waits(env, result),
    )


def _where_it_waits(env: E2EEnv, result: PathResult) -> str:
    """:func:`_what_it_saw`, or why it could not be gathered: the timeout stays the error."""
    try:
        return _what_it_saw(env, result)
    except Exception as exc:
        return f"(what the wait saw could not be gathered: {exc!r})"


def _what_it_saw(env: E2EEnv, result: PathResult) -> str:
    """What a timed-out wait saw: the tries, each condition of :func:`_await_deferred`, the
    DAG's other task instances (``max_active_tasks=1``), the task's log files and the components'
    log tails: enough to tell a try that never ran from one that failed before it deferred."""
    tries = env.rest.json(
        "GET", f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/agent/tries"
    )["task_instances"]
    starts = _starts(env, result)
    polled = {s["job"]: jobs.last_polled(str(env.state_dir / "jobs"), s["job"]) for s in starts}
    listed = env.rest.json(
        "GET", f"/api/v2/dags/{result.dag_id}/dagRuns/~/taskInstances", params={"limit": 100}
    )["task_instances"]
    busy = [
        (t["dag_run_id"], t["task_id"], t["try_number"], t["state"])
        for t in listed
        if t["state"] not in ("success", "failed", "skipped", "upstream_failed")
    ]
    ti = _state(env, result)
    parts = [
        f"tries: {[(t['try_number'], t['state'], t['start_date'], t['end_date']) for t in tries]}",
        f"now: try {ti['try_number']} {ti['state']}, deferrals seen "
        f"{_deferrals_seen(env, ti['id'], ti['try_number'])}",
        f"starts: {starts}; last polled: {polled}",
        f"{result.dag_id}'s unfinished task instances: {busy}",
    ]
    for path in env.stack.task_log_files(result.dag_id, result.run_id, "agent"):
        parts.append(f"----- {path.name} -----\n{path.read_text(errors='replace')[-4000:]}")
    parts.append(env.stack.logs(lines=40, names=("scheduler", "triggerer")))
    return "\n".join(parts)


def _deferrals_seen(env: E2EEnv, ti_id: str, try_number: int) -> int:
    """How often the scheduler has taken in the executor's end of a deferring execution of
    ``ti_id`` in try ``try_number``.

    A trigger that fires before that is lost on Airflow 3.3.2 (as an approval answered too soon):
    the executor's late "success" for the deferring workload meets the resumed execution running,
    and the scheduler fails the try ("finished with state success, but the task instance's state
    attribute is running"). Measured here: the deferring workload is reported ~5 s after the
    task deferred. So the test finishes a job only after this.
    """
    log = (env.stack.home / "components" / "scheduler.log").read_text(errors="replace")
    return sum(
        1
        for line in log.splitlines()
        if "TaskInstance Finished" in line
        and ti_id in line
        and "state=deferred" in line
        and f"try_number={try_number}," in line
    )


def _polled(env: E2EEnv, job: str) -> bool:
    """Whether the triggerer's trigger has polled ``job``: it runs, so a user's stop reaches its
    ``on_kill``.

    Airflow 3.3.2 runs ``on_kill`` only for a trigger its triggerer has started. The triggerer
    sees a Mark failed or Clear as the trigger's row gone (its own ``Trigger.clean_unused`` deletes
    a trigger no DEFERRED task instance holds) and cancels "by user action" only what is in its
    running set; a stop that lands between the loop's ``load_triggers`` and its ``clean_unused``,
    before the trigger was taken in, deletes it unstarted: nothing runs, the job goes on. The
    scheduler's sight of the deferral (:func:`_deferrals_seen`) does not order this: in a passing
    run the Clear went 0.6 s after the deferral, 0.5 s before the trigger started; a loaded
    machine stretches the triggerer's loop (ci7: both stops left their jobs running).
    """
    return jobs.last_polled(str(env.state_dir / "jobs"), job) is not None


def _job(env: E2EEnv, result: PathResult, try_number: int = 1) -> str:
    return next(s["job"] for s in _starts(env, result) if s["try"] == try_number)


def _cancelled_ms(env: E2EEnv, job: str, since: float) -> float:
    """Milliseconds from ``since`` (the kill's REST call) until the job was cancelled."""
    path = env.state_dir / "jobs" / f"{job}.json"

    def cancelled() -> dict[str, Any] | None:
        state = json.loads(path.read_text())
        return state if state["state"] == "cancelled" else None

    state = wait_until(cancelled, WAIT_S, f"job {job} cancelled", interval=0.05)
    return (float(state["cancelled_at"]) - since) * 1000


def test_the_task_waits_without_a_slot_and_the_job_result_is_the_tool_result(e2e: E2EEnv) -> None:
    result = _run("done")
    _trigger(e2e, result)
    ti = _await_deferred(e2e, result)
    # max_active_tasks=1: `other` runs only because the deferred agent holds no slot.
    wait_until(
        lambda: _state(e2e, result, "other")["state"] == "success", WAIT_S, "other to run while deferred"
    )
    pid = _state(e2e, result).get("pid")
    assert not (isinstance(pid, int) and is_alive(pid)), "no process of the deferred try is left"
    assert len(_requests(e2e, result)) == 1 and ti["try_number"] == 1

    jobs.finish(str(e2e.state_dir / "jobs"), _job(e2e, result), {"rows": 42})
    _await_settled(e2e, result, lambda r: r.run_state in ("success", "failed"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1), result.final_ti
    requests = _requests(e2e, result)
    assert len(requests) == 2 and _tool_results(requests[-1]) == [{"rows": 42}], (
        "the job's result reached the model"
    )
    assert len(_starts(e2e, result)) == 1, "the tool ran once"
    print(
        f"\n[deferred] done: requests {len(requests)}, tool runs {len(_starts(e2e, result))}, success try 1"
    )


def test_mark_failed_while_deferred_cancels_the_job_and_fails_without_a_retry(e2e: E2EEnv) -> None:
    result = _run("mark-failed")
    _trigger(e2e, result)
    _await_deferred(e2e, result)
    clicked, _ = mark_failed(e2e, result)
    stopped_ms = _cancelled_ms(e2e, _job(e2e, result), clicked)
    _await_settled(e2e, result, lambda r: r.run_state in ("success", "failed"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("failed", 1), result.final_ti
    assert len(_requests(e2e, result)) == 1 and len(_starts(e2e, result)) == 1
    print(f"\n[deferred] mark failed: job cancelled {stopped_ms:.0f} ms after the PATCH")


def test_clear_while_deferred_cancels_the_job_and_the_next_try_starts_fresh(e2e: E2EEnv) -> None:
    result = _run("clear")
    _trigger(e2e, result)
    _await_deferred(e2e, result)
    clicked, _ = clear(e2e, result)
    stopped_ms = _cancelled_ms(e2e, _job(e2e, result), clicked)
    _await_deferred(e2e, result, try_number=2)  # a user's stop: fresh start, a new job
    assert len(_requests(e2e, result)) == 2 and len(_starts(e2e, result)) == 2
    jobs.finish(str(e2e.state_dir / "jobs"), _job(e2e, result, 2), "second")
    _await_settled(e2e, result, lambda r: r.run_state in ("success", "failed"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2), result.final_ti
    assert len(_requests(e2e, result)) == 3
    print(f"\n[deferred] clear: job cancelled {stopped_ms:.0f} ms after the POST; try 2 ran fresh")


def test_a_triggerer_restart_while_deferred_leaves_the_job_running_and_its_result_flows_back(
    e2e: E2EEnv,
) -> None:
    """SIGTERM to the triggerer (a deploy, a node drain) ends its triggers with ``cleanup``, not
    ``on_kill``: the job goes on; the next triggerer takes the trigger in (the stopped one's job
    row has its end date, so at its first loop) and the job's result reaches the model."""
    result = _run("triggerer-restart")
    _trigger(e2e, result)
    _await_deferred(e2e, result)
    root, job = str(e2e.state_dir / "jobs"), _job(e2e, result)
    exited = e2e.stack.restart("triggerer")
    assert jobs.state_of(root, job) == "running", "the triggerer's stop did not stop the job"
    e2e.stack.wait_healthy()
    wait_until(
        lambda: (jobs.last_polled(root, job) or 0.0) > exited, WAIT_S, "the new triggerer to poll the job"
    )
    resumed_after = time.time() - exited
    assert jobs.state_of(root, job) == "running"
    jobs.finish(root, job, {"rows": 7})
    _await_settled(e2e, result, lambda r: r.run_state in ("success", "failed"))
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1), result.final_ti
    requests = _requests(e2e, result)
    assert len(requests) == 2 and _tool_results(requests[-1]) == [{"rows": 7}], "the result reached the model"
    assert len(_starts(e2e, result)) == 1, "the tool ran once"
    print(
        f"\n[deferred] triggerer restart: job left running; the new triggerer polled it "
        f"{resumed_after:.1f} s after the old one exited; requests 2, tool runs 1, success try 1"
    )


@pytest.fixture(scope="module")
def concurrent_runs(e2e: E2EEnv) -> dict[str, PathResult]:
    """The paths that mostly wait, driven at once: both timeouts (12 s deferred each) and an
    eviction in the resumed part."""
    runs = {
        "tell": (_run("timeout", "e2e_deferred_timeout"), _drive_to_the_end),
        "fail": (_run("timeout-fail", "e2e_deferred_timeout_fail"), _drive_to_the_end),
        "evict": (_run("evict", "e2e_deferred_evict"), _drive_eviction),
    }
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="e2e-deferred") as pool:
        futures = {
            name: pool.submit(_kept_error, drive, e2e, result) for name, (result, drive) in runs.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _kept_error(
    drive: Callable[[E2EEnv, PathResult], PathResult], env: E2EEnv, result: PathResult
) -> PathResult:
    """Drive one path; an error is kept for its own test to raise (:func:`_settled`), so one path
    failing does not fail the others'."""
    try:
        return drive(env, result)
    except Exception as exc:
        result.error = exc
        return result


def _settled(runs: dict[str, PathResult], name: str) -> PathResult:
    result = runs[name]
    if result.error is not None:
        raise result.error
    return result


def _drive_to_the_end(env: E2EEnv, result: PathResult) -> PathResult:
    _trigger(env, result)
    _await_settled(env, result, lambda r: r.run_state in ("success", "failed"))
    return result


def _drive_eviction(env: E2EEnv, result: PathResult) -> PathResult:
    """Finish the job once the trigger waits on it; evict the resumed execution while the model's
    answer after step 2 streams (step 1's deferral and step 2 complete and in the record)."""
    _trigger(env, result)
    _await_deferred(env, result)
    jobs.finish(str(env.state_dir / "jobs"), _job(env, result), {"rows": 3})
    resumed = env.state_dir / f"{result.dag_id}.{result.run_id}.resumed.json"

    def asking_after_step_2() -> bool:
        """The model's answer to step 2 is in flight (not streamed: the agent's requests are not)."""
        env.stack.check_alive()
        at_step_3 = [r for r in _records(env, result) if _tool_messages(r.messages) == 2]
        return resumed.exists() and any(r.outcome is None for r in at_step_3)

    wait_until(asking_after_step_2, WAIT_S, f"{result.run_id}: the resumed part mid-request", interval=0.1)
    info = json.loads(resumed.read_text())
    result.task_pid, result.supervisor_pid = info["pid"], info["ppid"]
    result.click_wall, result.answered_wall = evict(env, result)
    _await_settled(env, result, lambda r: r.run_state in ("success", "failed"))
    result.logs[1] = fetch_log(env, result, 1)
    return result


def _records(env: E2EEnv, result: PathResult) -> list[Any]:
    tag = f"[{result.dag_id}/{result.run_id}]"
    return [r for r in env.model_server.requests if tag in json.dumps(r.messages)]


def _tool_messages(messages: list[dict[str, Any]]) -> int:
    return sum(m.get("role") == "tool" for m in messages)


def test_a_wait_past_its_timeout_stops_the_job_and_tells_the_model(
    e2e: E2EEnv, concurrent_runs: dict[str, PathResult]
) -> None:
    result = _settled(concurrent_runs, "tell")
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 1), result.final_ti
    (start,) = _starts(e2e, result)
    assert jobs.state_of(str(e2e.state_dir / "jobs"), start["job"]) == "cancelled"
    requests = _requests(e2e, result)
    assert len(requests) == 2 and "did not finish within its timeout of 12 s" in requests[-1]


def test_a_wait_past_a_failing_timeout_stops_the_job_and_ends_the_task_as_timeout(
    e2e: E2EEnv, concurrent_runs: dict[str, PathResult]
) -> None:
    result = _settled(concurrent_runs, "fail")
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("failed", 1), result.final_ti
    (start,) = _starts(e2e, result)
    job = jobs.state_of(str(e2e.state_dir / "jobs"), start["job"])
    assert job == "cancelled", "the trigger stopped the job at the timeout"
    assert len(_requests(e2e, result)) == 1, "the model was not asked again"
    result.logs[1] = fetch_log(e2e, result, 1)
    (record,) = result.records(1)
    assert (record["cause"], record["outcome"]) == ("timeout", "cancelled"), record
    assert "deferred call run_job_or_fail" in record["detail"] and "waited 12 s" in record["detail"], record
    stopped = json.loads((e2e.state_dir / "jobs" / f"{start['job']}.json").read_text())["cancelled_at"]
    print(
        f"\n[deferred] timeout fail: job stopped {stopped - start['at']:.1f} s after the deferral; "
        f"requests 1, tool runs 1, failed try 1, cause {record['cause']}: {record['detail']}"
    )


def test_an_eviction_in_the_resumed_part_resumes_from_the_record_without_repeating_a_step(
    e2e: E2EEnv, concurrent_runs: dict[str, PathResult]
) -> None:
    """A kill after the trigger fired is a kill of an ordinary execution: eviction, try 2 resumes
    from the record. Over the whole task the job started once, each step's tool ran once, and
    the model was asked once per step but the one in flight at the kill (asked again by try 2)."""
    result = _settled(concurrent_runs, "evict")
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2), result.final_ti
    (record,) = result.records(1)
    assert (record["cause"], record["outcome"]) == ("eviction", "cancelled"), record
    unwound_ms = PathResult.event_ms(record, "run_unwound")
    assert unwound_ms is not None and 0 <= unwound_ms < 5000, record["timeline"]
    steps_path = e2e.state_dir / f"{result.dag_id}.{result.run_id}.steps"
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    assert sorted(s["n"] for s in steps) == [1, 2, 3], f"each step's tool ran once: {steps}"
    assert [s["n"] for s in steps if s["try"] == 2] == [3], "try 2 ran only what the record did not hold"
    assert len(_starts(e2e, result)) == 1, "the job started once"
    per_step = [_tool_messages(r.messages) for r in _records(e2e, result)]
    assert sorted(per_step) == [0, 1, 2, 2, 3], f"requests by tool results they carried: {per_step}"
    print(
        f"\n[deferred] evicted in the resumed part: unwound {unwound_ms} ms; requests {len(per_step)} "
        f"(the one in flight asked again), tool runs {len(steps)}, job starts 1, success try 2"
    )
