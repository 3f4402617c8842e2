"""Supervisor loss is a kill: SIGKILL a task process's parent and the task stops itself.

Real processes, no Airflow: the "supervisor" is a Python process that started the task and
sleeps; the task (``_orphan_task.py``) runs a sandboxed process tree and a ``SupervisorWatch``
on its parent. The test SIGKILLs the parent (what the OOM killer, a SIGKILLed Celery worker or
``REMAP_SIGTERM=SIGQUIT`` do to the Task SDK supervisor) and checks that the task noticed within
~100 ms, unwound everything, wrote the record to its fallback file and exited. Airflow's side
(detecting the supervisor, the heartbeat-timeout retry) is covered by ``tests/e2e/test_celery.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cancellable_agents.airflow._supervisor import (
    SUPERVISOR_LOST,
    TaskIdentity,
    fallback_record_path,
    supervisor_pid,
    watch_supervisor,
)
from cancellable_agents.airflow.kill_record.document import parse_record
from cancellable_agents.core.scope import TaskCancellation
from tests.e2e.airflow_stack import wait_until
from tests.e2e.procs import is_alive, kill_marked, marked_processes

pytestmark = pytest.mark.process

TASK = Path(__file__).with_name("_orphan_task.py")
SUPERVISOR = (
    "import subprocess, sys, time\nsubprocess.Popen([sys.executable, *sys.argv[1:]])\ntime.sleep(300)\n"
)


def test_task_stops_itself_when_its_supervisor_is_sigkilled(tmp_path: Path) -> None:
    marker = f"cancellable-agents-orphan-{uuid.uuid4().hex[:8]}"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(TASK), str(tmp_path), marker],
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        ready = wait_until(lambda: _read(tmp_path / "ready.json"), 60, "the task to start its tree")
        wait_until(lambda: len(marked_processes(marker)) >= 3, 10, "the sandboxed tree")
        assert ready["ppid"] == supervisor.pid
        killed_at = time.time()
        supervisor.kill()
        supervisor.wait(5)
        wait_until(lambda: not is_alive(ready["pid"]), 6.0, "the orphaned task to exit")
        exited_s = time.time() - killed_at
        line = (tmp_path / "record.json").read_text()
        record = parse_record(line)
        assert record is not None, line
        assert (record["cause"], record["detail"], record["outcome"]) == (
            "eviction",
            SUPERVISOR_LOST,
            "cancelled",
        )
        noticed_ms = (record["wall_origin"] - killed_at) * 1000
        events = [e["event"] for e in record["timeline"]]
        assert "supervisor_lost" in events and events.count("kill_received") == 1, events
        # No cause query through the dead supervisor: decided with the kill itself.
        assert events.index("cause_decided") == events.index("kill_received") + 1, events
        assert record["supervisor"]["pid"] == supervisor.pid
        assert marked_processes(marker) == {}, "the sandboxed tree outlived the task"
        assert {k.get("pid") for k in record["killed"]}, record["killed"]
        # Noticed within two polls (50 ms each) plus scheduling slack on a loaded machine.
        assert 0 <= noticed_ms < 300, f"noticed {noticed_ms:.0f} ms after the SIGKILL"
        assert exited_s < record["budget_s"] + 1.0
        print(
            f"\n[supervisor-loss] noticed {noticed_ms:.0f} ms after SIGKILL, "
            f"exited after {exited_s * 1000:.0f} ms"
        )
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        kill_marked(marker)


def test_no_watch_without_a_task_sdk_supervisor() -> None:
    """A plain process (and ``dag.test()``, whose comms have no socket) is never watched."""
    assert supervisor_pid() is None
    context = {
        "ti": type(
            "TI", (), {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1, "try_number": 1}
        )()
    }
    assert watch_supervisor(TaskCancellation("t"), context) is None


def test_fallback_record_path_names_the_try(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    path = fallback_record_path(TaskIdentity("dag", "manual__2026/01", "agent", 3, 2))
    assert (
        path == tmp_path / "cancellable_agents" / "records" / "dag" / "manual__2026_01" / "agent_3" / "2.json"
    )


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
