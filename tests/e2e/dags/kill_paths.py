"""DAGs for the end-to-end kill-path tests: one DAG per way Airflow stops a running agent task.

Every DAG has one agent task. On its first try it starts a process tree in a ``LocalSandbox``
attached to the task's cancellation scope (a forking, ``setsid``-ing Python program whose argv
carries ``E2E_MARKER``, so survivors can be found in /proc) and streams a slow answer from the
local model server (2000 tokens, 50 ms apart: it is still streaming when the test kills it). A
retry (try 2+) answers at once with the ``echo`` model, so a retried run finishes by itself.

What the test reads back besides the task log and the REST API, written to ``E2E_STATE_DIR``:
``<dag_id>.<run_id>.try<N>.json`` (the task's pid, its parent = the supervisor, its process group) and
``callbacks.jsonl`` (which callback fired for which try). The callbacks also log a
``E2E_CALLBACK`` line into the task log.

The CeleryExecutor worker-shutdown DAGs (``e2e_celery_*``) are durable agents instead: see
:func:`append_line`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, get_current_context, task
from pydantic_ai import RunContext

from cancellable_agents import AgentOperator, DurableOptions, LocalSandbox, current_cancellation
from cancellable_agents.durable import current_resume
from cancellable_agents.durable._record_format import KEY_PREFIX, entries_of, segment_key

log = logging.getLogger("e2e")

STATE_DIR = Path(os.environ.get("E2E_STATE_DIR", "/tmp/cancellable-agents-e2e"))
MARKER = os.environ.get("E2E_MARKER", "cancellable-agents-e2e")
CONN_ID = "local_model"
SLOW_MODEL = "openai:slow?tokens=2000&delay=0.05"
QUICK_MODEL = "openai:echo"
#: Templated: the first try streams for 100 s, a retry answers at once.
MODEL = f"{{{{ '{QUICK_MODEL}' if ti.try_number > 1 else '{SLOW_MODEL}' }}}}"
PROMPT = "[{{ dag.dag_id }}/{{ run_id }}/try{{ ti.try_number }}] write a very long essay"

#: Three processes (one escapes into its own session) that sleep until something kills them.
TREE_PROGRAM = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.fork()\ntime.sleep(300)\n"

#: Long enough for a first try to be streaming well before its run's deadline (13 s after the scope
#: began with 15 s) on a loaded 2-core machine, short enough to keep the suite quick. The scope
#: exists from pre_execute on, and execute first imports the model's SDK (openai: 1.2 s on an idle
#: box) and builds the agent: scope to run start took 8-14 s in a Celery run beside another lane
#: (load 6-8), and the 15 s this was ended one run 0.8 s into its stream, before the test saw it
#: streaming. With 25 s, scope to run start took 24 s in one Celery run on a slower machine: the
#: run began 0.5 s before its deadline and never streamed.
EXECUTION_TIMEOUT_S = 40

DEFAULTS: dict[str, Any] = {
    "retries": 1,
    # Long enough for the test's 0.25 s polling to see ``up_for_retry`` before the next try.
    "retry_delay": timedelta(seconds=2),
}


def tree_marker(dag_id: str, run_id: str, try_number: int) -> str:
    """The argv marker of the process tree a given try starts (the test scans /proc for it).

    Per run, not per DAG: concurrent runs of one DAG (``tests/e2e/test_pods.py``) each wait for,
    and judge, their own tree."""
    return f"{MARKER}:{dag_id}:{run_id}:try{try_number}"


def _callback(name: str, context: Any) -> None:
    ti = context["ti"]
    log.warning("E2E_CALLBACK %s dag=%s try=%s", name, ti.dag_id, ti.try_number)
    line = json.dumps({"callback": name, "dag_id": ti.dag_id, "run_id": ti.run_id, "try": ti.try_number})
    with (STATE_DIR / "callbacks.jsonl").open("a") as out:
        out.write(line + "\n")


def on_failure(context: Any) -> None:
    _callback("on_failure_callback", context)


def on_retry(context: Any) -> None:
    _callback("on_retry_callback", context)


def begin_try(context: Any) -> None:
    """Say who we are (pid, supervisor pid) and, on the first try, start the sandboxed tree."""
    ti = context["ti"]
    scope = context["task"].cancellation
    if ti.try_number == 1 and os.environ.get("E2E_POD_RESTRICTED"):
        hostile_in_a_restricted_pod(ti, scope)
    if ti.try_number == 1:
        sandbox = LocalSandbox(scope=scope)
        marker = tree_marker(ti.dag_id, ti.run_id, ti.try_number)
        sandbox.start([sys.executable, "-c", TREE_PROGRAM, marker])
        log.info("E2E_TREE started %s in sandbox %s (%s)", marker, sandbox.id, sandbox.mode)
    info = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "try": ti.try_number}
    path = STATE_DIR / f"{ti.dag_id}.{ti.run_id}.try{ti.try_number}.json"
    path.with_suffix(".tmp").write_text(json.dumps(info))
    path.with_suffix(".tmp").replace(path)
    log.info("E2E_MIDRUN %s", json.dumps(info))


def hostile_in_a_restricted_pod(ti: Any, scope: Any) -> None:
    """In an unprivileged pod: a sandboxed command tries the secret planted in the pod's HOME and
    the API server's port; the task itself (no boundary: the control) can do both."""
    secret = Path(os.environ["HOME"]) / ".aws" / "credentials"
    port = int(os.environ["AIRFLOW__API__PORT"])
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), 5); print('connected')"
    box = LocalSandbox(scope=scope, env={"SECRET": str(secret)})
    try:
        result = box.run(f'cat "$SECRET"; {sys.executable} -c "{connect}"', timeout=30)
        seen = {"mode": box.mode, "stdout": result.stdout, "stderr": result.stderr, "uid": os.getuid()}
    finally:
        box.destroy()
    import socket

    with socket.create_connection(("127.0.0.1", port), 5):
        seen["task_connects"] = True
    seen["task_reads"] = "pod-secret" in secret.read_text()
    path = STATE_DIR / f"{ti.dag_id}.{ti.run_id}.hostile.json"
    path.with_suffix(".tmp").write_text(json.dumps(seen))
    path.with_suffix(".tmp").replace(path)


def talk_to_the_supervisor_until_killed(context: Any) -> None:
    """Try 1: keep the main thread inside supervisor comms calls (Variable.get) until killed, so
    the SIGTERM lands mid-call: the deadlock the design forbids (cause query from on_kill)."""
    begin_try(context)
    if context["ti"].try_number > 1:
        return
    from airflow.sdk import Variable

    scope = context["task"].cancellation
    calls = 0
    while not scope.cancelled and calls < 100_000:
        Variable.get("e2e_absent", default=None)
        calls += 1
    log.info("E2E_COMMS_CALLS %d", calls)


def _dag(dag_id: str, doc: str) -> DAG:
    return DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        is_paused_upon_creation=False,
        default_args=DEFAULTS,
        doc_md=doc,
        tags=["e2e"],
    )


#: All paths run at once on 2 cores (next to another CI lane), and the one-worker api-server stalls
#: for a second or more at times: the cause query gets more than the default 1 s (it overlaps the
#: unwind, and what is asserted is the cause it finds, not how fast a loaded box answers).
CLASSIFY_TIMEOUT = 3.0


def _agent_operator(
    pre_execute: Any = begin_try, prompt: str = PROMPT, model: str = MODEL, **kwargs: Any
) -> AgentOperator:
    return AgentOperator(
        task_id="agent",
        prompt=prompt,
        model=model,
        llm_conn_id=CONN_ID,
        stream=True,
        classify_timeout=CLASSIFY_TIMEOUT,
        pre_execute=pre_execute,
        on_failure_callback=on_failure,
        on_retry_callback=on_retry,
        **kwargs,
    )


def _agent_decorated(dag_id: str) -> None:
    @task.agent(
        task_id="agent",
        model=MODEL,
        llm_conn_id=CONN_ID,
        stream=True,
        classify_timeout=CLASSIFY_TIMEOUT,
        on_failure_callback=on_failure,
        on_retry_callback=on_retry,
    )
    def agent(**context: Any) -> str:
        begin_try(context)
        ti = context["ti"]
        return f"[{dag_id}/{ti.run_id}/try{ti.try_number}] write a very long essay"

    agent()


with _dag("e2e_mark_failed", "Killed by *Mark as failed*: must fail without retry."):
    _agent_decorated("e2e_mark_failed")

with _dag("e2e_clear", "Killed by *Clear*: the next try must start."):
    _agent_operator()

with _dag("e2e_eviction", "Killed by SIGTERM to its supervisor (worker eviction): must retry."):
    _agent_decorated("e2e_eviction")

with _dag("e2e_timeout", "Killed by its execution_timeout: must end gracefully, then retry."):
    _agent_operator(execution_timeout=timedelta(seconds=EXECUTION_TIMEOUT_S))

with _dag("e2e_evict_in_comms", "Evicted while its main thread is inside a supervisor call: no deadlock."):
    _agent_operator(pre_execute=talk_to_the_supervisor_until_killed)


#: CeleryExecutor worker shutdowns (``tests/e2e/test_celery.py``): each DAG's queue is served by
#: exactly one worker when try 1 starts, the one its test kills; under the LocalExecutor the
#: queue is ignored.
CELERY_WORKER_KILLS = ("warm", "cold", "soft", "remap", "sigkill_main", "node_loss")

#: The worker-shutdown DAGs are durable agents of CELERY_STEPS sequential ``append_line`` calls.
#: The model request after call CELERY_STALL_AFTER streams 2000 tokens 50 ms apart the first time
#: (try 1 is killed there, mid-stream); its repeat by a resumed try 2 is answered at once. An
#: uninterrupted run makes CELERY_STEPS + 1 model requests; prompt and model are the same on every
#: try (they are the run's fingerprint).
CELERY_STEPS = 4
CELERY_STALL_AFTER = 2
CELERY_MODEL = (
    f"openai:steps?name=append_line&count={CELERY_STEPS}&stall_at={CELERY_STALL_AFTER}"
    "&tokens=2000&delay=0.05&then=all+lines+written"
)
CELERY_PROMPT = "[{{ dag.dag_id }}/{{ run_id }}] append four lines"


def run_file(ti: Any, suffix: str) -> Path:
    """``<dag_id>.<run_id>.<suffix>`` in ``E2E_STATE_DIR``."""
    return STATE_DIR / f"{ti.dag_id}.{ti.run_id}.{suffix}"


def append_line(ctx: RunContext[None], n: int) -> str:
    """Append line ``n`` (with its try and time) to ``<dag_id>.<run_id>.lines``.

    Call CELERY_STALL_AFTER answers with the try's tag ``[dag/run/tryN]`` (the drivers' handle on
    try N's request), so the stalled request is the first to carry it.
    """
    context = get_current_context()
    ti = context["ti"]
    resume = current_resume()
    line = {
        "n": n,
        "try": ti.try_number,
        "rerun": bool(resume and resume.is_rerun(ctx.tool_call_id)),
        "pid": os.getpid(),
        "at": time.time(),
    }
    with run_file(ti, "lines").open("a") as out:
        out.write(json.dumps(line) + "\n")
    if n == CELERY_STALL_AFTER:
        return f"line {n} written [{ti.dag_id}/{ti.run_id}/try{ti.try_number}]"
    return f"line {n} written"


def snapshot_journal(context: Any, result: Any) -> None:
    """``post_execute``: write what the continuity record holds once the run completed (its
    entries stored: a step's entry may wait out the batch window while the run goes) to
    ``<dag_id>.<run_id>.journal.json``: which try wrote each entry, and when, against when the
    record's owning try took it over."""
    ti = context["ti"]
    _snapshot_journal(context["task_state_store"], ti.try_number, run_file(ti, "journal.json"))


def _snapshot_journal(store: Any, try_number: int, path: Path) -> None:
    """The record try ``try_number`` follows (the earlier segments its head names, each up to the
    count it froze, then its own), entry by entry: which try wrote it, when, how many messages;
    and what older tries wrote past those counts (never part of it)."""
    record = f"{KEY_PREFIX}.0"  # the task's first (only) durable run
    first_value = store.get(segment_key(record, try_number, 0))
    first = entries_of(first_value)[0] if first_value is not None else {}
    base = (first.get("head") or {}).get("base", [])
    entries: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for segment, count in [*base, [try_number, None]]:
        j = 0  # a key holds one entry or the list of those one store call wrote (format 3)
        while (value := store.get(segment_key(record, segment, j))) is not None:
            for entry in entries_of(value):
                summary = {k: entry.get(k) for k in ("i", "kind", "try", "at")}
                (entries if count is None or j < count else stale).append(
                    {**summary, "messages": len(entry.get("messages", []))}
                )
                j += 1
    snapshot = {"owner": {"try": try_number, "at": first.get("at")}, "entries": entries, "stale": stale}
    path.with_suffix(".tmp").write_text(json.dumps(snapshot))
    path.with_suffix(".tmp").replace(path)


def celery_queue(mode: str) -> str:
    """The Celery queue of ``e2e_celery_<mode>`` (only its victim worker serves it at first)."""
    return f"e2e_{mode}"


for _mode in CELERY_WORKER_KILLS:
    with _dag(
        f"e2e_celery_{_mode}", f"Celery worker shutdown ({_mode}) mid-run: must retry on another worker."
    ):
        _agent_operator(
            queue=celery_queue(_mode),
            prompt=CELERY_PROMPT,
            model=CELERY_MODEL,
            tools=[append_line],
            # A tool's return is recorded before the request that carries it.
            durable=DurableOptions(flush_after=0),
            post_execute=snapshot_journal,
        )


#: KubernetesExecutor pods (``tests/e2e/test_pods.py``): the worker-shutdown DAGs' durable agent,
#: run by the test executor that hands each try to a pod (``tests/e2e/pod_executor.py``). Only
#: where that executor is configured (the LocalExecutor stack): elsewhere ``executor=`` would make
#: this file an import error.
POD_EXECUTOR = "PodExecutor"

#: The call of ``e2e_pod_tool``'s try 1 that is a long sync tool (the one in flight at the kill).
POD_TOOL_AT = CELERY_STALL_AFTER + 1


def append_line_after_a_long_job(ctx: RunContext[None], n: int) -> str:
    """:func:`append_line`, but try 1's call :data:`POD_TOOL_AT` is first a long sync job written
    as the docs say (it waits on the task's cancellation scope): it says it is running in
    ``<dag_id>.<run_id>.in_tool`` and, once the task is killed, returns without writing its line."""
    ti = get_current_context()["ti"]
    if n == POD_TOOL_AT and ti.try_number == 1:
        path = run_file(ti, "in_tool")
        path.with_suffix(".tmp").write_text(json.dumps({"n": n, "pid": os.getpid(), "at": time.time()}))
        path.with_suffix(".tmp").replace(path)
        scope = current_cancellation()
        if scope is not None and scope.wait(300):
            return "stopped"
    return append_line(ctx, n)


if POD_EXECUTOR in os.environ.get("AIRFLOW__CORE__EXECUTOR", ""):
    with _dag("e2e_pod", "Run in a pod (PID namespace, dumb-init, execute_workload): killed as pods are."):
        _agent_operator(
            prompt=CELERY_PROMPT,
            model=CELERY_MODEL,
            tools=[append_line],
            durable=DurableOptions(flush_after=0),
            post_execute=snapshot_journal,
            executor=POD_EXECUTOR,
        )
    with _dag("e2e_pod_restricted", "Run in an unprivileged pod (uid 50000, RuntimeDefault seccomp)."):
        _agent_operator(
            prompt=CELERY_PROMPT,
            model=CELERY_MODEL,
            tools=[append_line],
            durable=DurableOptions(flush_after=0),
            post_execute=snapshot_journal,
            executor=POD_EXECUTOR,
        )
    with _dag("e2e_pod_tool", "Run in a pod, killed while a sync tool runs."):
        _agent_operator(
            prompt=CELERY_PROMPT,
            model=(
                f"openai:steps?name={append_line_after_a_long_job.__name__}&count={CELERY_STEPS}"
                "&then=all+lines+written"
            ),
            tools=[append_line_after_a_long_job],
            durable=DurableOptions(flush_after=0),
            post_execute=snapshot_journal,
            executor=POD_EXECUTOR,
        )
