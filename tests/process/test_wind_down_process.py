"""Wind-down in a real task process (issue 41): ``dag.test()`` runs the task with the Task SDK's
own ``execution_timeout`` (SIGALRM) and SIGTERM handler, the model is the scripted server over real
HTTP (``loop``: calls its tool while it is offered, answers once it is offered none).

- a run that winds down ends **success** before its deadline with the final answer as its result;
  SIGALRM never fires, and the last request the server saw offered no tools;
- a final answer too slow for the deadline is killed as a run without wind-down is (``timeout``);
- a kill (SIGTERM) during the wind-down is a kill as today: nothing waits for the final answer.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cancellable_agents.airflow.kill_record.document import parse_records
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.taskproc import SETTLE, STARTUP

pytestmark = pytest.mark.process

#: Airflow SIGKILLs the task 5 s after SIGTERM; everything must be done before that.
GRACE = 5.0
#: The scenarios' ``execution_timeout`` and ``wind_down`` (``dags/task_scenarios.py``, which only
#: a task process can import).
WIND_DOWN_TIMEOUT = 24.0
WIND_DOWN = 10.0


def _final_request(model_server: ScriptedModelServer, timeout: float) -> Any:
    """The first request that offered no tools (the wind-down's), once the server has it."""
    return model_server.wait_until(lambda records: next((r for r in records if r.tools == []), None), timeout)


def test_a_run_that_winds_down_ends_success_before_sigalrm(
    spawn_task: Any, model_server: ScriptedModelServer
) -> None:
    task = spawn_task("wind_down")
    task.expect("step", timeout=STARTUP)
    started = time.monotonic()
    result = task.expect("result", timeout=WIND_DOWN_TIMEOUT + STARTUP)
    succeeded = task.expect("task_succeeded", timeout=SETTLE)
    assert result["output"].startswith("final answer (after "), result
    assert time.monotonic() - started < WIND_DOWN_TIMEOUT, "the task ended after its execution_timeout"
    assert task.wait_exit(SETTLE), task.tail()
    tail = task.tail(2000)
    assert "AirflowTaskTimeout" not in tail, "SIGALRM fired"
    assert parse_records(tail) == [], "a wound-down task writes no kill record"
    assert "wound down" in tail and "cancellable_agents.wind_down {" in tail
    records = model_server.requests
    assert records[-1].tools == [] and all(r.tools == ["step_work"] for r in records[:-1]), [
        r.tools for r in records
    ]
    events = [e["event"] for e in succeeded["record"]["timeline"]]
    assert "wind_down_started" in events and "run_wound_down" in events
    wound = next(e for e in succeeded["record"]["timeline"] if e["event"] == "run_wound_down")
    print(f"\n[wind-down] timeline event: {wound}")


def test_a_final_answer_past_the_deadline_is_killed_as_timeout(
    spawn_task: Any, model_server: ScriptedModelServer
) -> None:
    task = spawn_task("wind_down_slow")
    task.expect("step", timeout=STARTUP)
    final = _final_request(model_server, WIND_DOWN_TIMEOUT)
    assert final is not None, task.tail()
    failed = task.expect("task_failed", timeout=WIND_DOWN + SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert failed["cause"] == "timeout"
    gone = model_server.wait_for_disconnect(timeout=GRACE)
    assert gone is not None and gone.tools == [], "the final request was closed by the kill"
    assert task.wait_exit(SETTLE), task.tail()
    assert "AirflowTaskTimeout" not in task.tail(2000), "the run's own deadline came before SIGALRM"


def test_a_kill_during_the_wind_down_is_a_kill(spawn_task: Any, model_server: ScriptedModelServer) -> None:
    task = spawn_task("wind_down_slow")
    task.expect("step", timeout=STARTUP)
    assert _final_request(model_server, WIND_DOWN_TIMEOUT) is not None, task.tail()
    sent = task.sigterm()
    failed = task.expect("task_failed", timeout=SETTLE)
    assert failed["exc_type"] == "TaskCancelled", task.tail()
    assert failed["cause"] == "eviction"  # dag.test() has no worker: the server still has the try running
    assert failed["t"] - sent < GRACE
    gone = model_server.wait_for_disconnect(timeout=GRACE)
    assert gone is not None and gone.tools == []
    assert task.wait_exit(SETTLE), task.tail()
    (logged,) = parse_records(task.tail(2000))
    assert logged["cause"] == "eviction"
