"""The cause of a user's stop comes from the supervisor's refused heartbeat, read locally.

Airflow's own supervisor code (``ActivitySubprocess._send_heartbeat_if_needed``) heartbeats a
real HTTP server that refuses the way the execution API does (409 ``not_running`` with the
state, 404/410 ``not_found``) and logs into a real task log file through the Task SDK's own
logger; at the moment it would SIGTERM the task, the test reads the cause the way the task's
SIGTERM handler does. That pins the order this relies on (the line is on disk before the
signal) against the installed Airflow, and the mapping of each answer to a cause. Then the
whole classifier decides a user's stop and a worker shutdown while the server's state query
never answers, which ``classify_sigterm`` alone turns into ``unknown``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cancellable_agents.airflow import _adapter as adapter
from cancellable_agents.airflow import _server_stop as server_stop
from cancellable_agents.airflow import task_try
from cancellable_agents.airflow._server_stop import open_task_logs, server_stop_verdict
from cancellable_agents.core.causes import CancelCause, CauseSource, CauseVerdict, UserAction
from cancellable_agents.core.scope import TaskCancellation

LOG_PATH = "dag_id=d/run_id=r/task_id=t/attempt=1.log"


def _from_log(verdict: CauseVerdict) -> CauseVerdict:
    """``verdict`` as the try's log file decides it."""
    return dataclasses.replace(verdict, source=CauseSource.TASK_LOG)


class _Refusing(BaseHTTPRequestHandler):
    """The execution API's answer to a heartbeat for a try the server no longer runs."""

    answer: tuple[int, dict[str, Any]] = (409, {})

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, detail = self.answer
        body = json.dumps({"detail": detail}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def log_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "logs"
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(folder))
    return folder


@pytest.fixture
def supervisor_log(log_folder: Path) -> Iterator[Any]:
    """The Task SDK supervisor's logger for one try, writing to its file (kept open, as there)."""
    from airflow.sdk.execution_time.supervisor import _configure_logging

    logger, handle = _configure_logging(LOG_PATH, None)  # type: ignore[arg-type]
    yield logger
    handle.close()


def _refused_heartbeat(logger: Any, status: int, detail: dict[str, Any]) -> list[CauseVerdict | None]:
    """Run Airflow's heartbeat against a server answering ``status``; return what the task would
    read at each SIGTERM the supervisor sends."""
    from airflow.sdk.api.client import Client
    from airflow.sdk.execution_time.supervisor import ActivitySubprocess

    _Refusing.answer = (status, detail)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    read_at_sigterm: list[CauseVerdict | None] = []
    try:
        supervisor = SimpleNamespace(
            id="0199b7a6-0000-7000-8000-000000000001",
            client=Client(base_url=f"http://127.0.0.1:{server.server_port}/", token="t"),
            process_log=logger,
            _process=SimpleNamespace(pid=os.getpid()),
            _terminal_state=None,
            _last_heartbeat_attempt=0.0,
            _last_successful_heartbeat=0.0,
            failed_heartbeats=0,
            kill=lambda *a, **k: read_at_sigterm.append(server_stop_verdict(open_task_logs(pids=("self",)))),
        )
        ActivitySubprocess._send_heartbeat_if_needed(supervisor)  # type: ignore[arg-type]
    finally:
        server.shutdown()
        server.server_close()
    return read_at_sigterm


@pytest.mark.parametrize(
    ("status", "detail", "action"),
    [
        (409, {"reason": "not_running", "current_state": "failed"}, UserAction.MARKED_FAILED),
        (409, {"reason": "not_running", "current_state": "success"}, UserAction.MARKED_SUCCESS),
        (409, {"reason": "not_running", "current_state": "skipped"}, UserAction.MARKED_SKIPPED),
        (409, {"reason": "not_running", "current_state": "restarting"}, UserAction.CLEARED),
        (
            410,
            {"reason": "not_found", "message": "moved to the Task Instance History table"},
            UserAction.CLEARED,
        ),
        (404, {"reason": "not_found", "message": "Task Instance not found"}, UserAction.CLEARED),
    ],
)
def test_the_cause_is_on_disk_before_the_supervisors_sigterm(
    supervisor_log: Any, status: int, detail: dict[str, Any], action: UserAction
) -> None:
    from airflow.sdk.execution_time import supervisor

    if status == 410 and "HTTPStatus.GONE" not in Path(supervisor.__file__).read_text():
        pytest.skip("this supervisor counts a 410 as a failed heartbeat (Airflow 3.1; its server sends 404)")
    assert _refused_heartbeat(supervisor_log, status, detail) == [_from_log(CauseVerdict.of_user(action))]


def test_running_elsewhere_is_left_to_the_server(supervisor_log: Any) -> None:
    detail = {"reason": "running_elsewhere", "current_hostname": "h2", "current_pid": 7}
    assert _refused_heartbeat(supervisor_log, 409, detail) == [None]


def test_a_sigterm_without_a_refused_heartbeat_is_an_eviction(supervisor_log: Any) -> None:
    """A forwarded SIGTERM (worker shutdown) leaves no line: the server would say ``running``."""
    supervisor_log.info("Task started")
    logs = open_task_logs(pids=("self",))
    assert server_stop_verdict(logs, absence_decides=True) == _from_log(
        CauseVerdict(CancelCause.EVICTION, "worker shutdown")
    )
    # A supervisor not known to log it (a later Airflow that words it otherwise): ask the server.
    assert server_stop_verdict(logs, absence_decides=False) is None


def test_which_supervisors_log_every_stop() -> None:
    import airflow

    expected = not airflow.__version__.startswith("3.1.")
    assert server_stop.supervisor_logs_server_stops() is expected


def test_without_a_log_file_only_the_server_can_tell(log_folder: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "not-a-task-log.log"
    with elsewhere.open("ab"):
        assert open_task_logs(pids=("self",)) == []
        assert server_stop_verdict([]) is None
        assert server_stop_verdict([log_folder / "gone.log"], absence_decides=True) is None


@pytest.mark.parametrize(
    ("refused", "expected"),
    [
        (
            {"reason": "not_running", "current_state": "failed"},
            CauseVerdict.of_user(UserAction.MARKED_FAILED),
        ),
        (None, CauseVerdict(CancelCause.EVICTION, "worker shutdown")),
    ],
)
def test_the_cause_holds_while_the_server_cannot_answer(
    supervisor_log: Any,
    monkeypatch: pytest.MonkeyPatch,
    refused: dict[str, Any] | None,
    expected: CauseVerdict,
) -> None:
    """The API server is too busy to answer the state query within ``classify_timeout`` (it
    never answers here): a user's stop is still ``user``, a worker shutdown still ``eviction``."""
    if refused is not None:
        supervisor_log.error(server_stop.SERVER_STOP_EVENT, detail=refused)
    elif not server_stop.supervisor_logs_server_stops():
        pytest.skip("this supervisor may signal without the line (Airflow 3.1): the server decides")
    never = threading.Event()
    asked: list[tuple[Any, ...]] = []

    def busy_server(*key: Any) -> CauseVerdict:
        asked.append(key)
        never.wait(30)
        return CauseVerdict(CancelCause.EVICTION, "worker shutdown")

    monkeypatch.setattr(adapter, "classify_sigterm", busy_server)
    monkeypatch.setattr(server_stop, "supervisor_pid", os.getppid)  # running under a supervisor
    scope = TaskCancellation()
    try:
        classify = functools.partial(task_try._classify, ("d", "t", "r", -1))
        scope.cancel(CancelCause.UNKNOWN, classify=classify, classify_timeout=0.2)
        assert scope.wait_cause(5) is expected.cause
        assert scope.cause_detail == expected.detail
        assert scope.summary()["cause_source"] == "task log"
        assert asked == [], "decided without a round trip to the server"
    finally:
        never.set()
