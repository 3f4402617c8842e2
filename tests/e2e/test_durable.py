"""``durable=True`` against a real Airflow 3.3 (LocalExecutor, the session's stack): a killed try's
retry resumes from the continuity record in the task state store.

Four runs of ``e2e_durable`` (six sequential tool calls, each appending a line) go at once; each
is killed while its 4th tool runs: SIGTERM to the supervisor (eviction), SIGKILL to the task
process (nothing runs at kill time), a user's Clear, and an eviction after the record was edited
through the REST API. Model requests are counted on the local model server: an uninterrupted
run makes 7, a resumed one at most 8 over both tries, a fresh restart 11.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.airflow_stack import wait_until
from tests.e2e.conftest import E2EEnv
from tests.e2e.driver import (
    E2E_TEST_TIMEOUT,
    PathResult,
    _await_settled,
    _collect_quietly,
    _ti_path,
    _trigger,
    await_messages_stored,
    clear,
    diagnostics,
    evict,
)
from tests.e2e.procs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TEST_TIMEOUT)]

DAG_ID = "e2e_durable"
STEPS = 6
UNINTERRUPTED = STEPS + 1
FRESH_RESTART = 4 + UNINTERRUPTED
#: Messages in the record while tool 4 runs: the prompt's request and each response, the ones
#: after it carrying the tool returns (four requests, four responses).
STORED_BY_TOOL_4 = 8


@dataclass
class DurableResult:
    result: PathResult
    lines: list[dict[str, Any]]
    requests: int
    tampered: str = ""

    def lines_of(self, try_number: int) -> list[int]:
        return [line["n"] for line in self.lines if line["try"] == try_number]

    def log(self, try_number: int) -> str:
        return self.result.log_text(try_number)


def sigkill_task(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """SIGKILL the task process, once tool 4's step is stored: no Python runs, no on_kill,
    nothing written at kill time."""
    await_messages_stored(env, result, STORED_BY_TOOL_4)
    killed = time.time()
    os.kill(result.task_pid, signal.SIGKILL)
    return killed, killed


def clear_once_stored(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """A user's Clear once tool 4's step is stored: the cleared try's task instance is replaced
    at once, so its unwind can no longer store what waited in the batch window."""
    await_messages_stored(env, result, STORED_BY_TOOL_4)
    return clear(env, result)


def tamper_then_evict(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """Edit a completed step of the record through the REST API, then evict the task."""
    store = f"{_ti_path(result)}/state-store"
    # Entry 1: the return of tool 1, with the response to it (alone under its key, or in a list).
    record = await_messages_stored(env, result, STORED_BY_TOOL_4)
    key, entries = next((k, v) for k, v in record.items() if any(e["i"] == 1 for e in v))
    entry = next(e for e in entries if e["i"] == 1)
    entry["messages"][0]["parts"][0]["content"] = "line 1 NOT written"
    value = entries[0] if len(entries) == 1 else entries
    env.rest.json("PUT", f"{store}/{key}", json={"value": value}, expect=(200, 204))
    return evict(env, result)


def _retried(result: PathResult) -> bool:
    return result.run_state in ("success", "failed") and result.final_ti.get("try_number") == 2


KILLS: dict[str, Callable[[E2EEnv, PathResult], tuple[float, float]]] = {
    "evicted": evict,
    "sigkilled": sigkill_task,
    "cleared": clear_once_stored,
    "tampered": tamper_then_evict,
}


def _drive(env: E2EEnv, name: str) -> DurableResult:
    result = PathResult(name, DAG_ID, f"durable-{name}-{uuid.uuid4().hex[:8]}")
    base = f"{DAG_ID}.{result.run_id}"
    try:
        _trigger(env, result)
        marker = env.state_dir / f"{base}.tool4.json"
        wait_until(
            lambda: env.stack.check_alive() or marker.exists(), 120, f"{name}: try 1 at tool 4", interval=0.1
        )
        info = json.loads(marker.read_text())
        result.task_pid, result.supervisor_pid = info["pid"], info["ppid"]
        result.click_wall, result.answered_wall = KILLS[name](env, result)
        _await_settled(env, result, _retried)
    except BaseException as exc:
        result.error = exc
    _collect_quietly(env, result)
    lines_file = env.state_dir / f"{base}.lines"
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()] if lines_file.exists() else []
    tag = f"[{DAG_ID}/{result.run_id}]"
    requests = sum(1 for r in env.model_server.requests if tag in json.dumps(r.messages))
    return DurableResult(result, lines, requests)


@pytest.fixture(scope="module")
def durable_runs(e2e: E2EEnv) -> Iterator[dict[str, DurableResult]]:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(KILLS), thread_name_prefix="e2e-durable") as pool:
        futures = {name: pool.submit(_drive, e2e, name) for name in KILLS}
        results = {name: future.result() for name, future in futures.items()}
    print(f"\n[e2e] durable: four runs took {time.monotonic() - started:.1f}s in parallel")
    for name, run in results.items():
        print(
            f"[e2e] durable {name:<9} model requests {run.requests} (uninterrupted {UNINTERRUPTED}, fresh "
            f"{FRESH_RESTART}); lines try1 {run.lines_of(1)} try2 {run.lines_of(2)}; "
            f"TI {run.result.final_ti.get('state')} try {run.result.final_ti.get('try_number')}"
        )
    yield results


@contextlib.contextmanager
def explained(e2e: E2EEnv, run: DurableResult) -> Iterator[None]:
    try:
        if run.result.error is not None:
            raise AssertionError(f"{run.result.path}: {run.result.error!r}") from run.result.error
        yield
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nlines={run.lines} requests={run.requests}\n{diagnostics(e2e, run.result)}"
        ) from exc


def _finished_in_try_2(run: DurableResult) -> None:
    assert (run.result.final_ti["state"], run.result.final_ti["try_number"]) == ("success", 2)
    assert not is_alive(run.result.task_pid)


def _resumed(run: DurableResult) -> None:
    """Try 2 went on from try 1's 4th tool: six distinct lines, tool 4 alone run twice."""
    _finished_in_try_2(run)
    assert sorted({line["n"] for line in run.lines}) == list(range(1, STEPS + 1))
    assert run.lines_of(1) == [1, 2, 3, 4]
    assert run.lines_of(2) == [4, 5, 6], "try 2 redid a completed tool call"
    assert [line["rerun"] for line in run.lines if line["try"] == 2] == [True, False, False]
    assert run.requests <= UNINTERRUPTED + 1, f"{run.requests} model requests over both tries"
    assert "durable: resuming from try 1" in run.log(2)
    assert "durable: run completed" in run.log(2)


def _fresh(run: DurableResult) -> None:
    _finished_in_try_2(run)
    assert run.lines_of(2) == list(range(1, STEPS + 1)), "try 2 must start from the first step"
    assert run.requests == FRESH_RESTART, f"{run.requests} model requests"
    assert "durable: resuming" not in run.log(2)


def test_an_evicted_try_resumes_where_it_stopped(e2e: E2EEnv, durable_runs: dict[str, DurableResult]) -> None:
    run = durable_runs["evicted"]
    with explained(e2e, run):
        _resumed(run)
        record = run.result.records(1)[0]
        assert record["cause"] == "eviction"
        assert record["attached"]["durable"]["usage_this_try"]["requests"] == 4
        assert "ended eviction" in run.log(2)


def test_a_sigkilled_try_resumes_from_what_was_written_while_it_ran(
    e2e: E2EEnv, durable_runs: dict[str, DurableResult]
) -> None:
    run = durable_runs["sigkilled"]
    with explained(e2e, run):
        _resumed(run)
        assert run.result.records(1) == [], "a SIGKILLed task writes nothing at kill time"
        assert "died without a word" in run.log(2)


def test_a_cleared_try_starts_fresh(e2e: E2EEnv, durable_runs: dict[str, DurableResult]) -> None:
    run = durable_runs["cleared"]
    with explained(e2e, run):
        _fresh(run)
        assert run.result.records(1)[0]["detail"] == "cleared"
        assert "stopped by a user (cleared" in run.log(2) and "starting fresh" in run.log(2)


def test_an_edited_record_starts_fresh_with_one_warning(
    e2e: E2EEnv, durable_runs: dict[str, DurableResult]
) -> None:
    run = durable_runs["tampered"]
    with explained(e2e, run):
        _fresh(run)
        log = run.log(2)
        assert log.count("not resuming from the stored record") == 1, log
        assert "entry 1 does not match its checksum" in log
