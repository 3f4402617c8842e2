"""A deferred tool call in a real task process (issue 33, item 1): ``dag.test()`` runs the task
with the Task SDK's own ``run()``, takes its ``TaskDeferred`` as the supervisor does (the task's
execution ends, the task instance goes DEFERRED), runs the trigger inline as a triggerer would,
and runs the task again through ``resume_execution`` with the trigger's event.

Asserted over the whole task: the tool started the outside job once, the model was asked twice
(the call, then the answer with the job's result: never again for what it had decided), and the
task instance was DEFERRED while the trigger waited (the execution that deferred had ended).
The real triggerer (slot freed on a worker, *Mark failed* / *Clear* running the trigger's
``on_kill``) is the e2e suite's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.airflow._adapter import has_trigger_on_kill
from cancellable_agents.testing import jobs as deferred_jobs
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.taskproc import SETTLE, STARTUP

pytestmark = pytest.mark.skipif(not has_trigger_on_kill(), reason="deferred tool calls are Airflow 3.3+")


@pytest.fixture
def jobs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the outside jobs live; in the environment before ``spawn_task`` copies it."""
    root = tmp_path / "jobs"
    root.mkdir()
    monkeypatch.setenv("JOBS_DIR", str(root))
    return root


def test_a_deferred_call_resumes_with_the_trigger_event_and_asks_the_model_once_more(
    jobs_dir: Path, spawn_task: Any, model_server: ScriptedModelServer
) -> None:
    task = spawn_task("deferred")
    task.expect("job_started", timeout=STARTUP)
    # The trigger polls: the execution that deferred is over (dag.test() runs the trigger only
    # once the task left its process's execute with TaskDeferred).
    task.expect("polled", timeout=SETTLE, state="running")
    assert model_server.request_count == 1, "the model decided once; nothing more until the job is done"
    deferred_jobs.finish(str(jobs_dir), "j1", {"rows": 42})
    task.expect("task_succeeded", timeout=SETTLE)

    assert [e["event"] for e in task.events].count("job_started") == 1, "the job started once"
    requests = model_server.requests
    assert len(requests) == 2, f"model requests over the whole task: {[r.model for r in requests]}"
    tool_messages = [m for m in requests[1].messages if m.get("role") == "tool"]
    results = [json.loads(m["content"]) for m in tool_messages]
    assert results == [{"rows": 42}], "the trigger's event is the tool's result"
    log = task.tail(400)
    assert "resuming from try 1 (deferred to outside work)" in log, log
    waited = next(line for line in log.splitlines() if "answered after" in line)
    assert "without a worker slot" in waited, waited
    print(f"\n[deferred] model requests over the task: {len(requests)}; {waited.split('] ', 1)[-1][:80]}")
    assert "Pausing task as DEFERRED" in log and "deferred: start_job waits on PollTrigger" in log, log
