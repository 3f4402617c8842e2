"""Fixtures for real-process tests: a migrated AIRFLOW_HOME and the local model server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.process.harness import TaskProcess


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("airflow_home")
    env = {**os.environ, **_airflow_env(home)}
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return home


def _airflow_env(home: Path) -> dict[str, str]:
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }


@pytest.fixture(scope="session")
def _model_server_session() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer() as server:
        yield server


@pytest.fixture
def model_server(_model_server_session: ScriptedModelServer) -> ScriptedModelServer:
    """The session's local model server with the previous test's records cleared."""
    _model_server_session.reset()
    return _model_server_session


@pytest.fixture
def spawn_task(airflow_home: Path, model_server: ScriptedModelServer, tmp_path: Path) -> Iterator[object]:
    """Start ``task_scenarios.py SCENARIO`` with a connection to the local model server."""
    started: list[TaskProcess] = []
    conn = {"conn_type": "cancellable_agents_model", "host": model_server.base_url}
    env = {
        **os.environ,
        **_airflow_env(airflow_home),
        "AIRFLOW_CONN_LOCAL_MODEL": json.dumps(conn),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }

    def spawn(scenario: str) -> TaskProcess:
        task = TaskProcess(scenario, env, tmp_path)
        started.append(task)
        return task

    yield spawn
    for task in started:
        task.close()
