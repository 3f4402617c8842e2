"""The CeleryExecutor: Airflow's kills and every way a Celery worker goes away, end to end.

One stack for the module (``celery_e2e``): a private ``redis-server``, api-server, scheduler,
dag-processor and Celery workers. ``w1`` and ``w2`` serve the ``default`` queue and run the
user's kill paths (mark failed, clear, execution_timeout: the LocalExecutor tests' DAGs and
drivers). Each worker shutdown mode has a DAG on a queue of its own, served at first only by
its *victim* worker (started with that mode's settings); once try 1 is mid-run there, the
``standby`` worker is told to consume that queue too (``celery control add_consumer``) and the
victim is killed, so the retry runs on the standby. All paths run at once.

Per mode the tests assert what reached the task, the cause recorded (in the task log, or in the
fallback record file when the supervisor died with the worker), that nothing the task started
is left running, the final TI state, and the retry and its worker. The worker-shutdown DAGs are
``durable=True`` agents of four tool calls, killed mid-stream in the model request after the
second: per mode the retry resumes (model requests counted on the local model server, every
completed tool call run once, the continuity record as try 2 saw it). The module is torn down
before the LocalExecutor stack (``e2e``) starts, so the two never compete for the 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

import pytest

from cancellable_agents.airflow._supervisor import (
    SUPERVISOR_LOST,
    TaskIdentity,
    fallback_record_path,
    records_root,
)
from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX, parse_record
from tests.e2e.airflow_stack import Component
from tests.e2e.celery_stack import REDIS_SERVER, CeleryStack, kill_tree, worker_of
from tests.e2e.conftest import DAGS_FOLDER, E2E_DAG_IDS, E2EEnv, _await_dags, e2e_world, stopped_after
from tests.e2e.dags.kill_paths import (
    CELERY_STALL_AFTER,
    CELERY_STEPS,
    CELERY_WORKER_KILLS,
    celery_queue,
)
from tests.e2e.driver import (
    E2E_TEST_TIMEOUT,
    PATHS,
    TASK_ID,
    KillPath,
    PathResult,
    _request,
    _retried,
    _ti_path,
    await_messages_stored,
    drive,
)
from tests.e2e.postgres import PostgresCluster
from tests.e2e.postgres import missing_reason as postgres_missing
from tests.e2e.procs import ancestors, is_alive
from tests.e2e.test_kill_paths import (
    BUDGET_MS,
    HEARTBEAT_S,
    _callbacks,
    _stopped_everything,
    _the_record,
    explained,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(E2E_TEST_TIMEOUT),
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (make system-deps)"),
    pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing())),
]

USER_PATHS = ("mark_failed", "clear", "timeout")
STANDBY = "standby"
#: How long a warm shutdown is watched before the test escalates to SIGQUIT.
WARM_HOLD_S = 3.0
#: ``worker_soft_shutdown_timeout`` of the ``soft`` victim.
SOFT_SHUTDOWN_S = 3.0


#: Model requests of an uninterrupted durable worker-shutdown run (one per tool call, the answer).
UNINTERRUPTED = CELERY_STEPS + 1
#: Messages try 1 recorded before it was killed: the prompt, then a response (a tool call) and a
#: request (its return) per completed call.
RECORDED_BY_TRY_1 = 1 + 2 * CELERY_STALL_AFTER


def victim(mode: str) -> str:
    return f"v_{mode}"


# -- how each mode kills its worker -------------------------------------------------------------


def _signal(sig: int, env: E2EEnv, result: PathResult, worker: Component) -> tuple[float, float]:
    sent = time.time()
    os.kill(worker.proc.pid, sig)
    return sent, sent


def _warm_then_cold(env: E2EEnv, result: PathResult, worker: Component) -> tuple[float, float]:
    """SIGTERM (warm shutdown); watch for WARM_HOLD_S that nothing reaches the task; then SIGQUIT."""
    os.kill(worker.proc.pid, signal.SIGTERM)
    held_until = time.monotonic() + WARM_HOLD_S
    states: set[str] = set()
    alive = True
    while time.monotonic() < held_until:
        alive = alive and is_alive(result.task_pid)
        states.add(env.rest.json("GET", _ti_path(result))["state"])
        time.sleep(0.2)
    request = _request(env, result, 1)
    result.notes["warm"] = {
        "task_alive": alive and is_alive(result.task_pid),
        "worker_alive": worker.proc.poll() is None,
        "ti_states": sorted(states),
        "request_outcome": request.outcome if request else "missing",
        "records_before_sigquit": _log_records_now(env, result),
    }
    return _signal(signal.SIGQUIT, env, result, worker)


def _sigkill_tree(env: E2EEnv, result: PathResult, worker: Component) -> tuple[float, float]:
    sent = time.time()
    result.notes["node_loss_killed"] = kill_tree(worker.proc.pid)
    return sent, sent


@dataclass(frozen=True)
class WorkerMode:
    """One way a Celery worker goes away, and what its victim worker is started with."""

    mode: str
    kill: Callable[[E2EEnv, PathResult, Component], tuple[float, float]]
    env: dict[str, str] = field(default_factory=dict)
    #: The supervisor (the prefork pool child) survives long enough to report for the task.
    supervisor_survives: bool = True
    #: Code ran in the task process after the kill (node loss: none).
    task_notices: bool = True


MODES = {
    m.mode: m
    for m in (
        WorkerMode("warm", _warm_then_cold),
        WorkerMode("cold", partial(_signal, signal.SIGQUIT)),
        WorkerMode(
            "soft",
            partial(_signal, signal.SIGQUIT),
            {
                "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": json.dumps(
                    {"worker_soft_shutdown_timeout": SOFT_SHUTDOWN_S}
                )
            },
        ),
        WorkerMode("remap", partial(_signal, signal.SIGTERM), {"REMAP_SIGTERM": "SIGQUIT"}, False),
        WorkerMode("sigkill_main", partial(_signal, signal.SIGKILL), supervisor_survives=False),
        WorkerMode("node_loss", _sigkill_tree, supervisor_survives=False, task_notices=False),
    )
}
assert tuple(MODES) == CELERY_WORKER_KILLS


def _kill_worker(mode: WorkerMode, env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """Check try 1 runs on the victim, hand its queue to the standby, then kill the victim."""
    stack = env.stack
    assert isinstance(stack, CeleryStack)
    worker = stack.worker(victim(mode.mode))
    chain = ancestors(result.supervisor_pid)
    assert chain and chain[0] == worker.proc.pid, (
        f"try 1's supervisor {result.supervisor_pid} is not a pool child of {victim(mode.mode)} "
        f"({worker.proc.pid}): ancestors {chain}"
    )
    stack.remember_processes()  # so teardown finds an orphan even after it was reparented
    # What try 1 recorded is stored (it may wait out the batch window): what try 2 resumes from.
    await_messages_stored(env, result, RECORDED_BY_TRY_1)
    stack.add_consumer(STANDBY, celery_queue(mode.mode))
    worker.expendable = True
    return mode.kill(env, result, worker)


def _log_records_now(env: E2EEnv, result: PathResult) -> int:
    """How many record lines try 1's log file holds right now."""
    files = env.stack.task_log_files(result.dag_id, result.run_id, TASK_ID)
    return sum(f.read_text(errors="replace").count(RECORD_PREFIX) for f in files)


def celery_paths() -> dict[str, KillPath]:
    paths = {name: PATHS[name] for name in USER_PATHS}
    for mode in MODES.values():
        kill = partial(_kill_worker, mode)
        paths[f"celery_{mode.mode}"] = KillPath(
            f"celery_{mode.mode}", f"e2e_celery_{mode.mode}", kill, _retried
        )
    return paths


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def celery_e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EEnv]:
    """PostgreSQL, Redis, Airflow with the CeleryExecutor, w1 + w2, one victim per mode and the
    standby. Nine workers and the components write at once: the metadata database is PostgreSQL,
    as in production (SQLite's single writer stalled the api-server and ended components)."""
    with e2e_world(tmp_path_factory, "airflow_home_celery") as world, PostgresCluster() as postgres:
        stack = CeleryStack(world.home, DAGS_FOLDER, world.env, database_url=postgres.sqlalchemy_url)
        started = time.monotonic()
        stack.migrate()
        with stopped_after(stack, world.marker):
            stack.start()
            workers: dict[str, tuple[list[str], dict[str, str]]] = {
                "w1": (["default"], {}),
                "w2": (["default"], {}),
                STANDBY: (["e2e_standby_idle"], {}),  # takes over each mode's queue before its kill
            }
            workers |= {victim(m.mode): ([celery_queue(m.mode)], m.env) for m in MODES.values()}
            # Workers only after Airflow is up and the DAGs are parsed: nine worker imports at
            # once take both cores from the components while they start.
            stack.wait_healthy()
            rest = stack.client()
            _await_dags(stack, rest, dag_ids=(*E2E_DAG_IDS, *(f"e2e_celery_{m}" for m in MODES)))
            for name, (queues, worker_env) in workers.items():
                # The standby runs all six retries: enough slots that none waits for another.
                stack.start_worker(name, queues, worker_env, concurrency=6 if name == STANDBY else 2)
            stack.wait_workers(list(workers))
            ready = time.monotonic() - started
            print(
                f"\n[celery] AIRFLOW_HOME={world.home}; redis, Airflow, {len(workers)} workers: {ready:.1f}s"
            )
            yield E2EEnv(stack, rest, world.model_server, world.state_dir, world.marker, ready)
            rest.close()


@pytest.fixture(scope="module")
def outcomes(celery_e2e: E2EEnv) -> Iterator[dict[str, PathResult]]:
    """Drive the three user paths and the six worker shutdowns at once."""
    started = time.monotonic()
    paths = celery_paths()
    with ThreadPoolExecutor(max_workers=len(paths), thread_name_prefix="celery-path") as pool:
        futures = {name: pool.submit(drive, celery_e2e, path) for name, path in paths.items()}
        results = {name: future.result() for name, future in futures.items()}
    took = time.monotonic() - started
    yield results
    print(f"\n[celery] stack ready in {celery_e2e.ready_s:.1f}s; {len(paths)} paths took {took:.1f}s at once")
    for result in results.values():
        print(_report_line(celery_e2e, result))


# -- reading what happened ---------------------------------------------------------------------


def _fallback_record(env: E2EEnv, result: PathResult, try_number: int = 1) -> dict[str, Any] | None:
    """The record a task that lost its supervisor wrote to ``$AIRFLOW_HOME/cancellable_agents``."""
    task = TaskIdentity(result.dag_id, result.run_id, TASK_ID, -1, try_number)
    path = fallback_record_path(task, records_root(str(env.stack.home)))
    if not path.exists():
        return None
    return parse_record(path.read_text())


def _retry_worker(env: E2EEnv, result: PathResult) -> str | None:
    """The worker whose pool child supervised try 2 (from try 2's pid file)."""
    info = json.loads((env.state_dir / f"{result.dag_id}.{result.run_id}.try2.json").read_text())
    assert isinstance(env.stack, CeleryStack)
    return worker_of(env.stack, info["ppid"], ancestors(info["ppid"]))


def _try(result: PathResult, number: int) -> dict[str, Any]:
    return next(t for t in result.tries if t["try_number"] == number)


def _wall(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def _assert_retried_elsewhere(env: E2EEnv, result: PathResult, killed_worker: str) -> str:
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2), result.states_seen
    retry_worker = _retry_worker(env, result)
    assert retry_worker not in (None, killed_worker), f"try 2 ran on {retry_worker}"
    assert result.survivors == {}, f"processes started by the task survived: {result.survivors}"
    assert not is_alive(result.task_pid)
    return retry_worker or ""


# -- the user's kills on Celery ----------------------------------------------------------------


def test_mark_failed_on_celery(celery_e2e: E2EEnv, outcomes: dict[str, PathResult]) -> None:
    result = outcomes["mark_failed"]
    with explained(celery_e2e, result):
        record = _the_record(result, "user", "marked failed")
        _stopped_everything(result, record)
        assert (result.final_ti["state"], [t["try_number"] for t in result.tries]) == ("failed", [1])
        assert _callbacks(result) == [("on_failure_callback", 1)]
        _exited_promptly(celery_e2e, result, record)


def test_clear_on_celery(celery_e2e: E2EEnv, outcomes: dict[str, PathResult]) -> None:
    result = outcomes["clear"]
    with explained(celery_e2e, result):
        record = _the_record(result, "user", "cleared")
        _stopped_everything(result, record)
        assert result.final_ti["try_number"] == 2 and result.final_ti["state"] == "success"
        assert result.log_callbacks(1) == ["on_retry_callback"]
        _exited_promptly(celery_e2e, result, record)


def test_execution_timeout_on_celery(celery_e2e: E2EEnv, outcomes: dict[str, PathResult]) -> None:
    result = outcomes["timeout"]
    with explained(celery_e2e, result):
        record = _the_record(result, "timeout", "the run's deadline passed")
        _stopped_everything(result, record, earliest_ms=-1000.0)
        assert "AirflowTaskTimeout" not in result.log_text(1)
        assert (1, "up_for_retry") in result.states_seen
        assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2)
        _exited_promptly(celery_e2e, result, record)


#: The task process's own exit, from the Task SDK's last log line to the process gone. It takes
#: milliseconds; the failure it guards against, the interpreter's final garbage collection over
#: what Airflow and pydantic-ai loaded, took 1.5-5 s (``kill_record.task_log._exit_promptly``).
EXIT_MS = 1000.0


def _exited_promptly(env: E2EEnv, result: PathResult, record: dict[str, Any]) -> None:
    """The task process is gone as soon as the Task SDK is done with it (the unwind and Airflow's
    failure handling before that are bounded elsewhere: the grace, the supervisor), and its
    supervisor saw it at once (not at its next heartbeat or kill deadline, 5 s later:
    ``notice_exit_at_once``)."""
    assert result.task_exit_wall is not None
    done = _task_sdk_done_wall(result)
    assert done is not None, "try 1's log has no end of the Task SDK's Post Execute group"
    exit_ms = (result.task_exit_wall - done) * 1000
    assert exit_ms < EXIT_MS, f"the task process exited {exit_ms:.0f} ms after its last log line"
    finished = _supervisor_finished_wall(env, result)
    assert finished is not None, "the supervisor never logged 'Workload finished' for try 1"
    seen_ms = (finished - result.task_exit_wall) * 1000
    assert seen_ms < 2000, f"the supervisor finished {seen_ms:.0f} ms after the task process exited"


def _task_sdk_done_wall(result: PathResult) -> float | None:
    """When the Task SDK in try 1's process logged its last line: the end of the Post Execute
    group, after the failure handling and the callbacks (the supervisor's own lines come later)."""
    ends = [e.get("timestamp") for e in result.logs.get(1, []) if e.get("event") == "::endgroup::"]
    return _wall(ends[-1]) if ends else None


def _supervisor_finished_wall(env: E2EEnv, result: PathResult) -> float | None:
    """When try 1's supervisor logged ``Workload finished`` (in its worker's log)."""
    ti_id = next((e["ti_id"] for e in result.logs.get(1, []) if e.get("ti_id")), None)
    if ti_id is None:
        return None
    for path in (env.stack.home / "components").glob("worker-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "Workload finished" in line and f"workload_id={ti_id}" in line:
                return _wall(line.split()[0])
    return None


# -- worker shutdowns --------------------------------------------------------------------------


def test_warm_shutdown_reaches_nothing_then_sigquit_evicts(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult]
) -> None:
    """A warm shutdown (SIGTERM to the worker) waits for the task without limit and tells it
    nothing: the TI stays running and the answer keeps streaming. Only the SIGQUIT ends it."""
    result = outcomes["celery_warm"]
    with explained(celery_e2e, result):
        warm = result.notes["warm"]
        assert warm["task_alive"] and warm["worker_alive"], warm
        assert warm["ti_states"] == ["running"], warm
        assert warm["request_outcome"] is None, f"the stream ended during the warm shutdown: {warm}"
        assert warm["records_before_sigquit"] == 0, warm
        _evicted_by_forwarded_sigterm(celery_e2e, result, "warm", within_s=(0.0, 1.0))


def test_cold_shutdown_evicts_and_retries_elsewhere(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult]
) -> None:
    _evicted_by_forwarded_sigterm(celery_e2e, outcomes["celery_cold"], "cold", within_s=(0.0, 1.0))


def test_soft_shutdown_delays_the_eviction_by_its_timeout(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult]
) -> None:
    _evicted_by_forwarded_sigterm(
        celery_e2e, outcomes["celery_soft"], "soft", within_s=(SOFT_SHUTDOWN_S - 0.2, SOFT_SHUTDOWN_S + 1.5)
    )


def _evicted_by_forwarded_sigterm(
    env: E2EEnv, result: PathResult, mode: str, within_s: tuple[float, float]
) -> None:
    with explained(env, result):
        record = _the_record(result, "eviction", "worker shutdown")
        _stopped_everything(result, record)
        assert result.click_wall is not None
        reached_s = record["wall_origin"] - result.click_wall
        assert within_s[0] <= reached_s < within_s[1], (
            f"SIGTERM reached the task {reached_s:.2f}s after the signal"
        )
        assert (1, "up_for_retry") in result.states_seen
        assert _callbacks(result) == [("on_retry_callback", 1)]
        _assert_retried_elsewhere(env, result, victim(mode))
        _exited_promptly(env, result, record)


@pytest.mark.parametrize("mode", ["remap", "sigkill_main"])
def test_supervisor_killed_with_the_worker_leaves_no_orphan(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult], mode: str
) -> None:
    """``REMAP_SIGTERM=SIGQUIT`` + SIGTERM, or SIGKILL of the worker's main process, kill the pool
    child (the supervisor) and nothing reaches the task: it must notice by itself, unwind, write
    its record to the fallback file and exit before the heartbeat timeout starts the retry."""
    result = outcomes[f"celery_{mode}"]
    with explained(celery_e2e, result):
        assert result.records(1) == [], (
            "the log channel died with the supervisor; a record there is a surprise"
        )
        record = _fallback_record(celery_e2e, result)
        assert record is not None, "no fallback record: the task did not notice its supervisor died"
        assert (record["cause"], record["detail"], record["outcome"]) == (
            "eviction",
            SUPERVISOR_LOST,
            "cancelled",
        )
        assert record["stragglers"] == []
        assert result.click_wall is not None and result.task_exit_wall is not None
        noticed_ms = (record["wall_origin"] - result.click_wall) * 1000
        assert 0 <= noticed_ms < 1000, f"noticed the loss {noticed_ms:.0f} ms after the kill"
        exited_ms = (result.task_exit_wall - record["wall_origin"]) * 1000
        assert exited_ms < BUDGET_MS, f"exited {exited_ms:.0f} ms after noticing"
        request = result.request
        assert request is not None and request.outcome == "disconnected"
        killed = {k.get("pid") for k in record["killed"]}
        assert killed and killed <= set(result.tree_before), (killed, result.tree_before)
        # Never two copies: try 2 started after try 1's process was gone.
        started_2 = _wall(_try(result, 2)["start_date"])
        assert started_2 is not None and started_2 > result.task_exit_wall
        _assert_retried_elsewhere(celery_e2e, result, victim(mode))


def test_node_loss_is_retried_after_the_heartbeat_timeout(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult]
) -> None:
    """SIGKILL of the whole worker tree (the machine is gone): no code runs, so there is no
    record; everything died with it and the scheduler's heartbeat timeout starts the retry."""
    result = outcomes["celery_node_loss"]
    with explained(celery_e2e, result):
        assert result.records(1) == [] and _fallback_record(celery_e2e, result) is None
        assert result.task_pid in result.notes["node_loss_killed"]
        assert result.click_wall is not None
        started_2 = _wall(_try(result, 2)["start_date"])
        assert started_2 is not None and started_2 - result.click_wall >= HEARTBEAT_S
        _assert_retried_elsewhere(celery_e2e, result, victim("node_loss"))


@dataclass
class Durable:
    """What a durable run left behind: the tools' lines, the model requests, the record try 2 saw."""

    lines: list[dict[str, Any]]
    requests: list[Any]
    journal: dict[str, Any]

    def lines_of(self, try_number: int) -> list[int]:
        return [line["n"] for line in self.lines if line["try"] == try_number]

    def entries_of(self, try_number: int, kind: str | None = None) -> list[dict[str, Any]]:
        entries = self.journal.get("entries", [])
        return [e for e in entries if e["try"] == try_number and kind in (None, e["kind"])]

    def messages_of(self, try_number: int) -> int:
        """How many messages the record try 2 followed holds from ``try_number``."""
        return sum(e["messages"] for e in self.entries_of(try_number))

    def repeated_tool_calls(self) -> int:
        return len(self.lines) - len({line["n"] for line in self.lines})


def _durable(env: E2EEnv, result: PathResult) -> Durable:
    base = f"{result.dag_id}.{result.run_id}"
    lines_file, journal_file = env.state_dir / f"{base}.lines", env.state_dir / f"{base}.journal.json"
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()] if lines_file.exists() else []
    journal = json.loads(journal_file.read_text()) if journal_file.exists() else {}
    tag = f"[{result.dag_id}/{result.run_id}]"  # the prompt's; in every request of the run
    requests = [r for r in env.model_server.requests if tag in json.dumps(r.messages)]
    return Durable(lines, requests, journal)


@pytest.mark.parametrize("mode", CELERY_WORKER_KILLS)
def test_durable_retry_resumes_after_worker_loss(
    celery_e2e: E2EEnv, outcomes: dict[str, PathResult], mode: str
) -> None:
    """After every worker shutdown try 2 resumes from the continuity record: the two completed
    tool calls are not redone, the request in flight (at-least-once) is the only one repeated,
    and the record try 2 found holds what try 1 wrote while it ran, all of it before try 2 took
    it over: after node loss no code ran at kill time, so the record written while running is
    what resumes; after ``remap``/``sigkill_main`` the orphan that once kept running appended
    nothing once try 2 began (its entries end before try 2's takeover)."""
    result = outcomes[f"celery_{mode}"]
    run = _durable(celery_e2e, result)
    with explained(celery_e2e, result):
        assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2)
        assert run.lines_of(1) == list(range(1, CELERY_STALL_AFTER + 1)), run.lines
        assert run.lines_of(2) == list(range(CELERY_STALL_AFTER + 1, CELERY_STEPS + 1)), (
            f"try 2 redid a completed tool call or skipped one: {run.lines}"
        )
        assert run.repeated_tool_calls() == 0 and not any(line["rerun"] for line in run.lines)
        assert len(run.requests) <= UNINTERRUPTED + 1, (
            f"{len(run.requests)} model requests over both tries (uninterrupted {UNINTERRUPTED})"
        )
        assert [r.outcome for r in run.requests].count("disconnected") == 1, run.requests
        # Try 1 writes its end through its supervisor: none when the supervisor died first.
        ended = "ended eviction" if MODES[mode].supervisor_survives else "died without a word"
        assert len(run.entries_of(1, "end")) == (1 if MODES[mode].supervisor_survives else 0)
        log_2 = result.log_text(2)
        assert (
            f"durable: resuming from try 1 ({ended}): {RECORDED_BY_TRY_1} messages restored, "
            "0 tool call(s) in flight run again"
        ) in log_2, log_2
        assert "durable: run completed" in log_2
        _try_1_wrote_nothing_after_the_takeover(result, run)


def _try_1_wrote_nothing_after_the_takeover(
    result: PathResult, run: Durable, recorded_by_try_1: int = RECORDED_BY_TRY_1
) -> None:
    """Fencing, from the record try 2 follows (as its last tool call read it) and the tools' lines;
    ``recorded_by_try_1``: the messages try 1 recorded before it was killed."""
    owner = run.journal.get("owner") or {}
    assert owner.get("try") == 2, f"try 2 wrote no record of its own: {run.journal}"
    entries = run.journal["entries"]
    tries = [e["try"] for e in entries]
    assert tries == sorted(tries), f"a try 1 entry follows try 2's: {entries}"
    assert run.messages_of(1) == recorded_by_try_1, entries
    assert run.journal["stale"] == [], f"try 1 appended after try 2 read its record: {run.journal['stale']}"
    late = [e for e in run.entries_of(1) if e["at"] >= owner["at"]]
    assert late == [], f"try 1 appended after try 2 took the record over at {owner['at']}: {late}"
    started_2 = _wall(_try(result, 2)["start_date"])
    assert started_2 is not None
    assert all(line["at"] < started_2 for line in run.lines if line["try"] == 1), run.lines


# -- reporting ---------------------------------------------------------------------------------


def _report_line(env: E2EEnv, result: PathResult) -> str:
    """mode -> what reached the task -> cause -> try 1 / final state -> retry worker -> leftovers."""
    try:
        record = next(iter(result.records(1)), None) or _fallback_record(env, result)
        where = "log" if result.records(1) else ("fallback file" if record else "none")
        reached = "nothing ran (SIGKILLed)"
        if record is not None and result.click_wall is not None:
            reached = (
                f"kill_received {(record['wall_origin'] - result.click_wall) * 1000:.0f} ms after the signal"
            )
        exit_ms = (
            f"{(result.task_exit_wall - record['wall_origin']) * 1000:.0f} ms"
            if record and result.task_exit_wall
            else "n/a"
        )
        finished = _supervisor_finished_wall(env, result)
        sup = (
            f"{(finished - result.task_exit_wall) * 1000:.0f} ms"
            if finished and result.task_exit_wall
            else "n/a"
        )
        first = _try(result, 1)["state"] if result.tries else None
        retry = _retry_worker(env, result) if result.final_ti.get("try_number") == 2 else None
        if retry and result.click_wall:
            retry += (
                f" {(_wall(_try(result, 2)['start_date']) or 0) - result.click_wall:.1f}s after the signal"
            )
        cause = f"{record['cause']}/{record['detail']}" if record else "none"
        durable = ""
        if result.dag_id.startswith("e2e_celery_"):
            run = _durable(env, result)
            durable = (
                f"resumed after {len(run.lines_of(1))} of {CELERY_STEPS} tool calls "
                f"({run.messages_of(1)} messages); model requests both tries "
                f"{len(run.requests)} (uninterrupted {UNINTERRUPTED}); repeated tool calls "
                f"{run.repeated_tool_calls()}; "
            )
        return (
            f"[celery] {result.path:<19} reached: {reached}; record in {where}; cause {cause}; "
            f"exit after kill {exit_ms}; supervisor saw it after {sup}; try 1 {first}; "
            f"final {result.final_ti.get('state')} try {result.final_ti.get('try_number')} "
            f"(seen {result.states_seen}); retry on {retry}; "
            f"{durable}left running {result.survivors or 'nothing'}; notes {result.notes}"
        )
    except Exception as exc:
        return f"[celery] {result.path}: no measurements ({exc!r}; error: {result.error!r})"
