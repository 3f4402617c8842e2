"""A fleet of durable agents on a real Airflow: what the journal and the kill paths cost at N.

For each metadata database (SQLite, PostgreSQL) one real Airflow 3 (api-server with one worker,
scheduler, dag-processor, LocalExecutor: ``tests/e2e/airflow_stack.py``; PostgreSQL from
``tests/e2e/postgres.py``) runs the DAGs of ``benchmarks/fleet_dags/fleet.py`` against the local
model server. For each N (ascending), N members at once:

1. **steady**: N durable runs, N control runs (``durable=False``), each a 20-step job whose
   tool takes 0.2 s, and N durable runs written ahead (``durable_write_ahead=True``: each step
   stored before its tool starts); ``--rounds`` times, each round's order drawn at random
   (``--order-seed``). The members' first steps wait for the whole batch (``await_batch`` in the DAGs), so
   the steps are N agents running at once. Measured: every task state store call
   (``TimedStore``: op and latency), store calls per step (per model request), step time (one
   tool start to the next) durable vs written ahead vs control, of the steps taken while all N
   members ran (the wave of process starts before and the tail after are not a step's cost),
   each round's ratio, Airflow's heartbeats in that span and over the phase, CPU per step
   by part of the stack (``Fleet.cpu_s_by_part``), the members' own CPU per step while all ran
   and before their first step (``Fleet.member_cpu``), and whether the machine itself stalled
   meanwhile (``benchmarks/fleet_bystander.py``; PostgreSQL's lock waits and slow statements).
2. **eviction storm**: N durable runs, all mid-stream in their 4th model request; then every
   supervisor is SIGTERMed at once. From each try-1 record: unwound (``resources_released``) and
   when the cause was decided; the task process gone before Airflow's SIGKILL (5 s); whether the
   retry resumed (try 2's first tool call is step 4); model requests over both tries.
3. **mark-failed storm**: the same, but every member is PATCHed to ``failed`` at once (as the
   UI's *Mark failed*). Measured: the PATCHes the API server accepted (on SQLite some end in
   500 "database is locked" and stop nothing), and for those: request -> kill reached the task
   (the record's origin), -> task process gone, when the cause was decided, the cause recorded
   (must be ``user``), not retried.
4. **memory**: RSS and PSS of each member (task process + its supervisor), sampled mid-stream in
   the eviction storm, beside N bare ``@task`` s (no provider, no pydantic-ai) sampled the same way.

``--side-by-side K`` adds K rounds of one fleet, half durable and half plain, started together:
both halves step in the same seconds, so their ratio carries no drift of the machine between
phases. ``--api-load K`` runs K threads of REST reads against the api-server during the storms (a slower
API server: the cause must still be ``user``). While a steady phase's members all run, the
driver waits on their tool notes, not the REST API (``await_span_over``); ``--ui-poll`` lists the
runs every 3 s throughout, as an open UI grid does. ``--api-workers 1,4`` repeats everything with that
many API server workers; ``--db-pool K`` sizes every component's database pool (the API server's
pool timeouts are counted: ``Fleet.pool_timeouts``). ``--before REV`` runs each configuration
twice, side by side in the same session: first with the provider as of git revision ``REV`` (its
``src/`` exported to a temporary directory, first on the stack's ``PYTHONPATH``), then with this
checkout's; the closing table compares them (step ratio, store calls per step and bytes per call,
``set`` p50/p95/max, heartbeat p95 durable vs control, causes right, unwound max, RSS/PSS per
task). Airflow's task heartbeats are timed in the supervisors by
``benchmarks/fleet_site/sitecustomize.py``. Prints one markdown table per database and writes
``benchmarks/results/fleet.json`` and ``fleet.png`` (each metric against N).

``make bench-fleet`` (= ``python -m benchmarks.fleet``); not part of CI. The full table (N up to
16 and 32) is for a quiet machine: on a busy one the numbers measure the neighbours.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from tests.e2e.airflow_stack import AirflowStack, RestClient, wait_until
from tests.e2e.postgres import PostgresCluster
from tests.e2e.postgres import missing_reason as postgres_missing

from cancellable_agents.airflow.kill_record.document import parse_record, unwound_ms
from cancellable_agents.testing.openai_server import ScriptedModelServer

DAGS_FOLDER = Path(__file__).with_name("fleet_dags")
#: ``sitecustomize`` that times the supervisors' heartbeats (``FLEET_HEARTBEAT_LOG``).
HEARTBEAT_SITE = Path(__file__).with_name("fleet_site")
RESULTS = Path(__file__).with_name("results")
TASK_ID = "agent"
#: Airflow SIGKILLs a task's group this long after the supervisor's SIGTERM.
GRACE_S = 5.0
#: Tokens the stalled response must have streamed before a storm (every member mid-stream).
MID_STREAM_TOKENS = 10
STEPS = 6
FINISHED = ("success", "failed")
#: How often ``await_runs`` lists the runs: the UI grid's auto-refresh (``[api]
#: auto_refresh_interval``, 3 s). That list is the API server's heaviest request here (server
#: time p50 67 ms, p95 0.4 s at N=32); polled every 0.5 s it was 1.5 requests a second beside
#: the fleet's 6 heartbeats, and the heartbeats it overlapped had a p95 of 0.2-0.6 s against
#: 0.05-0.1 s for the others: the driver's own load, in both the durable and the plain runs.
#: In the steady state it waits so only once all members no longer run (``await_span_over``).
RUNS_POLL_S = 3.0
#: Tool calls of one steady run (``FLEET_STEADY_STEPS`` of the fleet DAGs, 20).
STEADY_STEPS = int(os.environ.get("FLEET_STEADY_STEPS", "20"))
#: How often the driver lists the runs while a steady phase's members all run (unless
#: ``--ui-poll``): only to notice a phase whose members all failed before that span ended.
QUIET_POLL_S = 30.0
#: What PostgreSQL logs in a fleet run (kept in the stack's home as ``postgres.log``): a lock
#: waited on past ``deadlock_timeout`` (1 s), every autovacuum and checkpoint, statements over
#: half a second; with millisecond timestamps, to set beside the API server's access log.
POSTGRES_DIAGNOSTICS = {
    "log_lock_waits": "on",
    "log_autovacuum_min_duration": "0",
    "log_checkpoints": "on",
    "log_min_duration_statement": "500",
    "log_line_prefix": "%m [%p] ",
}
#: The lines of ``POSTGRES_DIAGNOSTICS``' log that ``Fleet.postgres_events`` counts, by what they say.
POSTGRES_EVENTS = (
    ("lock waits > 1 s", re.compile(r"LOG:  process \d+ still waiting for ")),
    ("statements > 0.5 s", re.compile(r"LOG:  duration: ")),
)
#: ``fleet_bystander``'s lines (in the state dir) and how late a wake counts as a stall: a
#: heartbeat slowed by half a second there was slowed by the machine, whatever it was asked.
BYSTANDER_LOG = "bystander.jsonl"
STALL_MS = 500.0
#: Every process's garbage collections of 20 ms or more (``fleet_site/sitecustomize.py``), and
#: from how long one of the API server's counts: a collection stops every thread of its process,
#: so in the one API server every request in flight waits for it.
COLLECTIONS_LOG = "collections.jsonl"
#: The API server's collections so far by generation and its oldest generation's size, every 2 s.
GENERATIONS_LOG = "api_generations.jsonl"
API_PAUSE_MS = 100.0
#: One line of the API server's access log (structlog's ``http.access`` ``request finished``).
ACCESS_LINE = re.compile(r"^(?P<at>\S+) .*request finished.* duration_us=(?P<us>\d+) .* path=(?P<path>\S+)")
#: The kinds of request counted while every member ran, by path (the first that matches).
API_KINDS = (
    ("heartbeat", r"^/execution/task-instances/[^/]+/heartbeat$"),
    ("task state store", r"^/execution/store/"),
    ("REST", r"^/api/v2/"),
    ("other execution API", r"^/execution/"),
)


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ratio_interval(
    rounds: list[tuple[list[float], list[float]]], q: float = 0.95, draws: int = 2000
) -> tuple[float, float] | None:
    """Where the pooled ``q`` quantile's ratio (first / second of each pair) lies nine times in
    ten when the rounds are drawn again with replacement (a bootstrap over rounds, seeded): how
    far one run's ratio can be trusted. A heartbeat p95 moves with the stalls that hit a round's
    heartbeats together, so the rounds, not the heartbeats, are what is resampled. ``None`` for
    fewer than two rounds."""
    if len(rounds) < 2:
        return None
    pick, ratios = random.Random(0).choices, []
    for _ in range(draws):
        drawn = pick(rounds, k=len(rounds))
        first = pct([ms for a, _ in drawn for ms in a], q)
        second = pct([ms for _, b in drawn for ms in b], q)
        if first and second:
            ratios.append(first / second)
    return (pct(ratios, 0.05) or 0.0, pct(ratios, 0.95) or 0.0) if ratios else None


# -- the stack -----------------------------------------------------------------------------------


@dataclass
class Fleet:
    """A running Airflow with the fleet DAGs, its REST client, the model server and state dir."""

    db: str
    stack: AirflowStack
    rest: RestClient
    model_server: ScriptedModelServer
    state_dir: Path
    #: The PostgreSQL postmaster's pid and log (``None`` on SQLite).
    db_pid: int | None = None
    db_log: Path | None = None

    def cpu_s_by_part(self) -> dict[str, float]:
        """CPU seconds each part of the stack has used so far (``tree_cpu_s``): where a step's
        CPU goes, durable or not, on cores they all share."""
        parts = {
            "tasks + supervisors": self.stack.components["scheduler"].proc.pid,
            "API server": self.stack.components["api-server"].proc.pid,
            "PostgreSQL": self.db_pid,
        }
        used = {name: tree_cpu_s(pid) for name, pid in parts.items() if pid is not None}
        me = psutil.Process().cpu_times()  # the model server answers from threads of this process
        used["model server + driver"] = me.user + me.system
        return used

    def tag(self, run_id: str) -> str:
        return f"[{run_id}]"

    def requests_by_run(self, run_ids: Iterable[str]) -> dict[str, list[Any]]:
        """Each run's model requests, from one copy of the server's records. A run's tag is in
        its prompt, so only the user messages are searched: over a long run's rounds tens of
        thousands of requests pile up, and dumping each one's whole transcript once per run
        (as this did) took a minute between phases by the seventh round, and longer each round."""
        prompts = [
            (r, json.dumps([m for m in r.messages if m.get("role") == "user"]))
            for r in self.model_server.requests
        ]
        tags = {run_id: self.tag(run_id) for run_id in run_ids}
        return {run_id: [r for r, text in prompts if tag in text] for run_id, tag in tags.items()}

    def member(self, run_id: str, try_number: int = 1) -> dict[str, Any] | None:
        path = self.state_dir / f"{run_id}.try{try_number}.json"
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(path.read_text()))
        return None

    def heartbeats(self, start: float, end: float) -> list[float]:
        """Milliseconds of every task heartbeat sent between ``start`` and ``end`` (wall)."""
        return [ms for _, ms in self.heartbeats_sent(start, end)]

    def heartbeats_sent(
        self, start: float, end: float, senders: set[int] | None = None
    ) -> list[tuple[float, float]]:
        """(wall time sent, milliseconds) of every task heartbeat sent between ``start`` and
        ``end`` by the supervisors ``senders`` (pids; ``None``: any), in the order sent."""
        lines = [h for h in self._heartbeat_lines(start, end) if senders is None or h["pid"] in senders]
        return sorted((h["at"] - h["ms"] / 1000, h["ms"]) for h in lines)

    def _heartbeat_lines(self, start: float, end: float) -> list[dict[str, Any]]:
        """The heartbeat log's lines of heartbeats sent between ``start`` and ``end`` (wall)."""
        return [h for h in self.jsonl("heartbeats.jsonl") if start <= h["at"] - h["ms"] / 1000 <= end]

    def supervisors(self, runs: Iterable[str]) -> set[int]:
        """The supervisor pids of the runs' first tries (what signs their heartbeats)."""
        return {int(m["ppid"]) for m in map(self.member, runs) if m}

    def api_requests(self, start: float, end: float) -> list[tuple[str, float]]:
        """Every request the API server began between ``start`` and ``end`` (wall; as
        ``heartbeats`` counts them), as (kind, server milliseconds) from its access log: what the
        fleet asks of it, by kind (``API_KINDS``), and how long a heartbeat took inside it rather
        than end to end. (Counted by their end, a few stalled before the span and ended in it.)"""
        log_file = self.stack.home / "components" / "api-server.log"
        found = []
        for line in log_file.read_text(errors="replace").splitlines() if log_file.exists() else []:
            match = ACCESS_LINE.match(line)
            if match is None:
                continue
            server_ms = int(match["us"]) / 1000
            began = datetime.fromisoformat(match["at"].replace("Z", "+00:00")).timestamp() - server_ms / 1000
            if start <= began <= end:
                kind = next((k for k, pattern in API_KINDS if re.search(pattern, match["path"])), "other")
                found.append((kind, server_ms))
        return found

    def pool_timeouts(self) -> int:
        """Requests the API server failed because its database connection pool stayed exhausted
        for ``pool_timeout`` (30 s) since it started: each logs SQLAlchemy's ``TimeoutError``.
        On Airflow 3.2+/3.3 a REST request's token check waits for a connection on the server's
        event loop, so while it waits every request stalls (apache/airflow#66493)."""
        log_file = self.stack.home / "components" / "api-server.log"
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        return text.count("raise exc.TimeoutError(")

    def bystander(self, start: float, end: float) -> tuple[list[float], float | None]:
        """``fleet_bystander``'s wakes between ``start`` and ``end`` (wall): how late each woke
        (ms), and the run-queue wait of the API server's threads over them, summed, in ms a
        second (``None`` with fewer than two wakes)."""
        wakes = [w for w in self.jsonl(BYSTANDER_LOG) if start <= w["at"] <= end]
        late = [float(w["late_ms"]) for w in wakes]
        if len(wakes) < 2 or wakes[-1]["at"] <= wakes[0]["at"]:
            return late, None
        waited_ms = (wakes[-1]["api_wait_ns"] - wakes[0]["api_wait_ns"]) / 1e6
        return late, max(0.0, waited_ms / (wakes[-1]["at"] - wakes[0]["at"]))

    def api_pauses(self, start: float, end: float) -> list[float]:
        """Milliseconds of each garbage collection of ``API_PAUSE_MS`` or more that a process of
        the API server (its own and its workers') ended between ``start`` and ``end`` (wall)."""
        return [float(c["ms"]) for c in self._api_collections(start, end) if c["ms"] >= API_PAUSE_MS]

    def api_full_collections(self, start: float, end: float) -> list[float]:
        """Milliseconds of each full collection (generation 2) of the API server between
        ``start`` and ``end``: each walks its whole heap and stops every request meanwhile."""
        return [float(c["ms"]) for c in self._api_collections(start, end) if c["gen"] == 2]

    def api_promoted(self, start: float, end: float) -> dict[str, float]:
        """From the API server's samples (``GENERATIONS_LOG``) nearest ``start`` and ``end``: how
        many objects its oldest generation gained (net of what a full collection freed) and how
        many young collections it made between them (its full ones: ``api_full_collections``)."""
        samples = self.jsonl(GENERATIONS_LOG)
        if not samples:
            return {}
        first = min(samples, key=lambda x: abs(x["at"] - start))
        last = min(samples, key=lambda x: abs(x["at"] - end))
        made = [b - a for a, b in zip(first["api_collections"], last["api_collections"], strict=True)]
        return {
            "seconds": last["at"] - first["at"],
            "gen2_gained": last["gen2_objects"] - first["gen2_objects"],
            "gen0": made[0],
            "gen1": made[1],
        }

    def _api_collections(self, start: float, end: float) -> list[dict[str, Any]]:
        root = self.stack.components["api-server"].proc.pid
        with contextlib.suppress(psutil.Error):
            pids = {root, *(c.pid for c in psutil.Process(root).children(recursive=True))}
            return [c for c in self.jsonl(COLLECTIONS_LOG) if c["pid"] in pids and start <= c["at"] <= end]
        return []

    def heartbeats_unanswered(self, start: float, end: float) -> int:
        """Heartbeats sent between ``start`` and ``end`` (wall) that got no answer: the Task SDK
        gave up on them after ``[workers] execution_api_timeout`` (5 s) and sent them again."""
        return sum(1 for h in self._heartbeat_lines(start, end) if h["status"] < 0)

    def member_cpu(self, run_id: str, window: tuple[float, float]) -> dict[str, float]:
        """A member's CPU seconds from its first try's notes (``cpu``: task process, supervisor,
        cumulative): over the steps it took while all ran (``task``, ``supervisor``, ``steps``),
        and from its ``pre_execute`` to its first step (``task start``, ``supervisor start``,
        ``members``; the benchmark's own wait for the batch is in it, on both sides alike)."""
        notes = [t for t in self.jsonl(f"{run_id}.tools.jsonl") if t["try"] == 1 and "cpu" in t]
        notes.sort(key=lambda t: t["at"])
        found: dict[str, float] = {}
        inside = [t for t in notes if window[0] <= t["at"] <= window[1]]
        if len(inside) >= 2:
            found["task"] = inside[-1]["cpu"][0] - inside[0]["cpu"][0]
            found["supervisor"] = inside[-1]["cpu"][1] - inside[0]["cpu"][1]
            found["steps"] = len(inside) - 1
        began = (self.member(run_id) or {}).get("cpu")
        if began and notes:
            found["task start"] = notes[0]["cpu"][0] - began[0]
            found["supervisor start"] = notes[0]["cpu"][1] - began[1]
            found["members"] = 1
        return found

    def postgres_events(self, start: float, end: float) -> dict[str, int]:
        """PostgreSQL's log lines between ``start`` and ``end`` (wall) by ``POSTGRES_EVENTS``."""
        counts = dict.fromkeys((name for name, _ in POSTGRES_EVENTS), 0)
        if self.db_log is None or not self.db_log.exists():
            return counts
        for line in self.db_log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
                if start <= at <= end:
                    for name, pattern in POSTGRES_EVENTS:
                        counts[name] += bool(pattern.search(line))
        return counts

    def jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self.state_dir / name
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line still being written
                found.append(json.loads(line))
        return found

    def records(self, dag_id: str, run_id: str, try_number: int) -> list[dict[str, Any]]:
        """The ``cancellable_agents.record`` objects in a try's log file (read from disk)."""
        found = []
        for log_file in self.stack.task_log_files(dag_id, run_id, TASK_ID):
            if log_file.name != f"attempt={try_number}.log":
                continue
            for line in log_file.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = parse_record(str(json.loads(line).get("event", "")))
                    if record is not None:
                        found.append(record)
        return found


@contextlib.contextmanager
def fleet_stack(
    db: str,
    parallelism: int,
    api_workers: int = 1,
    code: Path | None = None,
    settings: dict[str, str] | None = None,
    db_pool: int | None = None,
) -> Iterator[Fleet]:
    """Airflow on ``db`` (``sqlite`` or ``postgres``) with the fleet DAGs, until the block ends.

    :param api_workers: the API server's workers (``[api] workers``).
    :param code: a ``src`` directory whose provider the stack imports instead of this checkout's.
    :param settings: ``[cancellable_agents]`` options for every component (name -> value).
    :param db_pool: every component's ``[database] sql_alchemy_pool_size`` and
        ``sql_alchemy_max_overflow`` (``None``: Airflow's 5 and 10).
    """
    home = Path(tempfile.mkdtemp(prefix=f"cancellable-agents-fleet-{db}-"))
    state_dir = home / "fleet_state"
    state_dir.mkdir()
    with contextlib.ExitStack() as stack_of:
        model_server = stack_of.enter_context(ScriptedModelServer())
        url, db_pid, db_log = None, None, None
        if db == "postgres":
            db_log = home / "postgres.log"
            cluster = stack_of.enter_context(PostgresCluster(log_path=db_log, settings=POSTGRES_DIAGNOSTICS))
            url, db_pid = cluster.sqlalchemy_url, cluster.proc.pid if cluster.proc else None
        env = {
            "AIRFLOW_CONN_LOCAL_MODEL": json.dumps(
                {"conn_type": "cancellable_agents_model", "host": model_server.base_url}
            ),
            "FLEET_STATE_DIR": str(state_dir),
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(parallelism),
            "AIRFLOW__API__WORKERS": str(api_workers),
            "FLEET_HEARTBEAT_LOG": str(state_dir / "heartbeats.jsonl"),
            "FLEET_GC_LOG": str(state_dir / COLLECTIONS_LOG),
            "FLEET_GC_SAMPLES": str(state_dir / GENERATIONS_LOG),
            **{f"AIRFLOW__CANCELLABLE_AGENTS__{k.upper()}": v for k, v in (settings or {}).items()},
            **(
                {
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": str(db_pool),
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_MAX_OVERFLOW": str(db_pool),
                }
                if db_pool
                else {}
            ),
            "PYTHONPATH": os.pathsep.join(
                [*([str(code)] if code else []), str(HEARTBEAT_SITE), os.environ.get("PYTHONPATH", "")]
            ),
        }
        stack = AirflowStack(home, DAGS_FOLDER, env, database_url=url)
        stack.migrate()
        try:
            stack.start()
            stack.wait_healthy()
            rest = stack.client()
            _await_dags(stack, rest)
            api_pid = stack.components["api-server"].proc.pid
            stack_of.enter_context(bystander(state_dir / BYSTANDER_LOG, api_pid))
            fleet = Fleet(db, stack, rest, model_server, state_dir, db_pid, db_log)
            # One run first: the first tasks of a fresh stack meet an API server still warming up
            # (on a busy machine their start calls time out), which is not what is measured.
            await_runs(fleet, "fleet_control", trigger(fleet, "fleet_control", 1, "warm-up"), 600)
            yield fleet
            rest.close()
        finally:
            stack.remember_processes()
            stack.stop()
    print(f"[fleet] {db}: AIRFLOW_HOME={home} (kept for the logs)")


@contextlib.contextmanager
def bystander(out: Path, api_pid: int) -> Iterator[None]:
    """``fleet_bystander`` in a session of its own (as each Airflow component runs), until the
    block ends."""
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "benchmarks.fleet_bystander", str(out), str(api_pid)]
    proc = subprocess.Popen(argv, cwd=root, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _await_dags(stack: AirflowStack, rest: RestClient, timeout: float = 120) -> None:
    wanted = {
        "fleet_durable",
        "fleet_write_ahead",
        "fleet_control",
        "fleet_storm",
        "fleet_mark_failed",
        "fleet_bare",
    }

    def parsed() -> bool:
        stack.check_alive()
        body = rest.json("GET", "/api/v2/dags", params={"dag_id_pattern": "fleet_", "limit": 100})
        return wanted <= {d["dag_id"] for d in body["dags"]}

    wait_until(parsed, timeout, "the fleet DAGs to be parsed", interval=0.5, on_timeout=stack.logs)


@contextlib.contextmanager
def source_as_of(rev: str) -> Iterator[Path]:
    """This repository's ``src/`` as of ``rev``, exported to a temporary directory (no worktree,
    nothing checked out here), for a stack that imports that provider instead."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="cancellable-agents-fleet-before-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", rev, "src"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp) / "src"


@contextlib.contextmanager
def source_now() -> Iterator[Path]:
    """This checkout's ``src/`` as it is now, copied: an edit made while the benchmark runs does
    not reach the stacks it starts later."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="cancellable-agents-fleet-now-") as tmp:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        yield Path(shutil.copytree(root / "src", Path(tmp) / "src", ignore=ignore))


# -- driving runs --------------------------------------------------------------------------------


def trigger(
    fleet: Fleet,
    dag_id: str,
    n: int,
    phase: str,
    together: bool = False,
    batch: tuple[str, int] | None = None,
) -> list[str]:
    """N runs of ``dag_id`` (ids ``PHASE-N-i-xxxx``); returns their run ids. ``together``: their
    first steps wait until all N reached them (``await_batch`` in the fleet DAGs); ``batch``
    (id, members): until all members of that batch did, runs of other DAGs included."""
    batch_id, members = batch if batch is not None else (uuid.uuid4().hex[:8], n)
    runs = [f"{phase}-n{n}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    conf = {"batch": batch_id, "members": members} if together or batch is not None else {}
    for run_id in runs:
        body = {"dag_run_id": run_id, "logical_date": None, "conf": conf}
        fleet.rest.json("POST", f"/api/v2/dags/{dag_id}/dagRuns", json=body)
    return runs


def newest_run_states(fleet: Fleet, dag_id: str) -> dict[str, str]:
    """Run id -> state of the newest 100 runs of ``dag_id``: one listing, as the UI's grid makes."""
    body = fleet.rest.json("GET", f"/api/v2/dags/{dag_id}/dagRuns", params={"limit": 100, "order_by": "-id"})
    return {r["dag_run_id"]: r["state"] for r in body["dag_runs"]}


def await_runs(fleet: Fleet, dag_id: str, runs: list[str], timeout: float) -> dict[str, str]:
    """Until every run is success/failed; returns run id -> state. Reads the newest 100 runs
    (the API's page limit, ``[api] maximum_page_limit``: a larger ``limit`` is cut to it, and
    from the fourth round on the oldest runs filled the page), so ``runs`` must be among them,
    every ``RUNS_POLL_S``, as the UI's grid does."""
    states: dict[str, str] = {}

    def done() -> bool:
        fleet.stack.check_alive()
        states.update({r: state for r, state in newest_run_states(fleet, dag_id).items() if r in runs})
        return all(states.get(r) in FINISHED for r in runs)

    wait_until(done, timeout, f"{len(runs)} runs of {dag_id} to finish", interval=RUNS_POLL_S)
    return states


def await_span_over(fleet: Fleet, dag_id: str, runs: list[str], timeout: float) -> None:
    """Until the span in which every member ran is over (a member started its last tool call,
    ``STEADY_STEPS``), read from the members' own tool notes (local files), with one REST
    listing every ``QUIET_POLL_S``. The UI-rate polling of ``await_runs`` is the driver's own
    load, but on Airflow 3.2+ a listing can stall every request in the API server while its
    token check waits for a database connection (apache/airflow#66493): at N=32 the heartbeats
    overlapping one took p50 150-350 ms against 12, and with it the durable / plain heartbeat
    p95 was 1.62 pooled, without it 1.35. ``--ui-poll`` keeps the polling."""
    deadline, next_listing = time.monotonic() + timeout, time.monotonic() + QUIET_POLL_S
    while time.monotonic() < deadline:
        fleet.stack.check_alive()
        tools = (fleet.jsonl(f"{run_id}.tools.jsonl") for run_id in runs)
        if any(sum(t["try"] == 1 for t in calls) >= STEADY_STEPS for calls in tools):
            return
        if time.monotonic() >= next_listing:
            next_listing = time.monotonic() + QUIET_POLL_S
            states = newest_run_states(fleet, dag_id)
            if all(states.get(r) in FINISHED for r in runs):
                return
        time.sleep(0.5)


def await_members(fleet: Fleet, runs: list[str], timeout: float, *, streaming: bool) -> None:
    """Until every run's try 1 said who it is and (``streaming``) is mid-stream in its stall."""

    def ready() -> bool:
        fleet.stack.check_alive()
        if any(fleet.member(r) is None for r in runs):
            return False
        if not streaming:
            return True
        by_run = fleet.requests_by_run(runs).values()
        return all(any(q.tokens_sent >= MID_STREAM_TOKENS for q in requests) for requests in by_run)

    wait_until(ready, timeout, f"{len(runs)} members to be mid-run", interval=0.1)


def watch_exits(pids: list[int], timeout: float) -> dict[int, float]:
    """pid -> monotonic time it was seen gone (polled every 10 ms), for up to ``timeout`` s."""
    gone: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(gone) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in gone and not _alive(pid):
                gone[pid] = time.monotonic()
        time.sleep(0.01)
    return gone


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def memory(pids: list[int]) -> tuple[float, float] | None:
    """(RSS, PSS) in MiB summed over ``pids``; ``None`` if one is gone."""
    rss = pss = 0.0
    try:
        for pid in pids:
            info = psutil.Process(pid).memory_full_info()
            rss += info.rss / 2**20
            pss += getattr(info, "pss", 0) / 2**20
    except psutil.Error:
        return None
    return rss, pss


@contextlib.contextmanager
def api_load(fleet: Fleet, threads: int) -> Iterator[None]:
    """``threads`` loops of REST reads against the api-server while the block runs."""
    stop = threading.Event()
    token = fleet.rest._http.headers["Authorization"]

    def hammer() -> None:
        with httpx.Client(base_url=fleet.stack.url, headers={"Authorization": token}, timeout=30) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    http.get("/api/v2/dags", params={"limit": 100})

    workers = [threading.Thread(target=hammer, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(35)


def all_at_once(calls: list[Callable[[], Any]]) -> list[float]:
    """Run every call on its own thread, released together; returns each call's wall start."""
    barrier = threading.Barrier(len(calls))
    started = [0.0] * len(calls)

    def run(i: int) -> None:
        barrier.wait(30)
        started[i] = time.time()
        calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return started


# -- the phases ----------------------------------------------------------------------------------


@dataclass
class Row:
    """Everything measured for one database at one N (with one code, one API server setup)."""

    db: str
    n: int
    code: str = "this checkout"
    api_workers: int = 1
    store_ms: list[float] = field(default_factory=list)
    #: The ``set`` calls alone (the journal's writes): latency and bytes.
    set_ms: list[float] = field(default_factory=list)
    set_bytes: list[int] = field(default_factory=list)
    #: Airflow's task heartbeats (ms) sent while each steady-state variant ran: over the whole
    #: phase (its wave of process starts included), and only while every member ran.
    heartbeat_ms: dict[str, list[float]] = field(default_factory=dict)
    heartbeat_steady_ms: dict[str, list[float]] = field(default_factory=dict)
    #: Each round's step p50 durable / control: how far the ratio moves between rounds.
    step_ratio_rounds: list[float] = field(default_factory=list)
    #: Each round's heartbeats while all ran, durable beside control (``ratio_interval``): a p95
    #: of a few hundred heartbeats moves with the API server's stalls, which hit many at once.
    heartbeat_round_pairs: list[tuple[list[float], list[float]]] = field(default_factory=list)
    #: The same over each round's whole phase, and over its wave of starts alone (from the
    #: trigger until every member ran): where a fleet's heartbeats wait longest.
    phase_round_pairs: list[tuple[list[float], list[float]]] = field(default_factory=list)
    wave_round_pairs: list[tuple[list[float], list[float]]] = field(default_factory=list)
    #: Each round's heartbeats with no answer within Airflow's timeout, and the API server's full
    #: collections (ms) over its whole phase, by steady-state variant.
    unanswered_rounds: dict[str, list[int]] = field(default_factory=dict)
    api_full_rounds: dict[str, list[list[float]]] = field(default_factory=dict)
    #: Each round's growth of the API server's oldest generation and its young collections
    #: (``Fleet.api_promoted``), by steady-state variant.
    api_promoted_rounds: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    #: The API server's requests while every member ran, by steady-state variant: seconds of
    #: those spans, requests by kind (``API_KINDS``), and each heartbeat's time inside the server.
    api_window_s: dict[str, float] = field(default_factory=dict)
    api_requests: dict[str, dict[str, int]] = field(default_factory=dict)
    heartbeat_server_ms: dict[str, list[float]] = field(default_factory=dict)
    #: While every member ran, by steady-state variant: how late a bystander's 0.1 s sleeps woke
    #: (ms; and the latest in each round), the API server's run-queue wait each round (ms a
    #: second), PostgreSQL's lock waits and slow statements (``Fleet.bystander``,
    #: ``Fleet.postgres_events``). A slow heartbeat beside a late bystander was the machine's.
    bystander_late_ms: dict[str, list[float]] = field(default_factory=dict)
    bystander_late_max_rounds: dict[str, list[float]] = field(default_factory=dict)
    api_cpu_wait_ms_per_s: dict[str, list[float]] = field(default_factory=dict)
    #: The API server's garbage collections of ``API_PAUSE_MS`` or more (ms), ``Fleet.api_pauses``.
    api_pause_ms: dict[str, list[float]] = field(default_factory=dict)
    #: Over each variant's whole phases (the waves of process starts included): heartbeats with
    #: no answer within Airflow's timeout, and the API server's collections as ``api_pause_ms``.
    heartbeat_unanswered: dict[str, int] = field(default_factory=dict)
    api_pause_phase_ms: dict[str, list[float]] = field(default_factory=dict)
    postgres_events: dict[str, dict[str, int]] = field(default_factory=dict)
    store_ops: dict[str, int] = field(default_factory=dict)
    calls_per_step: list[float] = field(default_factory=list)
    step_durable_ms: list[float] = field(default_factory=list)
    step_control_ms: list[float] = field(default_factory=list)
    step_write_ahead_ms: list[float] = field(default_factory=list)
    #: Side by side (``side_by_side``): steps of the durable and the plain half of one fleet,
    #: taken in the same seconds, pooled, and each round's ratio of their p50s.
    side_durable_ms: list[float] = field(default_factory=list)
    side_control_ms: list[float] = field(default_factory=list)
    side_ratio_rounds: list[float] = field(default_factory=list)
    #: The heartbeats of each half's supervisors in those seconds (``fleet_durable`` /
    #: ``fleet_control``), pooled, and each round's ratio of their p95s.
    side_heartbeat_ms: dict[str, list[float]] = field(default_factory=dict)
    side_heartbeat_ratio_rounds: list[float] = field(default_factory=list)
    #: Each durable heartbeat beside the plain one sent nearest it (``matched_beats``): a stall
    #: of the API server hits both halves' heartbeats due in its second, and a p95 of a hundred
    #: heartbeats per half follows which half had more of them due then.
    side_heartbeat_pairs: list[tuple[float, float]] = field(default_factory=list)
    #: CPU ms per step by part of the stack (``Fleet.cpu_s_by_part``), by steady-state variant.
    cpu_ms_per_step_by_part: dict[str, dict[str, float]] = field(default_factory=dict)
    #: The members' own CPU by steady-state variant, from their tool notes (``Fleet.member_cpu``):
    #: sums of seconds and counts, as ``MEMBER_CPU`` names them.
    member_cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    #: The whole machine's busy CPU (all processes: tasks, supervisors, API server, database)
    #: per step, by steady-state variant, over the whole phase (the members' process starts
    #: included): what the journal costs where everything shares the cores.
    cpu_ms_per_step: dict[str, float] = field(default_factory=dict)
    evict: dict[str, Any] = field(default_factory=dict)
    mark_failed: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    #: The API server's pool timeouts since the stack started (``Fleet.pool_timeouts``).
    pool_timeouts: int = 0
    errors: list[str] = field(default_factory=list)


def steady(
    fleet: Fleet,
    row: Row,
    timeout: float,
    write_ahead: bool = True,
    rounds: int = 2,
    ui_poll: bool = False,
    order_seed: int = 42,
) -> None:
    """N durable runs, N written ahead (unless not ``write_ahead``) and N control runs, for
    ``rounds`` rounds, each round's order drawn at random (seeded by ``order_seed``): a drift of
    the machine over the phase falls on all variants alike, and so does what the stack does
    every few phases. The order used to alternate (durable, control, control, durable, ...), and
    the API server's full collection, which came about every four phases, then fell on durable
    phases: 24 of 48 against 2 of 48 in seven runs; 12 of 24 against 8 of 24 in two drawn at random.
    Store calls and step times, pooled over the rounds. The driver lists the runs at the UI's
    rate only once all members no longer run (``await_span_over``), unless ``ui_poll``."""
    variants = [
        ("fleet_durable", "durable", row.step_durable_ms),
        *([("fleet_write_ahead", "ahead", row.step_write_ahead_ms)] if write_ahead else []),
        ("fleet_control", "control", row.step_control_ms),
    ]
    draw = random.Random(order_seed).sample
    order = [(r, v) for r in range(rounds) for v in draw(variants, len(variants))]
    busy_by: dict[str, float] = {}
    steps_by: dict[str, int] = {}
    round_p50: dict[tuple[int, str], float | None] = {}
    round_beats: dict[tuple[int, str], list[float]] = {}
    phase_beats: dict[tuple[int, str], list[float]] = {}
    wave_beats: dict[tuple[int, str], list[float]] = {}
    by_part: dict[str, dict[str, float]] = {}
    for round_no, (dag_id, name, step_ms) in order:
        busy_before, parts_before, started = _busy_cpu_s(), fleet.cpu_s_by_part(), time.time()
        runs = trigger(fleet, dag_id, row.n, name, together=True)
        if not ui_poll:
            await_span_over(fleet, dag_id, runs, timeout)
        await_runs(fleet, dag_id, runs, timeout)
        busy_by[name] = busy_by.get(name, 0.0) + _busy_cpu_s() - busy_before
        for part, used in fleet.cpu_s_by_part().items():
            spent = by_part.setdefault(name, {})
            spent[part] = spent.get(part, 0.0) + used - parts_before.get(part, 0.0)
        ended = time.time()
        phase_beats[(round_no, name)] = fleet.heartbeats(started, ended)
        row.heartbeat_ms.setdefault(name, []).extend(phase_beats[(round_no, name)])
        unanswered = fleet.heartbeats_unanswered(started, ended)
        row.heartbeat_unanswered[name] = row.heartbeat_unanswered.get(name, 0) + unanswered
        row.unanswered_rounds.setdefault(name, []).append(unanswered)
        row.api_full_rounds.setdefault(name, []).append(fleet.api_full_collections(started, ended))
        row.api_promoted_rounds.setdefault(name, []).append(fleet.api_promoted(started, ended))
        row.api_pause_phase_ms.setdefault(name, []).extend(fleet.api_pauses(started, ended))
        starts_by_run = {
            run_id: sorted(t["at"] for t in fleet.jsonl(f"{run_id}.tools.jsonl") if t["try"] == 1)
            for run_id in runs
        }
        window = all_running(list(starts_by_run.values()))
        if window is not None:
            wave_beats[(round_no, name)] = fleet.heartbeats(started, window[0])
            beats = fleet.heartbeats(*window)
            row.heartbeat_steady_ms.setdefault(name, []).extend(beats)
            round_beats[(round_no, name)] = beats
            row.api_window_s[name] = row.api_window_s.get(name, 0.0) + window[1] - window[0]
            kinds = row.api_requests.setdefault(name, {})
            for kind, server_ms in fleet.api_requests(*window):
                kinds[kind] = kinds.get(kind, 0) + 1
                if kind == "heartbeat":
                    row.heartbeat_server_ms.setdefault(name, []).append(server_ms)
            late, api_wait = fleet.bystander(*window)
            row.bystander_late_ms.setdefault(name, []).extend(late)
            row.bystander_late_max_rounds.setdefault(name, []).append(max(late, default=0.0))
            if api_wait is not None:
                row.api_cpu_wait_ms_per_s.setdefault(name, []).append(api_wait)
            row.api_pause_ms.setdefault(name, []).extend(fleet.api_pauses(*window))
            events = row.postgres_events.setdefault(name, {})
            for event, count in fleet.postgres_events(*window).items():
                events[event] = events.get(event, 0) + count
            sums = row.member_cpu.setdefault(name, {})
            for run_id in runs:
                for key, value in fleet.member_cpu(run_id, window).items():
                    sums[key] = sums.get(key, 0.0) + value
        steps = steps_while_all_run(list(starts_by_run.values()))
        step_ms.extend(steps)
        round_p50[(round_no, name)] = pct(steps, 0.5)
        requests_by_run = fleet.requests_by_run(runs) if dag_id == "fleet_durable" else {}
        for run_id in runs:
            if dag_id != "fleet_durable":
                continue
            calls = fleet.jsonl(f"{run_id}.try1.store.jsonl")
            row.store_ms.extend(c["ms"] for c in calls)
            row.set_ms.extend(c["ms"] for c in calls if c["op"] == "set")
            row.set_bytes.extend(c["bytes"] for c in calls if "bytes" in c)
            for call in calls:
                row.store_ops[call["op"]] = row.store_ops.get(call["op"], 0) + 1
            requests = len(requests_by_run[run_id])
            if requests:
                row.calls_per_step.append(len(calls) / requests)
        steps_by[name] = steps_by.get(name, 0) + sum(max(0, len(s) - 1) for s in starts_by_run.values())
    for name, taken in steps_by.items():
        if taken > 0:
            row.cpu_ms_per_step[name] = busy_by[name] * 1000 / taken
            row.cpu_ms_per_step_by_part[name] = {
                part: round(cpu_s * 1000 / taken, 1) for part, cpu_s in by_part.get(name, {}).items()
            }
    for round_no in range(rounds):
        durable, control = round_p50.get((round_no, "durable")), round_p50.get((round_no, "control"))
        if durable and control:
            row.step_ratio_rounds.append(round(durable / control, 2))
        for beats_by, pairs in (
            (round_beats, row.heartbeat_round_pairs),
            (phase_beats, row.phase_round_pairs),
            (wave_beats, row.wave_round_pairs),
        ):
            paired = beats_by.get((round_no, "durable")), beats_by.get((round_no, "control"))
            if paired[0] and paired[1]:
                pairs.append((paired[0], paired[1]))


def side_by_side(fleet: Fleet, row: Row, timeout: float, rounds: int) -> None:
    """Half the members durable, half plain, in one batch (``await_batch``): both halves step on
    the same cores in the same seconds, so a drift of the machine between the steady phases
    (which moved their ratio by up to 0.25 a round) falls on both alike. The API server and the
    database carry half a durable fleet's store calls. Per round: each half's steps and its
    supervisors' heartbeats while all members ran, and the ratios of their p50s and p95s; which
    half is triggered first alternates."""
    halves = [
        ("fleet_durable", "sidedur", row.side_durable_ms),
        ("fleet_control", "sidectl", row.side_control_ms),
    ]
    for round_no in range(rounds):
        batch = (uuid.uuid4().hex[:8], row.n)
        order = halves if round_no % 2 == 0 else halves[::-1]
        sizes = [row.n // 2, row.n - row.n // 2]
        runs = {
            dag_id: trigger(fleet, dag_id, size, phase, batch=batch)
            for (dag_id, phase, _), size in zip(order, sizes, strict=True)
        }
        for dag_id, members in runs.items():
            await_span_over(fleet, dag_id, members, timeout)
        for dag_id, members in runs.items():
            await_runs(fleet, dag_id, members, timeout)
        starts = {
            dag_id: [
                sorted(t["at"] for t in fleet.jsonl(f"{run_id}.tools.jsonl") if t["try"] == 1)
                for run_id in members
            ]
            for dag_id, members in runs.items()
        }
        window = all_running([s for by_run in starts.values() for s in by_run])
        p50s, p95s, sent = {}, {}, {}
        for dag_id, _, step_ms in halves:
            steps = steps_within(starts[dag_id], window)
            step_ms.extend(steps)
            p50s[dag_id] = pct(steps, 0.5)
            sent[dag_id] = fleet.heartbeats_sent(*window, fleet.supervisors(runs[dag_id])) if window else []
            beats = [ms for _, ms in sent[dag_id]]
            row.side_heartbeat_ms.setdefault(dag_id, []).extend(beats)
            p95s[dag_id] = pct(beats, 0.95)
        row.side_heartbeat_pairs.extend(matched_beats(sent["fleet_durable"], sent["fleet_control"]))
        for ratios, of in ((row.side_ratio_rounds, p50s), (row.side_heartbeat_ratio_rounds, p95s)):
            durable, control = of["fleet_durable"], of["fleet_control"]
            if durable and control:
                ratios.append(round(durable / control, 2))


#: How far apart (s) two heartbeats may be sent to be compared as taken at the same moment.
MATCH_S = 0.5


def matched_beats(
    durable: list[tuple[float, float]], plain: list[tuple[float, float]], within: float = MATCH_S
) -> list[tuple[float, float]]:
    """(durable ms, plain ms) for each durable heartbeat and the plain one sent nearest to it,
    at most ``within`` seconds apart (a plain one may be the nearest of several); both lists
    (sent, ms) in the order sent. A durable heartbeat with no plain one that near is left out."""
    times = [at for at, _ in plain]
    pairs = []
    for at, ms in durable:
        i = bisect.bisect(times, at)
        near = [plain[j] for j in (i - 1, i) if 0 <= j < len(plain) and abs(plain[j][0] - at) <= within]
        if near:
            pairs.append((ms, min(near, key=lambda beat: abs(beat[0] - at))[1]))
    return pairs


def steps_within(starts_by_run: list[list[float]], window: tuple[float, float] | None) -> list[float]:
    """Milliseconds of each step (one tool start to the next) inside ``window`` (``None``: all)."""
    every = [(a, b) for s in starts_by_run for a, b in itertools.pairwise(s)]
    inside = [(a, b) for a, b in every if window is None or (a >= window[0] and b <= window[1])]
    return [(b - a) * 1000 for a, b in inside]


def all_running(starts_by_run: list[list[float]]) -> tuple[float, float] | None:
    """The wall-time span in which every member ran (after the last member's first tool, before
    the first member's last), or ``None`` if they never all ran at once."""
    starts = [s for s in starts_by_run if s]
    if not starts:
        return None
    begin, end = max(s[0] for s in starts), min(s[-1] for s in starts)
    return (begin, end) if begin < end else None


def steps_while_all_run(starts_by_run: list[list[float]]) -> list[float]:
    """Milliseconds of each step (one tool start to the next) taken while every member was
    running: after the last member's first tool, before the first member's last. Outside that
    window a step shares the cores with other members' process starts (seconds of imports each),
    which is what the phase's wave of starts costs, not what a step costs. All steps if the
    window is empty (a fleet too small or too staggered to overlap)."""
    starts = [s for s in starts_by_run if s]
    return steps_within(starts, all_running(starts)) or steps_within(starts, None)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, with what each has reaped (the exited
    tasks and supervisors are in their parents' children times)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _busy_cpu_s() -> float:
    """CPU seconds the machine spent busy (all cores, all processes) since boot."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def evict_storm(fleet: Fleet, row: Row, timeout: float, load: int) -> None:
    """SIGTERM every member's supervisor at once; sample memory first."""
    runs = trigger(fleet, "fleet_storm", row.n, "evict")
    await_members(fleet, runs, timeout, streaming=True)
    members = {r: fleet.member(r) or {} for r in runs}
    samples = [memory([m["pid"], m["ppid"]]) for m in members.values()]
    row.memory["agent"] = [s for s in samples if s is not None]
    pids = [m["pid"] for m in members.values()]
    with api_load(fleet, load):
        sent = time.monotonic()
        all_at_once([functools.partial(os.kill, m["ppid"], signal.SIGTERM) for m in members.values()])
        gone = watch_exits(pids, GRACE_S + 5)
        await_runs(fleet, "fleet_storm", runs, timeout)
    unwound, decided, causes, sources, resumed, requests = [], [], [], [], 0, []
    requests_by_run = fleet.requests_by_run(runs)
    for run_id in runs:
        record = next(iter(fleet.records("fleet_storm", run_id, 1)), None)
        if record is not None:
            unwound.append(unwound_ms(record))
            decided.append(_event_ms(record, "cause_decided"))
            causes.append(f"{record['cause']}/{record['detail']}")
            sources.append(str(record.get("cause_source", "-")))
        try2 = sorted(
            (t for t in fleet.jsonl(f"{run_id}.tools.jsonl") if t["try"] == 2), key=lambda t: t["at"]
        )
        resumed += bool(try2 and try2[0]["n"] > 1)
        requests.append(len(requests_by_run[run_id]))
    row.evict = {
        "unwound_ms": [u for u in unwound if u is not None],
        "cause_decided_ms": [d for d in decided if d is not None],
        "causes": causes,
        "cause_sources": sources,
        "gone_before_sigkill": sum(1 for p in pids if p in gone and gone[p] - sent < GRACE_S),
        "resumed": resumed,
        "requests_both_tries": requests,
    }


def mark_failed_storm(fleet: Fleet, row: Row, timeout: float, load: int) -> None:
    """PATCH every member to failed at once (the UI's *Mark failed*)."""
    runs = trigger(fleet, "fleet_mark_failed", row.n, "markfailed")
    await_members(fleet, runs, timeout, streaming=True)
    members = {r: fleet.member(r) or {} for r in runs}
    token = fleet.rest._http.headers["Authorization"]
    answers: dict[str, int] = {}

    def patch(run_id: str) -> None:
        path = f"/api/v2/dags/fleet_mark_failed/dagRuns/{run_id}/taskInstances/{TASK_ID}"
        with httpx.Client(base_url=fleet.stack.url, headers={"Authorization": token}, timeout=60) as http:
            try:
                answers[run_id] = http.patch(path, json={"new_state": "failed"}).status_code
            except httpx.HTTPError:
                answers[run_id] = -1

    pids = [m["pid"] for m in members.values()]
    with api_load(fleet, load):
        started = all_at_once([functools.partial(patch, r) for r in runs])
        clicked = dict(zip(runs, started, strict=True))
        gone = watch_exits(pids, 30)
        await_runs(fleet, "fleet_mark_failed", runs, timeout)
    reached, exited, causes, decided, retried = [], [], [], [], 0
    patched = [r for r in runs if answers.get(r) == 200]  # a refused PATCH stopped nothing
    for run_id in patched:
        record = next(iter(fleet.records("fleet_mark_failed", run_id, 1)), None)
        if record is not None:
            reached.append((float(record["wall_origin"]) - clicked[run_id]) * 1000)
            causes.append(f"{record['cause']}/{record['detail']}")
            decided.append(_event_ms(record, "cause_decided"))
        ti = fleet.rest.json(
            "GET", f"/api/v2/dags/fleet_mark_failed/dagRuns/{run_id}/taskInstances/{TASK_ID}"
        )
        retried += ti["try_number"] != 1 or ti["state"] != "failed"
    wall_now, mono_now = time.time(), time.monotonic()
    for run_id in patched:
        member = members[run_id]
        if member["pid"] in gone:
            exited.append((wall_now - (mono_now - gone[member["pid"]]) - clicked[run_id]) * 1000)
    row.mark_failed = {
        "answers": sorted(answers.values()),
        "patched": len(patched),
        "kill_reached_ms": reached,
        "gone_ms": exited,
        "causes": causes,
        "cause_decided_ms": [d for d in decided if d is not None],
        "not_user": sum(1 for c in causes if not c.startswith("user/")) + (len(patched) - len(causes)),
        "retried": retried,
    }


def bare_memory(fleet: Fleet, row: Row, timeout: float) -> None:
    """RSS/PSS of N plain ``@task`` members (task + supervisor), sampled while they wait."""
    release = fleet.state_dir / "bare.release"
    release.unlink(missing_ok=True)
    runs = trigger(fleet, "fleet_bare", row.n, "bare")
    try:
        await_members(fleet, runs, timeout, streaming=False)
        members = [fleet.member(r) or {} for r in runs]
        samples = [memory([m["pid"], m["ppid"]]) for m in members]
        row.memory["bare"] = [s for s in samples if s is not None]
    finally:
        release.touch()
    await_runs(fleet, "fleet_bare", runs, timeout)


def _event_ms(record: dict[str, Any], name: str) -> float | None:
    return next((float(e["ms"]) for e in record["timeline"] if e["event"] == name), None)


def measure(
    fleet: Fleet,
    n: int,
    timeout: float,
    load: int,
    code: str = "this checkout",
    api_workers: int = 1,
    write_ahead: bool = True,
    rounds: int = 2,
    ui_poll: bool = False,
    side_rounds: int = 0,
    order_seed: int = 42,
) -> Row:
    """All phases at one N; a phase that fails is noted and the next one still runs."""
    row = Row(fleet.db, n, code, api_workers)
    phases: list[tuple[str, Callable[[], None]]] = [
        ("steady", lambda: steady(fleet, row, timeout, write_ahead, rounds, ui_poll, order_seed)),
        *([("side by side", lambda: side_by_side(fleet, row, timeout, side_rounds))] if side_rounds else []),
        ("eviction storm", lambda: evict_storm(fleet, row, timeout, load)),
        ("mark-failed storm", lambda: mark_failed_storm(fleet, row, timeout, load)),
        ("bare memory", lambda: bare_memory(fleet, row, timeout)),
    ]
    for name, phase in phases:
        started = time.monotonic()
        try:
            phase()
        except Exception as exc:
            row.errors.append(f"{name}: {exc!r}"[:2000])
        print(f"[fleet] {fleet.db} N={n}: {name} {time.monotonic() - started:.0f}s", flush=True)
    row.pool_timeouts = fleet.pool_timeouts()
    return row


# -- reporting -----------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mem(samples: list[Any], index: int) -> float | None:
    return pct([s[index] for s in samples], 0.5)


def summary(row: Row) -> dict[str, Any]:
    """The row's medians and counts, as the table and the plot show them."""
    ev, mf = row.evict, row.mark_failed
    durable, control = pct(row.step_durable_ms, 0.5), pct(row.step_control_ms, 0.5)
    return {
        "db": row.db,
        "n": row.n,
        "code": row.code,
        "api_workers": row.api_workers,
        "step_ratio": durable / control if durable and control else None,
        "set_p50_ms": pct(row.set_ms, 0.5),
        "set_p95_ms": pct(row.set_ms, 0.95),
        "set_max_ms": pct(row.set_ms, 1.0),
        "set_bytes_p50": pct([float(b) for b in row.set_bytes], 0.5),
        "heartbeat_p95_ms": {name: pct(ms, 0.95) for name, ms in row.heartbeat_ms.items()},
        "heartbeats": {name: len(ms) for name, ms in row.heartbeat_ms.items()},
        "heartbeat_steady_p95_ms": {name: pct(ms, 0.95) for name, ms in row.heartbeat_steady_ms.items()},
        "heartbeats_steady": {name: len(ms) for name, ms in row.heartbeat_steady_ms.items()},
        "step_ratio_rounds": row.step_ratio_rounds,
        "side_durable_p50_ms": pct(row.side_durable_ms, 0.5),
        "side_control_p50_ms": pct(row.side_control_ms, 0.5),
        "side_ratio_rounds": row.side_ratio_rounds,
        "side_heartbeat_p95_ms": {name: pct(ms, 0.95) for name, ms in row.side_heartbeat_ms.items()},
        "side_heartbeats": {name: len(ms) for name, ms in row.side_heartbeat_ms.items()},
        "side_heartbeat_ratio_rounds": row.side_heartbeat_ratio_rounds,
        "side_matched_heartbeat_p95_ms": [
            pct([pair[i] for pair in row.side_heartbeat_pairs], 0.95) for i in (0, 1)
        ],
        "side_matched_heartbeats": len(row.side_heartbeat_pairs),
        "api_per_s": {
            name: {kind: round(count / row.api_window_s[name], 2) for kind, count in kinds.items()}
            for name, kinds in row.api_requests.items()
            if row.api_window_s.get(name)
        },
        "heartbeat_server_p95_ms": {name: pct(ms, 0.95) for name, ms in row.heartbeat_server_ms.items()},
        "heartbeat_ratio_rounds": _round_pairs(row.heartbeat_round_pairs)["by_round"],
        "heartbeat_ratio_interval": ratio_interval(row.heartbeat_round_pairs),
        "bystander_late_p99_ms": {name: pct(ms, 0.99) for name, ms in row.bystander_late_ms.items()},
        "bystander_late_max_ms": {name: pct(ms, 1.0) for name, ms in row.bystander_late_ms.items()},
        "rounds_stalled": {
            name: f"{sum(ms >= STALL_MS for ms in maxes)}/{len(maxes)}"
            for name, maxes in row.bystander_late_max_rounds.items()
        },
        "api_cpu_wait_ms_per_s": {
            name: statistics.fmean(per_s) for name, per_s in row.api_cpu_wait_ms_per_s.items() if per_s
        },
        "api_pauses": {
            name: f"{len(ms)}, {sum(ms):.0f} ms (max {max(ms, default=0):.0f})"
            for name, ms in row.api_pause_ms.items()
        },
        "api_pauses_phase": {
            name: f"{len(ms)}, max {max(ms, default=0):.0f} ms" for name, ms in row.api_pause_phase_ms.items()
        },
        "heartbeats_unanswered": row.heartbeat_unanswered,
        "unanswered_rounds": row.unanswered_rounds,
        "api_full_rounds": row.api_full_rounds,
        "api_promoted_rounds": row.api_promoted_rounds,
        "phase_rounds": _round_pairs(row.phase_round_pairs),
        "wave_rounds": _round_pairs(row.wave_round_pairs),
        "postgres_events": row.postgres_events,
        "evict_eviction": sum(c.startswith("eviction/") for c in ev.get("causes", [])),
        "evict_sources": {s: ev.get("cause_sources", []).count(s) for s in set(ev.get("cause_sources", []))},
        "mf_user": sum(c.startswith("user/") for c in mf.get("causes", [])),
        "store_p50_ms": pct(row.store_ms, 0.5),
        "store_p95_ms": pct(row.store_ms, 0.95),
        "calls_per_step": statistics.fmean(row.calls_per_step) if row.calls_per_step else None,
        "step_durable_p50_ms": pct(row.step_durable_ms, 0.5),
        "step_control_p50_ms": pct(row.step_control_ms, 0.5),
        "step_write_ahead_p50_ms": pct(row.step_write_ahead_ms, 0.5),
        "cpu_ms_per_step": row.cpu_ms_per_step,
        "cpu_ms_per_step_by_part": row.cpu_ms_per_step_by_part,
        "member_cpu_ms": {name: member_cpu_ms(sums) for name, sums in row.member_cpu.items()},
        "evict_unwound_p50_ms": pct(ev.get("unwound_ms", []), 0.5),
        "evict_unwound_max_ms": pct(ev.get("unwound_ms", []), 1.0),
        "evict_cause_p50_ms": pct(ev.get("cause_decided_ms", []), 0.5),
        "evict_gone_before_sigkill": ev.get("gone_before_sigkill"),
        "evict_resumed": ev.get("resumed"),
        "evict_requests": sorted(set(ev.get("requests_both_tries", []))),
        "mf_reached_p50_ms": pct(mf.get("kill_reached_ms", []), 0.5),
        "mf_gone_p50_ms": pct(mf.get("gone_ms", []), 0.5),
        "mf_cause_p50_ms": pct(mf.get("cause_decided_ms", []), 0.5),
        "mf_cause_max_ms": pct(mf.get("cause_decided_ms", []), 1.0),
        "mf_not_user": mf.get("not_user"),
        "mf_retried": mf.get("retried"),
        "mf_answers": sorted(set(mf.get("answers", []))),
        "mf_patched": mf.get("patched"),
        "rss_agent_mib": _mem(row.memory.get("agent", []), 0),
        "pss_agent_mib": _mem(row.memory.get("agent", []), 1),
        "rss_bare_mib": _mem(row.memory.get("bare", []), 0),
        "pss_bare_mib": _mem(row.memory.get("bare", []), 1),
        "pool_timeouts": row.pool_timeouts,
        "errors": row.errors,
    }


def _round_pairs(pairs: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """Rounds of heartbeats durable beside control: their pooled p95s, each round's ratio of
    p95s and where the pooled ratio lies nine times in ten over redrawn rounds."""
    return {
        "p95_ms": [pct([ms for pair in pairs for ms in pair[i]], 0.95) for i in (0, 1)],
        "count": [sum(len(pair[i]) for pair in pairs) for i in (0, 1)],
        "by_round": [round((pct(d, 0.95) or 0.0) / (pct(c, 0.95) or 1.0), 2) for d, c in pairs],
        "interval": ratio_interval(pairs),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown table (all databases, all N)."""
    head = (
        "| db | N | store call p50/p95 ms | calls/step | step p50 durable / written ahead / control ms "
        "| machine CPU ms per step, same "
        "| evict: unwound p50/max ms | cause decided p50 ms | gone < SIGKILL | resumed | requests "
        "| mark failed: PATCH ok | → kill / → gone p50 ms | its cause decided p50/max ms "
        "| not user | retried | RSS/PSS per task MiB (bare) |"
    )
    lines = [head, "|" + "---|" * 17]
    for s in rows:
        n = s["n"]
        lines.append(
            f"| {s['db']} | {n} | {_fmt(s['store_p50_ms'], 1)} / {_fmt(s['store_p95_ms'], 1)} "
            f"| {_fmt(s['calls_per_step'], 2)} "
            f"| {_fmt(s['step_durable_p50_ms'])} / {_fmt(s.get('step_write_ahead_p50_ms'))} "
            f"/ {_fmt(s['step_control_p50_ms'])} "
            f"| {_cpu(s.get('cpu_ms_per_step') or {})} "
            f"| {_fmt(s['evict_unwound_p50_ms'])} / {_fmt(s['evict_unwound_max_ms'])} "
            f"| {_fmt(s['evict_cause_p50_ms'])} | {s['evict_gone_before_sigkill']}/{n} "
            f"| {s['evict_resumed']}/{n} "
            f"| {s['evict_requests']} | {s['mf_patched']}/{n} "
            f"| {_fmt(s['mf_reached_p50_ms'])} / {_fmt(s['mf_gone_p50_ms'])} "
            f"| {_fmt(s['mf_cause_p50_ms'], 1)} / {_fmt(s['mf_cause_max_ms'], 1)} "
            f"| {s['mf_not_user']} | {s['mf_retried']} "
            f"| {_fmt(s['rss_agent_mib'])}/{_fmt(s['pss_agent_mib'])} "
            f"({_fmt(s['rss_bare_mib'])}/{_fmt(s['pss_bare_mib'])}) |"
        )
    return "\n".join(lines)


def comparison(rows: list[dict[str, Any]]) -> str:
    """The issue's table (#42): one line per code and API server setup, side by side."""
    head = (
        "| code | db | API workers | N | step p50 durable / control ms (ratio; by round) "
        "| store calls per step | bytes per set p50 | set p50 / p95 / max ms "
        "| heartbeat p95 ms durable / control: while all ran (count; ratio by round; 90 % of "
        "runs redrawn from its rounds); whole phase "
        "| eviction: cause right (sources) | unwound max ms | resumed | mark failed: user, retried "
        "| RSS / PSS per task MiB (bare) | API server pool timeouts |"
    )
    lines = [head, "|" + "---|" * 15]
    for s in rows:
        n, beats = s["n"], s.get("heartbeat_p95_ms") or {}
        steady, counts = s.get("heartbeat_steady_p95_ms") or {}, s.get("heartbeats_steady") or {}
        by_round = ", ".join(f"{r:.2f}" for r in s.get("step_ratio_rounds") or [])
        beats_by_round = ", ".join(f"{r:.2f}" for r in s.get("heartbeat_ratio_rounds") or [])
        if interval := s.get("heartbeat_ratio_interval"):
            beats_by_round += f"; 90 % of redrawn runs {interval[0]:.2f}-{interval[1]:.2f}"
        sources = ", ".join(f"{k}: {v}" for k, v in sorted((s.get("evict_sources") or {}).items()))
        lines.append(
            f"| {s['code']} | {s['db']} | {s['api_workers']} | {n} "
            f"| {_fmt(s['step_durable_p50_ms'])} / {_fmt(s['step_control_p50_ms'])} "
            f"({_fmt(s.get('step_ratio'), 2)}; {by_round}) | {_fmt(s['calls_per_step'], 2)} "
            f"| {_fmt(s.get('set_bytes_p50'))} "
            f"| {_fmt(s.get('set_p50_ms'))} / {_fmt(s.get('set_p95_ms'))} / {_fmt(s.get('set_max_ms'))} "
            f"| {_fmt(steady.get('durable'))} / {_fmt(steady.get('control'))} "
            f"({counts.get('durable', 0)} / {counts.get('control', 0)}; {beats_by_round}); "
            f"{_fmt(beats.get('durable'))} / {_fmt(beats.get('control'))} "
            f"| {s.get('evict_eviction')}/{n} ({sources}) | {_fmt(s['evict_unwound_max_ms'])} "
            f"| {s['evict_resumed']}/{n} {s['evict_requests']} "
            f"| {s.get('mf_user')}/{s['mf_patched']}, {s['mf_retried']} "
            f"| {_fmt(s['rss_agent_mib'])} / {_fmt(s['pss_agent_mib'])} "
            f"({_fmt(s['rss_bare_mib'])} / {_fmt(s['pss_bare_mib'])}) | {s.get('pool_timeouts', '-')} |"
        )
    return "\n".join(lines)


def side_by_side_table(rows: list[dict[str, Any]]) -> str:
    """The step of each half of one fleet, durable beside plain in the same seconds
    (``--side-by-side``); empty where it was not run."""
    lines = [
        "| code | N | side by side: step p50 durable / plain ms (ratio; by round) "
        "| heartbeat p95 durable / plain ms (ratio; by round), heartbeats "
        f"| the same, each durable heartbeat beside the plain one sent nearest (within {MATCH_S} s), pairs |",
        "|---|---|---|---|---|",
    ]
    for s in rows:
        durable, control = s.get("side_durable_p50_ms"), s.get("side_control_p50_ms")
        if not durable or not control:
            continue
        beats, counts = s.get("side_heartbeat_p95_ms") or {}, s.get("side_heartbeats") or {}
        steps = _paired(durable, control, s.get("side_ratio_rounds"))
        by_round = s.get("side_heartbeat_ratio_rounds")
        p95s = _paired(beats.get("fleet_durable"), beats.get("fleet_control"), by_round)
        sent = f"{counts.get('fleet_durable', 0)} / {counts.get('fleet_control', 0)}"
        matched = s.get("side_matched_heartbeat_p95_ms") or [None, None]
        pairs = f"{_paired(matched[0], matched[1], None)}, {s.get('side_matched_heartbeats', 0)}"
        lines.append(f"| {s['code']} | {s['n']} | {steps} | {p95s}, {sent} | {pairs} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def waves_table(rows: list[dict[str, Any]]) -> str:
    """The heartbeats of the two fleets over their whole phases and over their waves of starts
    alone, round by round, with where the pooled ratio lies over redrawn rounds; and the rounds
    in which a heartbeat got no answer within Airflow's timeout: a stall of the API server hits
    a round's heartbeats together, so the rounds, not the heartbeats, are the samples."""
    lines = [
        "| code | N | rounds | heartbeat p95 durable / control ms, whole phase (ratio; by round), "
        "heartbeats; 90 % of redrawn runs | the same in the waves of starts alone "
        "| rounds with an unanswered heartbeat: durable, control "
        "| rounds with a full collection of the API server (its longest, ms): durable, control |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        cells = []
        for key in ("phase_rounds", "wave_rounds"):
            found = s.get(key) or {}
            p95, count = found.get("p95_ms") or [None, None], found.get("count") or [0, 0]
            interval = found.get("interval")
            spread = f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else "-"
            paired = _paired(p95[0], p95[1], found.get("by_round"))
            cells.append(f"{paired}, {count[0]} / {count[1]}; {spread}")
        unanswered = s.get("unanswered_rounds") or {}
        stalled = ", ".join(
            f"{sum(n > 0 for n in unanswered.get(name, []))}/{len(unanswered.get(name, []))}"
            for name in ("durable", "control")
        )
        full = s.get("api_full_rounds") or {}
        collected = ", ".join(
            f"{sum(bool(ms) for ms in full.get(name, []))}/{len(full.get(name, []))} "
            f"({max((max(ms) for ms in full.get(name, []) if ms), default=0):.0f})"
            for name in ("durable", "control")
        )
        rounds = len((s.get("phase_rounds") or {}).get("by_round") or [])
        cells += [stalled, collected]
        lines.append(f"| {s['code']} | {s['n']} | {rounds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def api_gc_table(rows: list[dict[str, Any]]) -> str:
    """The API server's garbage collector by steady-state variant, per round (mean): its young
    collections and the objects its oldest generation gained (its full collections are in
    ``waves_table``)."""
    lines = [
        "| code | N | variant | rounds | API server per round: gen-0 / gen-1 collections "
        "| oldest generation gained, objects |",
        "|---|---|---|---|---|---|",
    ]
    for s in rows:
        for name, rounds in (s.get("api_promoted_rounds") or {}).items():
            sampled = [r for r in rounds if r]
            if not sampled:
                continue
            mean = {k: statistics.fmean(r[k] for r in sampled) for k in ("gen0", "gen1", "gen2_gained")}
            lines.append(
                f"| {s['code']} | {s['n']} | {name} | {len(sampled)} "
                f"| {mean['gen0']:.0f} / {mean['gen1']:.1f} | {mean['gen2_gained']:+,.0f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def _paired(durable: float | None, control: float | None, by_round: list[float] | None) -> str:
    """``durable / control (ratio; by round)``, as the side-by-side table shows a pair."""
    if not durable or not control:
        return f"{_fmt(durable)} / {_fmt(control)}"
    rounds = "; " + ", ".join(f"{r:.2f}" for r in by_round) if by_round else ""
    return f"{_fmt(durable)} / {_fmt(control)} ({durable / control:.2f}{rounds})"


def cpu_parts(rows: list[dict[str, Any]]) -> str:
    """CPU ms per step by part of the stack, durable beside control: where the journal's cost
    lands on the shared cores."""
    lines = ["| code | N | part | CPU ms per step durable / control (difference) |", "|---|---|---|---|"]
    for s in rows:
        parts = s.get("cpu_ms_per_step_by_part") or {}
        durable, control = parts.get("durable") or {}, parts.get("control") or {}
        for part in durable:
            d, c = durable[part], control.get(part)
            diff = f"{d - c:+.1f}" if c is not None else "-"
            lines.append(f"| {s['code']} | {s['n']} | {part} | {d:.1f} / {_fmt(c, 1)} ({diff}) |")
    return "\n".join(lines)


#: What ``member_cpu_table`` shows of ``Fleet.member_cpu``'s sums: (label, seconds, divided by).
MEMBER_CPU = (
    ("task process, per step while all ran", "task", "steps"),
    ("its supervisor, per step while all ran", "supervisor", "steps"),
    ("task process, pre_execute to its first step", "task start", "members"),
    ("its supervisor, pre_execute to its first step", "supervisor start", "members"),
)


def member_cpu_ms(sums: dict[str, float]) -> dict[str, float]:
    """``Fleet.member_cpu``'s sums of one variant as milliseconds per step or per member."""
    return {label: sums[cpu] * 1000 / sums[per] for label, cpu, per in MEMBER_CPU if sums.get(per)}


def member_cpu_table(rows: list[dict[str, Any]]) -> str:
    """The members' own CPU, durable beside control, read in each member (its process and its
    supervisor): per step while all ran, which no wave of process starts blurs, and before the
    first step."""
    lines = ["| code | N | CPU of | ms durable / control (difference) |", "|---|---|---|---|"]
    for s in rows:
        by = s.get("member_cpu_ms") or {}
        durable, control = by.get("durable") or {}, by.get("control") or {}
        for label, d in durable.items():
            c = control.get(label)
            diff = f"{d - c:+.1f}" if c is not None else "-"
            lines.append(f"| {s['code']} | {s['n']} | {label} | {d:.1f} / {_fmt(c, 1)} ({diff}) |")
    return "\n".join(lines)


def api_requests_table(rows: list[dict[str, Any]]) -> str:
    """What the API server was asked while every member ran, durable beside control: requests a
    second by kind, and the heartbeats' p95 inside the server (without the supervisor's side)."""
    head = "| code | N | variant | requests/s: " + ", ".join(k for k, _ in API_KINDS) + ", other "
    lines = [head + "| heartbeat p95 in the server ms |", "|---|---|---|---|---|"]
    for s in rows:
        for name, per_s in (s.get("api_per_s") or {}).items():
            counts = ", ".join(_fmt(per_s.get(kind), 2) for kind in [*(k for k, _ in API_KINDS), "other"])
            server = _fmt((s.get("heartbeat_server_p95_ms") or {}).get(name))
            lines.append(f"| {s['code']} | {s['n']} | {name} | {counts} | {server} |")
    return "\n".join(lines)


def machine_table(rows: list[dict[str, Any]]) -> str:
    """Whether the machine itself stalled while every member ran, durable beside control: how
    late a bystander process woke from its 0.1 s sleeps, the rounds in which it once woke half a
    second late, how long the API server's threads waited for a core, its garbage collections
    of ``API_PAUSE_MS`` or more (each stops every request in flight), and what PostgreSQL
    logged; then, over the whole phases, the heartbeats that got no answer within Airflow's
    timeout and the API server's collections (one landing in a wave of 32 process starts
    took 9.8 s)."""
    events = ", ".join(name for name, _ in POSTGRES_EVENTS)
    head = "| code | N | variant | bystander woke late p99 / max ms | rounds with a stall "
    head += "| API server's threads waited for a core, ms a second "
    head += f"| API server's collections of {API_PAUSE_MS:.0f} ms or more: count, total "
    head += f"| PostgreSQL: {events} "
    head += "| over the whole phases: heartbeats with no answer within the timeout; the API server's "
    head += f"collections of {API_PAUSE_MS:.0f} ms or more: count, max |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        for name, p99 in (s.get("bystander_late_p99_ms") or {}).items():
            late = f"{_fmt(p99)} / {_fmt(s['bystander_late_max_ms'].get(name))}"
            wait = _fmt((s.get("api_cpu_wait_ms_per_s") or {}).get(name))
            logged = ", ".join(str(v) for v in (s.get("postgres_events") or {}).get(name, {}).values()) or "-"
            stalled = s["rounds_stalled"].get(name, "-")
            paused = (s.get("api_pauses") or {}).get(name, "-")
            unanswered = (s.get("heartbeats_unanswered") or {}).get(name, "-")
            phase = f"{unanswered}; {(s.get('api_pauses_phase') or {}).get(name, '-')}"
            lines.append(
                f"| {s['code']} | {s['n']} | {name} | {late} | {stalled} | {wait} | {paused} | {logged} "
                f"| {phase} |"
            )
    return "\n".join(lines)


def _cpu(per_step: dict[str, float]) -> str:
    return " / ".join(_fmt(per_step.get(name)) for name in ("durable", "ahead", "control"))


PLOTTED = (
    ("store_p50_ms", "journal store call p50 (ms)"),
    ("calls_per_step", "store calls per step"),
    ("step_durable_p50_ms", "step p50 durable (ms)"),
    ("step_write_ahead_p50_ms", "step p50 durable, written ahead (ms)"),
    ("step_control_p50_ms", "step p50 control (ms)"),
    ("evict_unwound_max_ms", "eviction storm: unwound max (ms)"),
    ("mf_reached_p50_ms", "mark failed → kill reached p50 (ms)"),
    ("pss_agent_mib", "PSS per agent task (MiB)"),
    ("pss_bare_mib", "PSS per bare @task (MiB)"),
)


def _series(row: dict[str, Any]) -> str:
    return f"{row['db']}, {row['code']}, {row['api_workers']} API worker(s)"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Each metric against N, one line per database (matplotlib, the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    for ax, (key, title) in zip(axes.flat, PLOTTED, strict=True):
        for label in sorted({_series(r) for r in rows}):
            points = [(r["n"], r[key]) for r in rows if _series(r) == label and r[key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("N concurrent durable agents", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1,4,8,16", help="fleet sizes, ascending (default 1,4,8,16)")
    parser.add_argument("--db", default="sqlite,postgres", help="metadata databases (default both)")
    parser.add_argument("--api-load", type=int, default=0, help="REST reader threads during the storms")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a phase may wait for its runs")
    parser.add_argument("--api-workers", default="1", help="API server workers, each a setup (default 1)")
    parser.add_argument("--before", metavar="REV", help="also run the provider as of git revision REV, first")
    parser.add_argument(
        "--no-write-ahead", action="store_true", help="leave out the written-ahead steady variant"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="steady-state rounds, each in a random order (default 2)"
    )
    parser.add_argument(
        "--order-seed",
        type=int,
        default=42,
        metavar="S",
        help="the seed each steady round's order of variants is drawn with (default 42)",
    )
    parser.add_argument(
        "--side-by-side",
        type=int,
        default=0,
        metavar="K",
        help="K more rounds of one fleet, half durable and half plain at once (default 0)",
    )
    parser.add_argument(
        "--ui-poll",
        action="store_true",
        help="list the runs every 3 s (the UI grid's rate) also while all members run",
    )
    parser.add_argument(
        "--batch-window",
        metavar="S[,S...]",
        help="run this checkout once per value of [cancellable_agents] durable_batch_window",
    )
    parser.add_argument(
        "--api-gc-freeze",
        type=float,
        metavar="S",
        help="S seconds after it starts, the API server moves what it holds to gc's permanent "
        "generation (gc.freeze): its full collections then walk only what came later",
    )
    parser.add_argument(
        "--db-pool",
        type=int,
        metavar="K",
        help="every component's [database] sql_alchemy_pool_size and max_overflow (default: Airflow's 5, 10)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.n.split(",")]
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    loads: list[tuple[float, float, float]] = []
    with contextlib.ExitStack() as exports:
        now = exports.enter_context(source_now())
        codes: list[tuple[str, Path | None, dict[str, str]]] = [("this checkout", now, {})]
        if args.batch_window:
            codes = [
                (f"this checkout, window {w}", now, {"durable_batch_window": w})
                for w in args.batch_window.split(",")
            ]
        if args.before:  # with the first window asked for, so that only the code differs
            before = exports.enter_context(source_as_of(args.before))
            window = codes[0][2]
            suffix = f", window {window['durable_batch_window']}" if window else ""
            codes.insert(0, (f"before ({args.before}){suffix}", before, window))
        if args.db_pool:
            codes = [(f"{label}, DB pool {args.db_pool}+{args.db_pool}", c, st) for label, c, st in codes]
        if args.api_gc_freeze is not None:  # read by fleet_site/sitecustomize.py in the API server
            os.environ["FLEET_API_GC_FREEZE"] = str(args.api_gc_freeze)
            codes = [(f"{label}, API server gc.freeze", c, st) for label, c, st in codes]
        for db in args.db.split(","):
            if db == "postgres" and postgres_missing() is not None:
                print(f"[fleet] postgres skipped: {postgres_missing()}")
                continue
            for workers in [int(w) for w in args.api_workers.split(",")]:
                for label, code, settings in codes:
                    print(f"[fleet] {db}, {workers} API worker(s), {label}", flush=True)
                    parallelism = max(32, 2 * max(sizes))
                    with fleet_stack(db, parallelism, workers, code, settings, args.db_pool) as fleet:
                        for n in sizes:
                            row = measure(
                                fleet,
                                n,
                                args.timeout,
                                args.api_load,
                                label,
                                workers,
                                not args.no_write_ahead,
                                args.rounds,
                                args.ui_poll,
                                args.side_by_side,
                                args.order_seed,
                            )
                            rows.append(summary(row))
                            raw.append(row.__dict__)
                            loads.append(os.getloadavg())
                            print(comparison(rows[-1:]), flush=True)
                            print(side_by_side_table(rows[-1:]), flush=True)
                            print(waves_table(rows[-1:]), flush=True)
                            print(api_gc_table(rows[-1:]), flush=True)
                            print(cpu_parts(rows[-1:]), flush=True)
                            print(member_cpu_table(rows[-1:]), flush=True)
                            print(api_requests_table(rows[-1:]), flush=True)
                            print(machine_table(rows[-1:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    meta = {
        "cpus": os.cpu_count(),
        "loadavg": load,
        "loadavg_per_row": loads,
        "api_load": args.api_load,
        "sizes": sizes,
        "before": args.before,
        "db_pool": args.db_pool,
        "ui_poll": args.ui_poll,
    }
    (args.out / "fleet.json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    print(f"\nload average at the end: {load[0]:.1f} on {os.cpu_count()} cores\n")
    print(table(rows))
    print()
    print(comparison(rows))
    print()
    print(side_by_side_table(rows))
    print()
    print(waves_table(rows))
    print()
    print(api_gc_table(rows))
    print()
    print(cpu_parts(rows))
    print()
    print(member_cpu_table(rows))
    print()
    print(api_requests_table(rows))
    print()
    print(machine_table(rows))
    for s in rows:
        for error in s["errors"]:
            print(f"[fleet] {s['db']} N={s['n']}: {error}")
    drawn = plot(rows, args.out / "fleet.png")
    print(f"\nwrote {args.out / 'fleet.json'}" + (f" and {drawn}" if drawn else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
