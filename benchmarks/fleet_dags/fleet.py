"""DAGs of the fleet benchmark (``benchmarks/fleet.py``): one agent job, five ways to run it.

The job: a 6-step agent against the local model server (``steps``: one ``work`` call per model
response, then an answer; 7 model requests uninterrupted), whose tool takes ``FLEET_TOOL_S``
(0.2 s). Each DAG is triggered once per fleet member (one run each, all at once):

* ``fleet_durable`` / ``fleet_control``: the job with ``durable=True`` / ``False``, uninterrupted,
  ``STEADY_STEPS`` steps long;
  ``fleet_write_ahead``: durable with ``durable_write_ahead=True`` (each step stored before its
  tool starts, as every step was before the journal wrote beside the tools).
* ``fleet_storm``: durable; the model response after step 3 streams slowly the first time, so
  every member is mid-stream when the benchmark SIGTERMs all supervisors (an eviction storm); the
  retry resumes.
* ``fleet_mark_failed``: the same, stopped by *Mark failed* on all members at once.
* ``fleet_bare``: a plain ``@task`` that waits (the memory baseline: no provider, no pydantic-ai).

What the benchmark reads besides the logs, in ``FLEET_STATE_DIR``: ``<run_id>.try<N>.json``
(pid, supervisor pid, at ``pre_execute``), ``<run_id>.tools.jsonl`` (each tool call's start, try
and whether it was a rerun) and ``<run_id>.try<N>.store.jsonl`` (each task state store call: op,
ms; a ``set``'s bytes). The first two also hold the CPU seconds the task process and its
supervisor had used by then (``cpu``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psutil
from airflow.sdk import DAG, task

from cancellable_agents import AgentOperator, DurableOptions
from cancellable_agents.durable import current_resume

STATE_DIR = Path(os.environ.get("FLEET_STATE_DIR", "/tmp/cancellable-agents-fleet"))
TOOL_S = float(os.environ.get("FLEET_TOOL_S", "0.2"))
STEPS = 6
CONN_ID = "local_model"
PROMPT = "[{{ run_id }}] do six steps"
MODEL = f"openai:steps?name=work&count={STEPS}&then=done"
#: The steady-state runs are longer (``FLEET_STEADY_STEPS``, 20): the benchmark times only the
#: steps taken while every member runs, after the last one started and before the first ended.
STEADY_STEPS = int(os.environ.get("FLEET_STEADY_STEPS", "20"))
STEADY_MODEL = f"openai:steps?name=work&count={STEADY_STEPS}&then=done"
#: The storms' model: the response after step 3 streams 2000 tokens 50 ms apart the first time.
STALL_AFTER = 3
STALLING_MODEL = f"{MODEL}&stall_at={STALL_AFTER}&tokens=2000&delay=0.05"
#: Each member's task must be able to run at once.
MAX_ACTIVE = 64


def _write_json(path: Path, value: Any) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").replace(path)


class TimedStore:
    """The task state store accessor, each call timed into ``<run_id>.try<N>.store.jsonl``."""

    def __init__(self, accessor: Any, out: Path) -> None:
        self._accessor = accessor
        self._out = out

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._accessor, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                took = (time.perf_counter() - started) * 1000
                line = {"op": name, "ms": round(took, 3), "at": time.time()}
                if name == "set" and len(args) > 1:
                    line["bytes"] = len(json.dumps(args[1]))
                with self._out.open("a") as out:
                    out.write(json.dumps(line) + "\n")

        return timed


def cpu_s() -> list[float]:
    """CPU seconds used so far by this task process (all its threads) and by its supervisor."""
    supervisor = psutil.Process(os.getppid()).cpu_times()
    return [time.process_time(), supervisor.user + supervisor.system]


def begin_try(context: Any) -> None:
    """Say who we are (pid, supervisor, CPU so far) and time every task state store call of this
    try."""
    ti = context["ti"]
    base = f"{ti.run_id}.try{ti.try_number}"
    accessor = context.get("task_state_store")
    if accessor is not None:
        context["task_state_store"] = TimedStore(accessor, STATE_DIR / f"{base}.store.jsonl")
    who = {"pid": os.getpid(), "ppid": os.getppid(), "at": time.time(), "cpu": cpu_s()}
    _write_json(STATE_DIR / f"{base}.json", who)


#: How long the first step waits for the other members of its batch (``await_batch``).
BARRIER_S = 180.0


def await_batch(conf: dict[str, Any], run_id: str) -> None:
    """Wait until every member of this run's batch (the run's ``conf``: ``batch``, ``members``)
    reached its first step, at most ``BARRIER_S``: the steady phases time the steps of N agents
    running at once, and without this the members' process starts (seconds of imports each, on
    the same cores) spread over most of a run. Nothing for a run without a batch."""
    batch, members = conf.get("batch"), int(conf.get("members") or 0)
    if not batch or members < 2:
        return
    arrived = STATE_DIR / f"barrier-{batch}"
    arrived.mkdir(exist_ok=True)
    (arrived / run_id).touch()
    deadline = time.monotonic() + BARRIER_S
    while len(list(arrived.iterdir())) < members and time.monotonic() < deadline:
        time.sleep(0.05)


def work(n: int) -> str:
    """One step's tool: note when it started (and on which try), then take ``FLEET_TOOL_S``. The
    first step of a steady run first waits for its batch (``await_batch``)."""
    from airflow.sdk import get_current_context

    context = get_current_context()
    ti = context["ti"]
    if n == 1 and ti.try_number == 1:
        await_batch(context["dag_run"].conf or {}, ti.run_id)
    resume = current_resume()
    line = {"n": n, "try": ti.try_number, "at": time.time(), "resumed": resume is not None, "cpu": cpu_s()}
    with (STATE_DIR / f"{ti.run_id}.tools.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")
    time.sleep(TOOL_S)
    return f"step {n} done"


def _dag(dag_id: str, retries: int) -> DAG:
    return DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        is_paused_upon_creation=False,
        max_active_runs=MAX_ACTIVE,
        max_active_tasks=MAX_ACTIVE,
        default_args={"retries": retries, "retry_delay": timedelta(seconds=1)},
        tags=["fleet"],
    )


def _agent(model: str, durable: bool, write_ahead: bool = False) -> AgentOperator:
    return AgentOperator(
        task_id="agent",
        prompt=PROMPT,
        model=model,
        llm_conn_id=CONN_ID,
        stream=True,
        tools=[work],
        durable=DurableOptions(write_ahead=write_ahead) if durable else False,
        pre_execute=begin_try,
    )


with _dag("fleet_durable", retries=0):
    _agent(STEADY_MODEL, durable=True)

with _dag("fleet_write_ahead", retries=0):
    _agent(STEADY_MODEL, durable=True, write_ahead=True)

with _dag("fleet_control", retries=0):
    _agent(STEADY_MODEL, durable=False)

with _dag("fleet_storm", retries=1):
    _agent(STALLING_MODEL, durable=True)

with _dag("fleet_mark_failed", retries=1):
    _agent(STALLING_MODEL, durable=True)

with _dag("fleet_bare", retries=0):

    @task(task_id="agent")
    def bare(**context: Any) -> None:
        """Say who we are, then wait until the benchmark has measured (at most 120 s)."""
        ti = context["ti"]
        _write_json(STATE_DIR / f"{ti.run_id}.try1.json", {"pid": os.getpid(), "ppid": os.getppid()})
        release = STATE_DIR / "bare.release"
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    bare()
