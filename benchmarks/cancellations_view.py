"""Does the Cancellations view slow the API server's other pages? One real Airflow 3.3
(``tests/e2e/airflow_stack.py``, PostgreSQL, one api-server worker) with 10,000 stored records.

Records are the real stored document of a real kill (``tests/unit/test_cancellations_view.py``'s
shape, ~2 KB each), inserted straight into ``task_state_store`` under ten DAG runs (1,000 each:
100 task ids x 10 tries), as ten days of kills. Then, for each phase, ``--reps`` sequential GETs of
each of Airflow's own pages (the DAG list, a DAG's runs, the grid, the state store of one task
instance) are timed:

1. **0 records**, the plugin idle (baseline);
2. **10,000 records**, the plugin idle;
3. **10,000 records**, while another client loads the fleet page in a loop (the worst case:
   each fleet page parses its 1,000-record window on the one api-server worker).

Plus the plugin's own pages' latency (fleet, fleet filtered by DAG, one task instance).
``python -m benchmarks.cancellations_view [--reps 40]``; writes
``benchmarks/results/cancellations_view.json``. Not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from tests.airflow_env import airflow_env
from tests.e2e.airflow_stack import AirflowStack, wait_until
from tests.e2e.postgres import PostgresCluster

from benchmarks.report import write_json
from cancellable_agents.airflow.kill_record._stored import key_for_try, stored_document

DAGS_FOLDER = Path(__file__).with_name("view_dags")
DAGS = [f"view_bench_{i}" for i in range(10)]
RESULTS = Path(__file__).with_name("results") / "cancellations_view.json"


def _record(i: int) -> dict[str, Any]:
    """A record of the shape a sandbox kill writes (cause, timeline, kills, usage)."""
    return {
        "cause": ("user", "eviction", "timeout")[i % 3],
        "detail": "marked failed",
        "outcome": "cancelled",
        "retry": "retrying",
        "root_cause": "user",
        "scope": "agent",
        "budget_s": 4.0,
        "timeline": [
            {"event": "run_started", "ms": -422.1},
            {"event": "kill_received", "ms": 0.0, "cause": "deciding", "fallback": "unknown"},
            {"event": "token_cancelled", "ms": 3.1},
            {"event": "released", "ms": 8.2, "resource": "in-flight tools", "took_ms": 4.9},
            {"event": "cause_decided", "ms": 31.0, "cause": "user", "detail": "marked failed"},
            {"event": "killed", "ms": 31.4, "pid": 11688 + i, "command": "sleep 600", "signal": 15},
            {"event": "released", "ms": 32.1 + i % 50, "resource": "sandbox commands", "took_ms": 28.7},
            {"event": "released", "ms": 60.0 + i % 90, "resource": "sandbox teardown", "took_ms": 20.0},
            {"event": "resources_released", "ms": 61.0 + i % 90},
        ],
        "killed": [
            {"source": "sandbox", "pid": 11688 + i, "command": "sleep 600 && curl example", "signal": 15}
        ],
        "stragglers": [],
        "usage": {"requests": 3, "input_tokens": 610, "output_tokens": 20, "tool_calls": 2},
        "messages": 6,
    }


@contextlib.contextmanager
def _stack() -> Iterator[tuple[AirflowStack, str]]:
    with tempfile.TemporaryDirectory(prefix="view-bench-") as tmp, PostgresCluster() as postgres:
        home = Path(tmp) / "airflow_home"
        env = airflow_env(home, {}, dags_folder=DAGS_FOLDER)
        stack = AirflowStack(home, DAGS_FOLDER, env, database_url=postgres.sqlalchemy_url)
        stack.migrate()
        try:
            stack.start()
            stack.wait_healthy()
            yield stack, postgres.sqlalchemy_url
        finally:
            stack.stop()


def _runs(stack: AirflowStack) -> dict[str, str]:
    """One run per DAG: ``dag_id -> run_id``."""
    rest = stack.client()
    wait_until(
        lambda: (
            set(DAGS)
            <= {d["dag_id"] for d in rest.json("GET", "/api/v2/dags", params={"limit": 100})["dags"]}
        ),
        120,
        "the DAGs to parse",
    )
    run_ids = {}
    for dag_id in DAGS:
        body = rest.json("POST", f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None})
        run_ids[dag_id] = body["dag_run_id"]
    rest.close()
    return run_ids


def _insert(url: str, run_ids: dict[str, str], per_run: int = 1000) -> int:
    engine = sa.create_engine(url)
    now = time.time()
    rows = []
    with engine.begin() as conn:
        for d, (dag_id, run_id) in enumerate(run_ids.items()):
            dag_run_pk = conn.execute(
                sa.text("SELECT id FROM dag_run WHERE dag_id = :d AND run_id = :r"),
                {"d": dag_id, "r": run_id},
            ).scalar_one()
            for j in range(per_run):
                task, try_number = f"agent_{j // 10}", j % 10 + 1
                at = now - (d * per_run + j) * 86.4  # ten days of kills
                document = stored_document(_record(j), try_number, now=at)
                rows.append(
                    {
                        "dag_run_id": dag_run_pk,
                        "task_id": task,
                        "map_index": -1,
                        "key": key_for_try(try_number),
                        "dag_id": dag_id,
                        "run_id": run_id,
                        "value": json.dumps(document),
                        "updated_at": datetime.fromtimestamp(at, UTC),
                    }
                )
        table = sa.table(
            "task_state_store",
            *(
                sa.column(c)
                for c in ("dag_run_id", "task_id", "map_index", "key", "dag_id", "run_id", "value")
            ),
            sa.column("updated_at"),
        )
        for start in range(0, len(rows), 1000):
            conn.execute(sa.insert(table), rows[start : start + 1000])
    engine.dispose()
    return len(rows)


def _time(client: httpx.Client, path: str, reps: int) -> dict[str, float]:
    took = []
    for _ in range(reps):
        started = time.perf_counter()
        response = client.get(path)
        took.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
    took.sort()
    return {"p50_ms": statistics.median(took), "p99_ms": took[min(len(took) - 1, int(len(took) * 0.99))]}


def _pages(run_ids: dict[str, str]) -> dict[str, str]:
    dag_id, run_id = next(iter(run_ids.items()))
    return {
        "dag list": "/api/v2/dags?limit=50",
        "a DAG's runs": f"/api/v2/dags/{dag_id}/dagRuns?limit=50",
        "grid": f"/ui/grid/runs/{dag_id}?limit=25",
        "one TI's state store": f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/noop/state-store",
    }


def _phase(client: httpx.Client, pages: dict[str, str], reps: int) -> dict[str, dict[str, float]]:
    return {name: _time(client, path, reps) for name, path in pages.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, Any] = {"load_before": os.getloadavg()}
    with _stack() as (stack, url):
        run_ids = _runs(stack)
        token = httpx.post(
            f"{stack.url}/auth/token", json={"username": "admin", "password": stack.password}, timeout=30
        ).json()["access_token"]
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        pages = _pages(run_ids)
        results["baseline (0 records)"] = _phase(client, pages, args.reps)
        started = time.monotonic()
        results["records"] = _insert(url, run_ids)
        results["insert_s"] = time.monotonic() - started
        results["10k records, view idle"] = _phase(client, pages, args.reps)
        dag_id, run_id = next(iter(run_ids.items()))
        view = {
            "fleet page": "/cancellations/fleet",
            "fleet page, one DAG": f"/cancellations/fleet?dag_id={DAGS[3]}",
            "fleet page, page 20": "/cancellations/fleet?page=20",
            "one task instance": f"/cancellations/ti?dag_id={dag_id}&run_id={run_id}&task_id=agent_5",
        }
        results["the view's own pages"] = _phase(client, view, max(5, args.reps // 4))
        stop = threading.Event()

        def hammer() -> None:
            with httpx.Client(base_url=stack.url, headers=client.headers, timeout=60) as other:
                while not stop.is_set():
                    other.get("/cancellations/fleet")

        loader = threading.Thread(target=hammer, daemon=True)
        loader.start()
        try:
            results["10k records, fleet page loaded in a loop"] = _phase(client, pages, args.reps)
        finally:
            stop.set()
            loader.join(60)
        client.close()
    results["load_after"] = os.getloadavg()
    write_json(RESULTS, results)
    print(_table(results))


def _table(results: dict[str, Any]) -> str:
    phases = [k for k, v in results.items() if isinstance(v, dict)]
    lines = ["| phase | page | p50 | p99 |", "|---|---|---|---|"]
    for phase in phases:
        for page, took in results[phase].items():
            lines.append(f"| {phase} | {page} | {took['p50_ms']:.1f} ms | {took['p99_ms']:.1f} ms |")
    lines.append(
        f"\nrecords: {results['records']}; "
        f"load before {results['load_before']}, after {results['load_after']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
