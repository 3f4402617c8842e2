"""Session fixtures for the end-to-end tests: the local model server and a real Airflow 3.

One Airflow per test session (a fresh ``AIRFLOW_HOME`` in a tmp dir, its metadata database on a
throwaway PostgreSQL, ``airflow db migrate``, api-server + scheduler + dag-processor + triggerer
on 127.0.0.1). Its DAGs folder is ``tests/e2e/dags``. The tasks reach the in-process model server
through ``AIRFLOW_CONN_LOCAL_MODEL`` and report their pids and callbacks into ``E2E_STATE_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.e2e.airflow_stack import AirflowStack, RestClient, wait_until
from tests.e2e.browser import Chromium, chromium_binary
from tests.e2e.driver import PATHS, PathResult, drive
from tests.e2e.pod_executor import POD_EXECUTOR_CONFIG
from tests.e2e.postgres import PostgresCluster
from tests.e2e.postgres import missing_reason as postgres_missing
from tests.e2e.procs import kill_marked, marked_processes
from tests.statsd_receiver import StatsdReceiver

DAGS_FOLDER = Path(__file__).with_name("dags")
LOCAL_AND_POD_EXECUTORS = f"LocalExecutor,{POD_EXECUTOR_CONFIG}"
E2E_DAG_IDS = (
    "e2e_mark_failed",
    "e2e_clear",
    "e2e_eviction",
    "e2e_timeout",
    "e2e_evict_in_comms",
    "e2e_durable",
    "e2e_approval",
    "e2e_approval_timeout",
    "e2e_deferred",
    "e2e_deferred_timeout",
    "e2e_deferred_timeout_fail",
    "e2e_deferred_evict",
)


@dataclass
class E2EEnv:
    """What the tests need to drive and observe the running Airflow."""

    stack: AirflowStack
    rest: RestClient
    model_server: ScriptedModelServer
    state_dir: Path
    marker: str
    ready_s: float


@pytest.fixture(scope="session")
def statsd() -> Iterator[StatsdReceiver]:
    """The session's statsd receiver: every task of the ``e2e`` stack sends its metrics here
    (``[metrics] statsd_on``); only the provider's lines are kept."""
    receiver = StatsdReceiver(keep="cancellable_agents.")
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def e2e(tmp_path_factory: pytest.TempPathFactory, statsd: StatsdReceiver) -> Iterator[E2EEnv]:
    """Start the model server and Airflow; stop both (and anything marked) at the end."""
    # The connection form's *Test* button (POST /api/v2/connections/test).
    # The PodExecutor beside the LocalExecutor: tests/e2e/test_pods.py's KubernetesExecutor pods.
    extra = {"AIRFLOW__CORE__TEST_CONNECTION": "Enabled", "AIRFLOW__CORE__EXECUTOR": LOCAL_AND_POD_EXECUTORS}
    extra.update(statsd.airflow_env())  # [metrics] statsd_on: the tasks' metrics reach the test
    if (missing := postgres_missing()) is not None:
        pytest.fail(f"the e2e Airflow's metadata database is PostgreSQL: {missing}")
    # Three components and every task's supervisor write at once, as in production: on SQLite
    # a UI click's audit-log commit met a task's write and the api-server answered 500 after its
    # 5 s lock wait (ci, the approvals UI test).
    with e2e_world(tmp_path_factory, "airflow_home", extra) as world, PostgresCluster() as postgres:
        stack = AirflowStack(
            world.home, DAGS_FOLDER, world.env, database_url=postgres.sqlalchemy_url, triggerer=True
        )
        started = time.monotonic()
        stack.migrate()
        migrated = time.monotonic()
        with stopped_after(stack, world.marker):
            stack.start()
            stack.wait_healthy()
            ready = time.monotonic()
            rest = stack.client()
            _await_dags(stack, rest)
            print(
                f"\n[e2e] AIRFLOW_HOME={world.home}\n[e2e] db migrate {migrated - started:.1f}s, "
                f"components healthy {ready - migrated:.1f}s, DAGs parsed {time.monotonic() - ready:.1f}s"
            )
            yield E2EEnv(stack, rest, world.model_server, world.state_dir, world.marker, ready - migrated)
            rest.close()


@dataclass
class E2EWorld:
    """What every e2e stack gets: a fresh AIRFLOW_HOME, a state dir the tasks report into, a
    process marker, the local model server, and the environment that points the tasks at them."""

    home: Path
    state_dir: Path
    marker: str
    model_server: ScriptedModelServer
    env: dict[str, str]


@contextlib.contextmanager
def e2e_world(
    tmp_path_factory: pytest.TempPathFactory, name: str, extra_env: dict[str, str] | None = None
) -> Iterator[E2EWorld]:
    home = tmp_path_factory.mktemp(name)
    state_dir = home / "e2e_state"
    state_dir.mkdir()
    marker = f"cancellable-agents-e2e-{uuid.uuid4().hex[:10]}"
    with ScriptedModelServer() as model_server:
        conn = {"conn_type": "cancellable_agents_model", "host": model_server.base_url}
        env = {
            "AIRFLOW_CONN_LOCAL_MODEL": json.dumps(conn),
            "E2E_STATE_DIR": str(state_dir),
            "E2E_MARKER": marker,
            **(extra_env or {}),
        }
        yield E2EWorld(home, state_dir, marker, model_server, env)


@contextlib.contextmanager
def stopped_after(stack: AirflowStack, marker: str) -> Iterator[None]:
    """Stop ``stack`` however the block ends; then nothing carrying ``marker`` may be left."""
    try:
        yield
    finally:
        stack.remember_processes()
        stack.stop()
        # The sandboxed trees run in their own sessions; anything left carries our marker.
        kill_marked(marker)
        leftovers = marked_processes(marker)
        assert not leftovers, f"processes with marker {marker} survived: {leftovers}"


@dataclass
class KilledRuns:
    """Every kill path, driven once per session (in parallel DAG runs)."""

    results: dict[str, PathResult]
    took_s: float


@pytest.fixture(scope="session")
def killed_runs(e2e: E2EEnv) -> KilledRuns:
    """Drive all kill paths at once; the tests of ``test_kill_paths`` and ``test_ui_log`` judge them."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(PATHS), thread_name_prefix="e2e-path") as pool:
        futures = {name: pool.submit(drive, e2e, path) for name, path in PATHS.items()}
        results = {name: future.result() for name, future in futures.items()}
    return KilledRuns(results, time.monotonic() - started)


def _await_dags(
    stack: AirflowStack, rest: RestClient, timeout: float = 90, dag_ids: tuple[str, ...] = E2E_DAG_IDS
) -> None:
    """Wait until the dag-processor has serialized ``dag_ids`` (they are unpaused at creation)."""

    def parsed() -> bool:
        stack.check_alive()
        body = rest.json("GET", "/api/v2/dags", params={"dag_id_pattern": "e2e_", "limit": 100})
        return set(dag_ids) <= {d["dag_id"] for d in body["dags"]}

    wait_until(
        parsed, timeout, "the dag-processor to parse tests/e2e/dags", interval=0.25, on_timeout=stack.logs
    )


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """Headless Chromium (the Debian package) for a module's UI tests; skipped, saying so, where
    it is not installed."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (`make system-deps` installs the Debian package)")
    browser = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()
