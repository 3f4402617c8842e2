"""Fixtures for real-process tests: a migrated AIRFLOW_HOME, the local model server, and the
process trees a test starts (a per-test ``marker``, sandboxes, child task processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from cancellable_agents.toolsets.sandbox import LocalSandbox
from tests.airflow_env import airflow_env, migrate
from tests.process.harness import DAGS_FOLDER, TaskProcess
from tests.process.trees import MODES, ChildTask, new_marker, survivors
from tests.process.zygote import ScenarioZygote
from tests.taskproc import with_root_on_path


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("airflow_home")
    migrate(airflow_env(home), timeout=120)
    return home


@pytest.fixture(scope="session")
def _model_server_session() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def model_server(_model_server_session: ScriptedModelServer) -> ScriptedModelServer:
    """The session's local model server with the previous test's records cleared."""
    _model_server_session.reset()
    return _model_server_session


def scenario_env(
    airflow_home: Path, base_url: str, overrides: dict[str, str] | None = None
) -> dict[str, str]:
    """A ``task_scenarios.py`` child's environment: the session's Airflow, the local model server."""
    conn = {"conn_type": "cancellable_agents_model", "host": base_url}
    overrides = {"AIRFLOW_CONN_LOCAL_MODEL": json.dumps(conn), **(overrides or {})}
    return airflow_env(airflow_home, overrides, pythonpath=Path(__file__).parents[2])


@pytest.fixture(scope="session")
def scenario_zygote(
    airflow_home: Path, _model_server_session: ScriptedModelServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScenarioZygote]:
    """The fork server the session's ``task_scenarios.py`` children start from (imports paid once)."""
    env = with_root_on_path(scenario_env(airflow_home, _model_server_session.base_url))
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS_FOLDER)
    zygote = ScenarioZygote(env, tmp_path_factory.mktemp("zygote") / "zygote.log")
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture
def spawn_task(
    airflow_home: Path, model_server: ScriptedModelServer, tmp_path: Path, scenario_zygote: ScenarioZygote
) -> Iterator[object]:
    """Start ``task_scenarios.py SCENARIO`` with a connection to the local model server."""
    started: list[TaskProcess] = []
    env = scenario_env(airflow_home, model_server.base_url)

    def spawn(scenario: str) -> TaskProcess:
        task = TaskProcess(scenario, env, tmp_path, zygote=scenario_zygote)
        started.append(task)
        return task

    yield spawn
    for task in started:
        task.close(timeout=0)  # a test that is done with its task: SIGKILL what still runs


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique ``sleep`` duration; whatever still carries it after the test is SIGKILLed by pid."""
    value = new_marker()
    yield value
    for pid in survivors(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=MODES)
def sandbox(request: pytest.FixtureRequest) -> Iterator[LocalSandbox]:
    """A :class:`LocalSandbox` in each isolation mode, destroyed after the test."""
    box = LocalSandbox(isolation=request.param, stop_grace=0.5)
    yield box
    box.destroy()


@pytest.fixture
def child_tasks() -> Iterator[Callable[..., ChildTask]]:
    """Start ``_sandbox_task.py MODE MARKER`` task processes; each is SIGKILLed if still running."""
    started: list[ChildTask] = []

    def start(mode: str, marker: str, *extra: str) -> ChildTask:
        task = ChildTask(mode, marker, *extra)
        started.append(task)
        return task

    yield start
    for task in started:
        task.close()
