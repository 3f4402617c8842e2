"""A SIGTERM's cause, decided in a real task process from a real signal: from the try's log file
when it tells (an eviction leaves no refused heartbeat there, a *Mark failed* leaves the
supervisor's line), within the signal handler itself, before the unwind starts; from the API
server only when there is no log to read, and then within ``classify_timeout`` of the kill, not
after the release (``_cause_task.py``). The same paths under a real Airflow, supervisor
included: ``tests/e2e/test_kill_paths.py`` (``cause_source``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.process.trees import eventually
from tests.taskproc import SETTLE, STARTUP

pytestmark = pytest.mark.process

TASK = Path(__file__).with_name("_cause_task.py")


def _killed(tmp_path: Path, case: str) -> dict[str, Any]:
    """Start the task for ``case``, SIGTERM it once it is ready, return its record."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(TASK), str(tmp_path), case], env=env)
    try:
        ready = tmp_path / "ready.json"
        assert eventually(ready.exists, timeout=STARTUP), "the task never got ready"
        os.kill(json.loads(ready.read_text())["pid"], signal.SIGTERM)
        assert proc.wait(SETTLE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return dict(json.loads((tmp_path / "record.json").read_text()))


def _events(record: dict[str, Any]) -> list[str]:
    return [e["event"] for e in record["timeline"]]


def _ms(record: dict[str, Any], event: str) -> float:
    return float(next(e["ms"] for e in record["timeline"] if e["event"] == event))


@pytest.mark.parametrize(
    ("case", "cause", "detail"),
    [("evicted", "eviction", "worker shutdown"), ("marked_failed", "user", "marked failed")],
)
def test_the_cause_is_read_from_the_task_log_in_the_signal_handler(
    tmp_path: Path, case: str, cause: str, detail: str
) -> None:
    """Decided in the handler, before the unwind's thread exists: ``cause_decided`` follows
    ``kill_received`` at once, and a *Mark failed* is ``user``, never ``eviction``."""
    record = _killed(tmp_path, case)
    assert (record["cause"], record["detail"], record["cause_source"]) == (cause, detail, "task log"), record
    events = _events(record)
    assert events.index("cause_decided") == events.index("kill_received") + 1, events
    decided = _ms(record, "cause_decided")
    print(f"\n[cause] {case}: {cause} from the task log, decided {decided:.2f} ms after the kill")


def test_a_slow_api_server_does_not_hold_the_unwind_past_classify_timeout(tmp_path: Path) -> None:
    """No log to read: the API server is asked and never answers. The cause is ``unknown``
    (``unanswered``) and the release, 0.6 s of it, is not followed by another full second of
    waiting: the budget counts from the kill (before, the unwind ended ~1.6 s after it)."""
    record = _killed(tmp_path, "api_only")
    assert (record["cause"], record["cause_source"]) == ("unknown", "unanswered"), record
    released = _ms(record, "resources_released")
    print(f"\n[cause] api only, never answering: resources released {released:.0f} ms after the kill")
    assert released < 1450, f"the cause query held the unwind {released:.0f} ms"
