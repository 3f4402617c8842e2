"""A task process whose SIGTERM's cause is decided as the Task SDK's handler would have it:
``TaskTry.kill`` from a real SIGTERM handler, with the evidence a try gathers at its start.

argv: STATE_DIR CASE. ``CASE``:

- ``evicted``: the try's log file (Airflow's supervisor JSON lines) holds no refused heartbeat;
- ``marked_failed``: it ends with the supervisor's line for a 409 ``not_running`` / ``failed``;
- ``api_only``: no log file to read, and the API server never answers in time (the cause query
  blocks for 30 s); one resource takes 0.6 s to release.

Says ``ready.json`` (pid) once its handler is in place, then waits in the run for the kill; the
record goes to ``record.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cancellable_agents.airflow import task_try as task_try_module
from cancellable_agents.airflow._server_stop import SERVER_STOP_EVENT, LocalEvidence
from cancellable_agents.airflow.task_try import TaskTry
from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.scope import Outcome, TaskCancellation

CLASSIFY_TIMEOUT_S = 1.0
SLOW_RELEASE_S = 0.6


def _write_json(path: Path, value: object) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").replace(path)


def main() -> None:
    state, case = Path(sys.argv[1]), sys.argv[2]
    scope = TaskCancellation("agent", budget=4.0)
    task_try = TaskTry(scope, operator="CauseTask", key=("d", "t", "r", -1))
    log = state / "attempt=1.log"
    lines = [{"event": "Task started", "level": "info"}]
    if case == "marked_failed":
        detail = {"reason": "not_running", "current_state": "failed"}
        lines.append({"event": SERVER_STOP_EVENT, "detail": detail, "level": "error"})
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    task_try.evidence = LocalEvidence(() if case == "api_only" else (log,), absence_decides=True)
    if case == "api_only":
        never = threading.Event()

        def busy_api_server(key: object) -> CauseVerdict:
            never.wait(30)
            return CauseVerdict(CancelCause.EVICTION, "worker shutdown")

        task_try_module._classify = busy_api_server  # type: ignore[assignment]
        scope.register(lambda: time.sleep(SLOW_RELEASE_S), name="slow-release")
    signal.signal(signal.SIGTERM, lambda *_: task_try.kill(CLASSIFY_TIMEOUT_S))
    _write_json(state / "ready.json", {"pid": os.getpid()})
    with scope.activate():
        scope.wait(60)
        scope.wait_released(scope.remaining())
        scope.wait_cause(scope.remaining())  # as the task's TaskCancelled is built
        scope.settle(Outcome.CANCELLED)
    _write_json(state / "record.json", scope.summary())


if __name__ == "__main__":
    main()
