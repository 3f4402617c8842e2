"""Drive one kill path against the real Airflow and collect everything the tests assert on.

A path is: trigger a run of its DAG, wait until the task is mid-run (its sandboxed process tree
is up and the model server is streaming its answer), kill it the way a user or the
infrastructure does, wait for the run to settle, then read back the task logs (REST API), the
task instance's states (REST API, polled), the callbacks that fired, the model server's record
of the request and /proc. Nothing is asserted here: a driver returns a :class:`PathResult` so the
four paths can run in parallel and each test judges its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow.kill_record.document import parse_record
from cancellable_agents.durable._record_format import KEY_PREFIX, entries_of
from cancellable_agents.testing.openai_server import RequestRecord
from tests.e2e.airflow_stack import tail, wait_until
from tests.e2e.procs import ancestors, cmdline, is_alive, marked_processes
from tests.taskproc import STARTUP

if TYPE_CHECKING:
    from tests.e2e.conftest import E2EEnv

TASK_ID = "agent"
CALLBACK_PREFIX = "E2E_CALLBACK "
MID_RUN_TOKENS = 10
#: Until try 1 is mid-run: Airflow schedules it, a worker (or a pod) imports Airflow and starts
#: the task, the agent reaches its tree and its stream. Start-up, not what a test measures: the
#: harness's one bound for it (a loaded 2-core machine starting twelve pods at once took over 90 s).
START_TIMEOUT = STARTUP
#: Until the run settled after the kill: the retry starts like try 1 did, then finishes its work.
SETTLE_TIMEOUT = STARTUP + 60.0
#: pytest-timeout for an e2e test, which may include its module's fixture driving every path at
#: once (start-ups, kills, retries): a hang still ends, a loaded machine does not (a run past 600 s
#: was seen beside another lane at load average 10-19).
E2E_TEST_TIMEOUT = 1200
#: Task instance states after which the run may be settled.
FINISHED = ("success", "failed", "up_for_retry", "skipped", "upstream_failed")
#: The sandboxed tree is three Python processes (plus bubblewrap's two in namespace mode).
TREE_PROCESSES = 3


@dataclass
class PathResult:
    """What one kill path did, as seen from outside the task."""

    path: str
    dag_id: str
    run_id: str
    task_pid: int = 0
    supervisor_pid: int = 0
    tree_before: dict[int, str] = field(default_factory=dict)
    click_wall: float | None = None
    answered_wall: float | None = None
    states_seen: list[tuple[int, str | None]] = field(default_factory=list)
    final_ti: dict[str, Any] = field(default_factory=dict)
    run_state: str | None = None
    tries: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    callbacks_fired: list[dict[str, Any]] = field(default_factory=list)
    request: RequestRecord | None = None
    survivors: dict[int, str] = field(default_factory=dict)
    #: When try 1's task process was seen gone (polled every 10 ms from the kill on).
    task_exit_wall: float | None = None
    #: What a path's own kill observed on the way (e.g. a worker's warm-shutdown hold).
    notes: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None

    # -- reading the task log ---------------------------------------------------------------

    def records(self, try_number: int) -> list[dict[str, Any]]:
        """The ``cancellable_agents.record`` JSON objects in that try's log."""
        return [record for event in self._events(try_number) if (record := parse_record(event)) is not None]

    def log_callbacks(self, try_number: int) -> list[str]:
        """Names of the callbacks that logged into that try's log, in order."""
        return [
            event[len(CALLBACK_PREFIX) :].split()[0]
            for event in self._events(try_number)
            if event.startswith(CALLBACK_PREFIX)
        ]

    def log_text(self, try_number: int) -> str:
        """That try's log as one JSON text (events, error details, tracebacks)."""
        return json.dumps(self.logs.get(try_number, []), default=str)

    def _events(self, try_number: int) -> list[str]:
        return [str(entry.get("event", "")) for entry in self.logs.get(try_number, [])]

    def tag(self, try_number: int) -> str:
        """The prefix of that try's prompt, which identifies its request on the model server."""
        return f"[{self.dag_id}/{self.run_id}/try{try_number}]"

    # -- timings ------------------------------------------------------------------------------

    @staticmethod
    def event_ms(record: dict[str, Any], name: str) -> float | None:
        return next((e["ms"] for e in record["timeline"] if e["event"] == name), None)

    def kill_wall(self) -> float:
        """Wall-clock time the task's scope received the kill (``kill_received`` is ms 0)."""
        return float(self.records(1)[0]["wall_origin"])


@dataclass(frozen=True)
class KillPath:
    """How a path kills its task, and when its run counts as settled."""

    name: str
    dag_id: str
    kill: Callable[[E2EEnv, PathResult], tuple[float, float] | None]
    settled: Callable[[PathResult], bool]
    #: Mid-run means "streaming the answer"; a path that kills before the run waits for the tree only.
    streams: bool = True


# -- the kills ---------------------------------------------------------------------------------


def mark_failed(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """What the UI's *Mark as failed* sends; returns when it was sent and when it was answered."""
    clicked = time.time()
    response = env.rest.request("PATCH", _ti_path(result), json={"new_state": "failed"})
    # A PATCH retried after a slow first answer (a loaded api-server) finds its own work done.
    done = response.status_code == 409 and "already in failed state" in response.text
    assert response.status_code == 200 or done, f"PATCH -> {response.status_code}: {response.text}"
    return clicked, time.time()


def clear(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """What the UI's *Clear* sends for one running task instance (not retried blindly: a second
    clear would hit the next try)."""
    body = {
        "dry_run": False,
        "task_ids": [TASK_ID],
        "dag_run_id": result.run_id,
        "only_failed": False,
        "reset_dag_runs": True,
    }
    for _ in range(3):
        clicked = time.time()
        response = env.rest.request(
            "POST", f"/api/v2/dags/{result.dag_id}/clearTaskInstances", json=body, retry=False
        )
        if response.status_code == 200:
            cleared = [ti["task_id"] for ti in response.json()["task_instances"]]
            assert cleared == [TASK_ID], f"clear touched {cleared}"
            return clicked, time.time()
        ti = env.rest.json("GET", _ti_path(result))
        if response.status_code < 500 or (ti["try_number"], ti["state"]) != (1, "running"):
            raise AssertionError(f"clear failed: {response.status_code} {response.text}; TI now {ti}")
        time.sleep(0.3)
    raise AssertionError("clear kept failing with 5xx")


def evict(env: E2EEnv, result: PathResult) -> tuple[float, float]:
    """SIGTERM the task's supervisor, as a worker shutdown (k8s pod termination) does.

    The supervisor is the LocalExecutor worker process that forked the task; it is checked to
    be under the scheduler this test started before it is signalled.
    """
    scheduler = env.stack.components["scheduler"].proc.pid
    supervisor = result.supervisor_pid
    assert scheduler in ancestors(supervisor), f"pid {supervisor} is not under our scheduler {scheduler}"
    assert "LocalExecutor" in cmdline(supervisor), f"pid {supervisor} is not a worker: {cmdline(supervisor)}"
    clicked = time.time()
    os.kill(supervisor, signal.SIGTERM)
    return clicked, clicked


def no_kill(env: E2EEnv, result: PathResult) -> None:
    """``execution_timeout`` ends this one by itself."""
    return None


def _terminal_run(result: PathResult) -> bool:
    return result.run_state in ("success", "failed")


def _retried(result: PathResult) -> bool:
    return _terminal_run(result) and result.final_ti.get("try_number") == 2


PATHS = {
    "mark_failed": KillPath("mark_failed", "e2e_mark_failed", mark_failed, _terminal_run),
    "clear": KillPath("clear", "e2e_clear", clear, _retried),
    "eviction": KillPath("eviction", "e2e_eviction", evict, _retried),
    "timeout": KillPath("timeout", "e2e_timeout", no_kill, _retried),
    "evict_in_comms": KillPath("evict_in_comms", "e2e_evict_in_comms", evict, _retried, streams=False),
}


# -- the driver --------------------------------------------------------------------------------


def drive(env: E2EEnv, path: KillPath) -> PathResult:
    """Run ``path`` end to end; failures are kept in ``result.error`` with what was seen so far."""
    result = PathResult(path.name, path.dag_id, f"{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        _trigger(env, result)
        _await_mid_run(env, result, path.streams)
        clicked = path.kill(env, result)
        if clicked is not None:
            result.click_wall, result.answered_wall = clicked
        exit_watch = threading.Thread(target=_watch_exit, args=(result,), daemon=True)
        exit_watch.start()
        _await_settled(env, result, path.settled)
        exit_watch.join(1.0)
        _collect(env, result)
    except BaseException as exc:
        result.error = exc
        _collect_quietly(env, result)
    return result


def _watch_exit(result: PathResult, timeout: float = SETTLE_TIMEOUT) -> None:
    """Note when try 1's task process is gone (to measure the exit after the unwind)."""
    deadline = time.monotonic() + timeout
    while is_alive(result.task_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not is_alive(result.task_pid):
        result.task_exit_wall = time.time()


def stored_entries(env: E2EEnv, result: PathResult) -> dict[str, list[dict[str, Any]]]:
    """Try 1's record as stored now, through the REST API: key -> the entries it holds (one, or
    the list a batched store call wrote)."""
    listed = env.rest.json("GET", f"{_ti_path(result)}/state-store", params={"limit": 100})
    prefix = f"{KEY_PREFIX}.0.try1."
    return {
        e["key"]: entries_of(e["value"]) for e in listed["task_state_store"] if e["key"].startswith(prefix)
    }


def await_messages_stored(env: E2EEnv, result: PathResult, messages: int) -> dict[str, list[dict[str, Any]]]:
    """Until try 1's record holds ``messages`` messages (however its entries hold them). An entry
    is stored beside the run and may wait out the batch window: only a kill that lets the task
    unwind stores what waits, so a kill that must find a step stored waits for it first."""

    def landed() -> dict[str, list[dict[str, Any]]] | None:
        record = stored_entries(env, result)
        held = sum(len(e.get("messages", ())) for entries in record.values() for e in entries)
        return record if held >= messages else None

    return wait_until(landed, 30, f"{result.path}: {messages} messages of try 1 stored", interval=0.1)


def _ti_path(result: PathResult) -> str:
    return f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}/taskInstances/{TASK_ID}"


def _trigger(env: E2EEnv, result: PathResult) -> None:
    response = env.rest.request(
        "POST",
        f"/api/v2/dags/{result.dag_id}/dagRuns",
        json={"dag_run_id": result.run_id, "logical_date": None},
    )
    # 409: an earlier attempt of this retried POST did create the run.
    if response.status_code not in (200, 409):
        raise AssertionError(f"trigger {result.dag_id} -> {response.status_code}: {response.text}")


def _await_mid_run(env: E2EEnv, result: PathResult, streams: bool = True) -> None:
    """Until try 1 has said who it is, its tree is up and (``streams``) its answer is streaming."""
    pid_file = env.state_dir / f"{result.dag_id}.{result.run_id}.try1.json"
    marker = tree_marker(env, result, 1)

    def ready() -> bool:
        env.stack.check_alive()
        if not pid_file.exists():
            return False
        tree = marked_processes(marker)
        if not streams:
            return len(tree) >= TREE_PROCESSES
        request = _request(env, result, 1)
        return bool(request and request.tokens_sent >= MID_RUN_TOKENS and len(tree) >= TREE_PROCESSES)

    wait_until(ready, START_TIMEOUT, f"{result.dag_id} try 1 to be mid-run", interval=0.1)
    info = json.loads(pid_file.read_text())
    result.task_pid, result.supervisor_pid = info["pid"], info["ppid"]
    result.tree_before = marked_processes(marker)


def _await_settled(env: E2EEnv, result: PathResult, settled: Callable[[PathResult], bool]) -> None:
    """Poll the TI (noting every (try, state) seen) until the run settled and try 1's process is gone."""

    def probe() -> bool:
        env.stack.check_alive()
        ti = env.rest.json("GET", _ti_path(result))
        seen = (ti["try_number"], ti["state"])
        if not result.states_seen or result.states_seen[-1] != seen:
            result.states_seen.append(seen)
        result.final_ti = ti
        if ti["state"] not in FINISHED:
            return False
        run = env.rest.json("GET", f"/api/v2/dags/{result.dag_id}/dagRuns/{result.run_id}")
        result.run_state = run["state"]
        return settled(result) and not is_alive(result.task_pid)

    # 0.25 s: fast enough to see a 2 s up_for_retry, light enough for a 1-worker api-server.
    wait_until(probe, SETTLE_TIMEOUT, f"{result.dag_id} to settle", interval=0.25)


def _collect(env: E2EEnv, result: PathResult) -> None:
    tries = env.rest.json("GET", f"{_ti_path(result)}/tries")["task_instances"]
    result.tries = sorted(tries, key=lambda t: t["try_number"])
    for entry in result.tries:
        result.logs[entry["try_number"]] = fetch_log(env, result, entry["try_number"])
    result.callbacks_fired = _callbacks(env, result)
    result.request = _request(env, result, 1)
    result.survivors = _survivors(env, result)


def fetch_log(env: E2EEnv, result: PathResult, try_number: int) -> list[dict[str, Any]]:
    """A try's log events the way the UI reads them: ``application/x-ndjson``, one event a line
    (the endpoint refuses ``text/plain``; ``application/json`` gives the same events in one body)."""
    response = env.rest.request(
        "GET",
        f"{_ti_path(result)}/logs/{try_number}",
        params={"full_content": "true"},
        headers={"Accept": "application/x-ndjson"},
    )
    if response.status_code != 200:
        raise AssertionError(f"log of try {try_number} -> {response.status_code}: {response.text[:500]}")
    events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return [e for e in events if isinstance(e, dict)]


def _collect_quietly(env: E2EEnv, result: PathResult) -> None:
    # Diagnostics only: the first error is the one to report.
    with contextlib.suppress(BaseException):
        _collect(env, result)


def _callbacks(env: E2EEnv, result: PathResult) -> list[dict[str, Any]]:
    """Callbacks of this run from any process (task process or dag-processor), in order."""
    path = env.state_dir / "callbacks.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [c for c in lines if c["dag_id"] == result.dag_id and c["run_id"] == result.run_id]


def _request(env: E2EEnv, result: PathResult, try_number: int) -> RequestRecord | None:
    tag = result.tag(try_number)
    return next((r for r in env.model_server.requests if tag in json.dumps(r.messages)), None)


def tree_marker(env: E2EEnv, result: PathResult, try_number: int) -> str:
    """The argv marker of a try's sandboxed tree (``tree_marker`` in ``dags/kill_paths.py``)."""
    return f"{env.marker}:{result.dag_id}:{result.run_id}:try{try_number}"


def _survivors(env: E2EEnv, result: PathResult, timeout: float = 10.0) -> dict[int, str]:
    """Processes of try 1's tree still alive; the kernel may take a moment to finish a namespace."""
    marker = tree_marker(env, result, 1)
    deadline = time.monotonic() + timeout
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@contextlib.contextmanager
def explained(env: E2EEnv, result: PathResult) -> Iterator[None]:
    """Re-raise a driver error or a failed assertion with the logs that explain it."""
    try:
        if result.error is not None:
            raise AssertionError(f"{result.path}: {result.error!r}") from result.error
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnostics(env, result)}") from exc


def diagnostics(env: E2EEnv, result: PathResult) -> str:
    """Component log tails, the task log files of this run and what was observed, for failures."""
    parts = [
        f"path={result.path} dag={result.dag_id} run={result.run_id} task_pid={result.task_pid} "
        f"supervisor={result.supervisor_pid} states_seen={result.states_seen} run_state={result.run_state}",
        f"callbacks fired: {result.callbacks_fired}",
        f"model request: {result.request}",
        f"notes: {result.notes}",
        env.stack.logs(lines=40),
    ]
    for log_file in env.stack.task_log_files(result.dag_id, result.run_id, TASK_ID):
        parts.append(f"----- task log {log_file} -----\n{tail(log_file, 60)}")
    return "\n".join(parts)
