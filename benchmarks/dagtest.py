"""The ``stream-dagtest`` scenario: the same kill through the real Task SDK (``dag.test()``).

It shows that the light harness agrees with the real path. Each repetition starts
``tests/process/dags/task_scenarios.py`` (scenario ``stream``: ``LLMOperator`` streaming from the
local model server) via ``dag.test()``, whose Task SDK ``run()`` installs the real SIGTERM
handler, waits until tokens flow, SIGTERMs the task pid and measures until the
``on_failure_callback`` reported ``TaskCancelled`` (*raised*; it includes the Task SDK's failure
handling and the cause query through the in-process supervisor) and until, in addition, the
request was closed on the server (*all gone*). A ``dag.test()`` child costs seconds to
start, hence few repetitions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tests.airflow_env import airflow_env, migrate
from tests.taskproc import GRACE, ROOT

from benchmarks.kill_latency import RepResult
from cancellable_agents.testing.openai_server import ScriptedModelServer


def measure(
    reps: int, server: ScriptedModelServer, home: Path, log_dir: Path, progress: Callable[[str], None] = print
) -> list[RepResult]:
    from tests.process.harness import TaskProcess

    conn = {"conn_type": "cancellable_agents_model", "host": server.base_url}
    env = airflow_env(home, {"AIRFLOW_CONN_LOCAL_MODEL": json.dumps(conn)}, pythonpath=ROOT)
    migrate(env, timeout=600)  # the benchmark's own AIRFLOW_HOME, once per run (idempotent)
    results = []
    for rep in range(reps):
        server.reset()
        task = TaskProcess("stream", env, log_dir)
        try:
            result = _one(rep, task, server)
        finally:
            task.close()
        results.append(result)
        raised = "never" if result.raised_ms is None else f"{result.raised_ms:7.1f}"
        gone = "never" if result.gone_ms is None else f"{result.gone_ms:7.1f}"
        progress(f"  stream-dagtest     ours      rep {rep:>2}: raised {raised} ms, gone {gone} ms")
    return results


def _one(rep: int, task: object, server: ScriptedModelServer) -> RepResult:
    from tests.process.harness import TaskProcess

    assert isinstance(task, TaskProcess)
    if not (server.wait_for_request(1, timeout=120) and server.wait_for_tokens(3, timeout=30)):
        return RepResult(rep, None, None, "error", error="the stream never started\n" + task.tail(15))
    sent = task.sigterm()
    failed = task.wait_for({"task_failed"}, timeout=GRACE)
    if failed is None:
        task.proc.kill()  # the supervisor's SIGKILL at the end of the grace
    exited = task.proc.wait(GRACE + 10)
    exited_at = time.monotonic()
    closed = server.wait_for_finished(len(server.requests), timeout=1.0)
    leaked = [] if closed is not None else ["http"]
    ended = [r.ended_at or 0.0 for r in closed or []]
    raised_ms = (failed["t"] - sent) * 1000 if failed else None
    # As in the light harness: the run raised and its request is closed (process exit not counted).
    gone = max([*ended, failed["t"] if failed else exited_at])
    return RepResult(
        rep,
        raised_ms=raised_ms if failed and failed["exc_type"] == "TaskCancelled" else None,
        gone_ms=None if leaked else (gone - sent) * 1000,
        outcome="raised" if failed else f"lost: SIGKILL at 5 s (exit {exited})",
        exc_type=failed["exc_type"] if failed else "",
        cause=failed.get("cause") if failed else None,
        sigkilled=failed is None,
        leaked=leaked,
    )
