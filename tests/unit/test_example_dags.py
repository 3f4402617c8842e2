"""The example DAGs parse, run with the keyless model, and the kill-me DAG stops as it says.

Parsing happens in-process with Airflow's ``DagBag``. Runs happen in a child process (this file
run as a script) with its own migrated ``AIRFLOW_HOME``, through ``dag.test()``, which executes
tasks with the Task SDK's real SIGTERM handler, so the kill test signals the child exactly as
Airflow's supervisor signals a task.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.airflow._adapter import has_task_state_store
from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX, parse_records
from tests.airflow_env import airflow_env as throwaway_airflow_env
from tests.airflow_env import migrate
from tests.airflow_versions import has_retry_policies
from tests.process.zygote import ScenarioZygote

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DAGS = ROOT / "example_dags"
RESULT_PREFIX = "EXAMPLE_DAG_RESULT "

EXPECTED_DAGS = {
    "example_cancellable_llm",
    "example_cancellable_agent_sandbox",
    "example_cancellable_subagents",
    "example_cancellable_kill_me",
    "example_cancellable_deferred",
}
#: Needs Airflow 3.3 (``durable=True`` in the task state store, a trigger's ``on_kill``): below,
#: it is refused when parsed, naming the fix.
NEEDS_3_3 = {"example_deferred.py": "example_cancellable_deferred"}


# -- parsing ----------------------------------------------------------------------------------


def _dag_bag() -> Any:
    """The example DAGs in Airflow's ``DagBag`` (``airflow.dag_processing.dagbag`` from 3.2,
    ``airflow.models.dagbag`` on 3.1). Before 3.3 it also loads Airflow's own example DAGs
    unless told not to."""
    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:
        from airflow.models.dagbag import DagBag
    kwargs: dict[str, Any] = {}
    if "include_examples" in inspect.signature(DagBag).parameters:
        kwargs["include_examples"] = False
    return DagBag(dag_folder=str(EXAMPLE_DAGS), **kwargs)


def _parse(monkeypatch: pytest.MonkeyPatch, conn: str | None) -> Any:
    if conn is None:
        monkeypatch.delenv("CANCELLABLE_AGENTS_CONN", raising=False)
    else:
        monkeypatch.setenv("CANCELLABLE_AGENTS_CONN", conn)
    return _dag_bag()


def _model_tasks(bag: Any) -> list[Any]:
    from cancellable_agents import LLMOperator

    return [t for dag in bag.dags.values() for t in dag.tasks if isinstance(t, LLMOperator)]


def test_every_example_dag_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    bag = _parse(monkeypatch, conn=None)
    if has_task_state_store():
        assert bag.import_errors == {}
        assert set(bag.dag_ids) == EXPECTED_DAGS
    else:
        refused = {Path(path).name: error for path, error in bag.import_errors.items()}
        assert set(refused) == set(NEEDS_3_3), refused
        assert all("needs Airflow 3.3" in error for error in refused.values()), refused
        assert set(bag.dag_ids) == EXPECTED_DAGS - set(NEEDS_3_3.values())
    assert all(sorted(dag.tags) == ["cancellable-agents", "example"] for dag in bag.dags.values())


def test_examples_are_keyless_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without configuration every model task uses the keyless test model and no connection."""
    tasks = _model_tasks(_parse(monkeypatch, conn=None))
    assert len(tasks) >= 8
    assert {(t.llm_conn_id, t.model) for t in tasks} == {(None, "test")}


def test_a_connection_switches_every_example_to_a_real_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting ``CANCELLABLE_AGENTS_CONN`` is the only change needed: the model comes from it."""
    tasks = _model_tasks(_parse(monkeypatch, conn="my_llm"))
    assert {(t.llm_conn_id, t.model) for t in tasks} == {("my_llm", None)}


def test_example_loggers_have_readable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow imports DAG files as ``unusual_prefix_<sha>_<file>``: a ``getLogger(__name__)``
    logger shows up in the task log under that name."""
    import logging

    _parse(monkeypatch, conn=None)
    names = set(logging.root.manager.loggerDict)
    assert not [n for n in names if "unusual_prefix" in n and "_example_" in n], sorted(names)
    assert "cancellable_agents.examples.kill_me" in names


# -- running ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow_home")
    env = throwaway_airflow_env(home, dags_folder=EXAMPLE_DAGS, pythonpath=ROOT)
    env.pop("CANCELLABLE_AGENTS_CONN", None)
    migrate(env, timeout=180)
    return env


@pytest.fixture(scope="module")
def zygote(airflow_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScenarioZygote]:
    """The fork server this module's ``dag.test()`` children start from: a cold child spent
    10-20 s importing Airflow and building the in-process execution API before its DAG ran."""
    server = ScenarioZygote(airflow_env, tmp_path_factory.mktemp("zygote") / "zygote.log")
    try:
        yield server
    finally:
        server.close()


def _run_dag(zygote: ScenarioZygote, env: dict[str, str], dag_id: str, tmp_path: Path) -> dict[str, Any]:
    out_path, err_path = tmp_path / f"{dag_id}.out", tmp_path / f"{dag_id}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = zygote.start([sys.executable, __file__, dag_id], env, out.fileno(), err.fileno())
    code = proc.wait(240)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    output = f"{stdout[-6000:]}\n{stderr[-3000:]}"
    raise AssertionError(f"{dag_id}: no result (exit {code})\n{output}")


@pytest.mark.process
def test_plain_llm_dag_runs(airflow_env: dict[str, str], zygote: ScenarioZygote, tmp_path: Path) -> None:
    result = _run_dag(zygote, airflow_env, "example_cancellable_llm", tmp_path)
    assert result["state"] == "success", result
    assert set(result["tis"].values()) == {"success"}, result
    assert set(result["xcom"]["triage"]) == {"severity", "summary"}  # structured output, as a dict
    assert result["xcom"]["notify"].startswith("severity ")


@pytest.mark.process
def test_sandbox_dag_runs_commands(
    airflow_env: dict[str, str], zygote: ScenarioZygote, tmp_path: Path
) -> None:
    result = _run_dag(zygote, airflow_env, "example_cancellable_agent_sandbox", tmp_path)
    assert result["state"] == "success", result
    assert set(result["tis"].values()) == {"success"}, result
    # The test model calls every tool once: the answer holds the sandbox's real command results.
    for task_id in ("profile_python", "disk_report"):
        answer = result["xcom"][task_id]
        tool_results = answer if isinstance(answer, dict) else json.loads(answer)
        assert tool_results["run_shell"]["exit_code"] == 127  # `sh -c a`: command not found
        assert "NameError" in tool_results["run_python"]["stderr"]


@pytest.mark.process
def test_subagents_dag_delegates_to_a_sub_agent_with_a_sandbox(
    airflow_env: dict[str, str], zygote: ScenarioZygote, tmp_path: Path
) -> None:
    result = _run_dag(zygote, airflow_env, "example_cancellable_subagents", tmp_path)
    assert result["state"] == "success", result
    answer = result["xcom"]["disk_usage_report"]
    lead = answer if isinstance(answer, dict) else json.loads(answer)
    # The lead called `delegate`; the researcher it picked ran its own sandbox tools.
    researcher = json.loads(lead["delegate"])
    assert researcher["run_shell"]["exit_code"] == 127


@pytest.mark.process
@pytest.mark.skipif(not has_task_state_store(), reason="deferred tool calls are Airflow 3.3+")
def test_deferred_dag_waits_for_the_job_and_gets_its_result(
    airflow_env: dict[str, str], zygote: ScenarioZygote, tmp_path: Path
) -> None:
    result = _run_dag(zygote, airflow_env, "example_cancellable_deferred", tmp_path)
    assert result["state"] == "success", result
    answer = result["xcom"]["table_stats"]
    tool_results = answer if isinstance(answer, dict) else json.loads(answer)
    assert tool_results["run_batch_job"] == {"table": "a", "rows": 1234}, "the job's result is the tool's"


# -- the kill-me DAG --------------------------------------------------------------------------


class _Child:
    """The child process (forked by the zygote) with its output lines readable without blocking."""

    def __init__(self, zygote: ScenarioZygote, env: dict[str, str], *args: str) -> None:
        read_fd, write_fd = os.pipe()
        try:
            # its own session and group, so cleanup never reaches beyond it
            self.proc = zygote.start([sys.executable, __file__, *args], env, write_fd, new_session=True)
        finally:
            os.close(write_fd)
        self._stdout = os.fdopen(read_fd, "r", errors="replace")
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._stdout:
            self.lines.append(line)
            self._queue.put(line)

    def wait_for_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        for line in list(self.lines):
            if needle in line:
                return line
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} within {timeout}s:\n{''.join(self.lines[-80:])}")

    def wait_for_record(self, timeout: float) -> dict[str, Any]:
        """The record after ``RECORD_PREFIX``: one JSON object that spans several lines."""
        deadline = time.monotonic() + timeout
        self.wait_for_line(RECORD_PREFIX, timeout)
        while not (records := parse_records("".join(self.lines))):
            if time.monotonic() > deadline:
                raise AssertionError(f"no whole record within {timeout}s:\n{''.join(self.lines[-80:])}")
            time.sleep(0.05)  # the record's later lines are still being read
        return records[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def child_factory(zygote: ScenarioZygote) -> Iterator[Any]:
    started: list[_Child] = []

    def start(env: dict[str, str], *args: str) -> _Child:
        child = _Child(zygote, env, *args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def _wait_for_process(root_pid: int, cmdline: list[str], timeout: float) -> Any:
    """Poll the child's process tree until ``cmdline`` runs in it (no event exists to await)."""
    import psutil

    root = psutil.Process(root_pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not root.is_running() or root.status() == psutil.STATUS_ZOMBIE:
            raise AssertionError(f"pid {root_pid} exited before {cmdline} started")
        for proc in root.children(recursive=True):
            try:
                if proc.cmdline() == cmdline:
                    return proc
            except psutil.Error:  # exited, or a zombie, between listing and reading it
                continue
        time.sleep(0.05)
    raise AssertionError(f"{cmdline} did not start under pid {root_pid} within {timeout}s")


@pytest.mark.process
def test_kill_me_sandbox_task_stops_its_process_tree_on_sigterm(
    airflow_env: dict[str, str], child_factory: Any
) -> None:
    """SIGTERM to the running ``sandbox_command`` task, as a worker shutdown delivers it."""
    child = child_factory(airflow_env, "example_cancellable_kill_me", "sandbox_command")
    sleeper = _wait_for_process(child.proc.pid, ["sleep", "600"], timeout=120)

    os.kill(child.proc.pid, signal.SIGTERM)

    record = child.wait_for_record(timeout=30)
    if has_retry_policies():  # Airflow 3.3+: the cause decides the retry (an eviction retries)
        decision = child.wait_for_line("Retry policy decision", timeout=30)
        assert "action=retry" in decision
    assert record["cause"] == "eviction", record
    assert record["outcome"] == "cancelled"
    assert any(k["command"] == "sleep 600" and k["pid"] == sleeper.pid for k in record["killed"]), record
    assert record["stragglers"] == []
    assert not sleeper.is_running(), "the background `sleep 600` outlived the kill"
    assert child.proc.wait(60) == 0


# -- the child ----------------------------------------------------------------------------------


def _child_main(dag_id: str, only_task: str | None) -> None:
    """Run ``dag_id`` (or just ``only_task``, without retries) with ``dag.test()``; print the result."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from tests.dag_test_compat import prepare_dag_test

    prepare_dag_test()  # Airflow 3.1/3.2's dag.test() path, made to behave like production
    dag = _dag_bag().dags[dag_id]
    if only_task is not None:
        dag = dag.partial_subset(task_ids=[only_task], include_upstream=False)
        for task in dag.tasks:
            task.retries = 0  # one try: the retry decision is still logged, dag.test() then ends
    run = dag.test()
    with create_session() as session:
        rows = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run.run_id, XComModel.key == "return_value"
            )
        ).all()
        xcom = {row.task_id: XComModel.deserialize_value(row) for row in rows}
    result = {
        "state": str(run.state),
        "tis": {ti.task_id: str(ti.state) for ti in run.get_task_instances()},
        "xcom": xcom,
    }
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    from tests.dag_test_compat import exit_as_the_task_sdk_does

    _child_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    exit_as_the_task_sdk_does()
