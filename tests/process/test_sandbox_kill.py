"""Killing process trees for real: sandboxes in both isolation modes, a real SIGTERM to a task
process, the descendant reaper without a sandbox, and kills that stay targeted.

Long-running processes are ``sleep 3NN.<digits>`` with a per-test marker; survivors are found in
/proc by that marker and, if a test fails, SIGKILLed by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TASK_SCRIPT = Path(__file__).with_name("_sandbox_task.py")
SRC = Path(__file__).parents[2] / "src"
NAMESPACE = pytest.param(
    "namespace",
    marks=pytest.mark.skipif(
        not bwrap_support().usable,
        reason=f"bubblewrap cannot create PID namespaces here: {bwrap_support().reason}",
    ),
)
MODES = [NAMESPACE, "process-group"]


# -- helpers --------------------------------------------------------------------------------


def eventually(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def survivors(marker: str, name: str | None = None) -> list[int]:
    """Running (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if name is not None and proc.name() != name:
                continue
            if marker in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def sleepers(marker: str) -> list[int]:
    return survivors(marker, name="sleep")


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"3{uuid.uuid4().int % 100:02d}.{uuid.uuid4().int % 10**8:08d}"
    yield value
    for pid in survivors(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ChildTask:
    """``_sandbox_task.py MODE MARKER`` with its stdout read line by line on a thread."""

    def __init__(self, mode: str, marker: str, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, str(TASK_SCRIPT), mode, marker, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"no output from the task within {timeout}s; stderr:\n{err}") from None

    def ready(self, timeout: float = 30.0) -> dict[str, Any]:
        line = self.next_line(timeout)
        assert line.startswith("READY "), line
        return json.loads(line[len("READY ") :])

    def result(self, timeout: float = 30.0) -> dict[str, Any]:
        record = json.loads(self.next_line(timeout))
        assert self.proc.wait(timeout) == 0
        return record

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def child_tasks() -> Iterator[Callable[..., ChildTask]]:
    started: list[ChildTask] = []

    def start(mode: str, marker: str, *extra: str) -> ChildTask:
        task = ChildTask(mode, marker, *extra)
        started.append(task)
        return task

    yield start
    for task in started:
        task.close()


# -- stop() kills the whole tree ------------------------------------------------------------


@pytest.mark.skipif(not bwrap_support().usable, reason=f"no PID namespaces here: {bwrap_support().reason}")
def test_namespace_stop_kills_setsid_and_double_forked_children_within_a_second(marker: str) -> None:
    box = LocalSandbox(isolation="namespace", stop_grace=1.0)
    try:
        command = box.start(
            f"setsid sleep {marker} & (sleep {marker} &) ; (setsid sleep {marker} &) ; sleep {marker}"
        )
        eventually(lambda: len(sleepers(marker)) == 4)
        started = time.monotonic()
        box.stop(command)
        eventually(lambda: survivors(marker) == [], timeout=1.0, interval=0.002)
        assert time.monotonic() - started < 1.0
        assert box.wait(command, timeout=1).stopped
    finally:
        box.destroy()


def test_process_group_stop_kills_every_tracked_descendant(marker: str) -> None:
    """The fallback's guarantee: the process group plus every descendant the tracker saw.

    ``setsid sleep`` leaves the group but stays the shell's child, so the tracker sees it; the
    ``(sleep &)`` orphan is reparented at once but stays in the group.
    """
    box = LocalSandbox(isolation="process-group", stop_grace=1.0)
    try:
        command = box.start(f"setsid sleep {marker} & (sleep {marker} &) ; sleep {marker}")
        eventually(lambda: len(sleepers(marker)) == 3)
        setsid_sleep = [p for p in sleepers(marker) if os.getsid(p) == p]
        assert len(setsid_sleep) == 1
        eventually(lambda: setsid_sleep[0] in box.descendants(command))
        box.stop(command)
        eventually(lambda: survivors(marker) == [], timeout=1.0, interval=0.002)
    finally:
        box.destroy()


def test_process_group_catches_an_untracked_double_forked_setsid_child_by_its_tag(marker: str) -> None:
    """``(setsid sleep &)`` leaves group and tree within microseconds; the inherited
    ``CANCELLABLE_AGENTS_COMMAND`` tag still identifies it (it would not if it cleared its env)."""
    box = LocalSandbox(isolation="process-group", stop_grace=1.0)
    try:
        command = box.start(f"(setsid sleep {marker} &) ; sleep {marker}")
        eventually(lambda: len(sleepers(marker)) == 2)
        box.stop(command)
        eventually(lambda: survivors(marker) == [], timeout=1.0, interval=0.002)
    finally:
        box.destroy()


# -- a real SIGTERM to a task process --------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_to_the_task_pid_kills_the_sandboxed_tree(
    mode: str, marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks(mode, marker)
    running = task.ready()["sleepers"]
    assert len(running) == 3
    os.kill(task.proc.pid, signal.SIGTERM)
    record = task.result()
    assert survivors(marker) == []
    summary = record["summary"]
    killed = {k["pid"] for k in summary["killed"]}
    assert set(running) <= killed, summary["killed"]
    assert {k["mode"] for k in summary["killed"]} == {mode}
    events = [e["event"] for e in summary["timeline"]]
    assert events.index("kill_received") < events.index("killed") < events.index("resources_released")
    assert summary["stragglers"] == []
    # The task process is a subreaper: the ``(sleep &)`` orphan and bwrap's init came back to it.
    assert record["zombies"] == [], "the sandbox must reap every process of its command it stopped"


@pytest.mark.skipif(
    not bwrap_support().boundary, reason=f"no boundary profile: {bwrap_support().boundary_reason}"
)
def test_sigkill_of_the_task_leaves_no_boundary_command_running(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    """No Python runs after a SIGKILL: the kernel must end the namespace (``--die-with-parent``),
    also when the command switched to the sandbox's own uid (which clears its parent-death signal)."""
    task = child_tasks("namespace", marker)
    assert len(task.ready()["sleepers"]) == 3
    task.proc.kill()
    eventually(lambda: survivors(marker) == [], timeout=5.0)


def test_sigterm_to_the_task_pid_reaps_what_an_async_tool_started_without_a_sandbox(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper", marker)
    ready = task.ready()
    os.kill(task.proc.pid, signal.SIGTERM)
    record = task.result()
    assert survivors(marker) == []
    assert record["outcome"] == "cancelled: unknown"
    assert record["zombies"] == [], "orphans reparented to the subreaper must be reaped"
    killed = {k["pid"]: k["command"] for k in record["summary"]["killed"]}
    assert set(ready["sleepers"]) <= set(killed), record["summary"]["killed"]
    # Named as they were when killed: the setsid'd one was seen as a bash for its first second.
    assert all(killed[pid] == f"sleep {marker}" for pid in ready["sleepers"]), killed


def test_reaper_spares_what_existed_before_the_run_and_is_idempotent(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper-baseline", marker)
    ready = task.ready()
    record = task.result()
    assert record["subreaper"] is True
    assert record["before_alive"] is True
    assert {k["pid"] for k in record["killed"]} == set(ready["during"])
    assert record["second_reap"] == []
    assert record["zombies"] == []
    assert survivors(f"{marker}2") == []


def test_reaper_reaps_reparented_orphans_at_once_and_leaves_owned_children_to_their_owner(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper-orphans", marker)
    task.ready()
    record = task.result()
    assert record["orphans_left"] == [], "orphans reparented to the subreaper must be reaped as they exit"
    assert record["owned_exit"] == 7, "a Popen child's exit status must be left for its Popen"
    assert record["reap_s"] < 2.0, "reap() waited an owner grace for an orphan nobody here owns"
    assert record["zombies"] == []


# -- kills stay targeted ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_one_sandbox_leaves_the_other_running_to_success(mode: str, marker: str) -> None:
    victim_scope, other_scope = TaskCancellation("victim"), TaskCancellation("other")
    victim = LocalSandbox(isolation=mode, scope=victim_scope)  # type: ignore[arg-type]
    other = LocalSandbox(isolation=mode, scope=other_scope)  # type: ignore[arg-type]
    try:
        short = f"1.5{uuid.uuid4().int % 10**8:08d}"  # ~1.5 s, and unique
        doomed = victim.start(f"sleep {marker}")
        survivor = other.start(f"sleep {short} & wait; echo finished")
        eventually(lambda: sleepers(marker) and sleepers(short))
        victim_scope.cancel(CancelCause.USER)
        assert victim_scope.wait_released(5)
        assert victim.wait(doomed, timeout=1).stopped
        assert survivors(marker) == []
        assert sleepers(short), "the other task's command was killed"
        result = other.wait(survivor, timeout=30)
        assert (result.exit_code, result.stdout, result.stopped) == (0, "finished\n", False)
        assert other_scope.killed == []
    finally:
        victim.destroy()
        other.destroy()


# -- hostile commands in the boundary profile ------------------------------------------------


@pytest.fixture(scope="module")
def secrets() -> Iterator[Path]:
    """An ``airflow.cfg`` and ``~/.aws/credentials`` outside /tmp (which is private anyway), so
    only the boundary profile hides them: ``profile="host"`` would show them."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="cancellable-agents-secrets-", dir="/var/tmp"))
    (root / "airflow").mkdir()
    (root / "airflow" / "airflow.cfg").write_text("[database]\nsql_alchemy_conn = postgresql://secret\n")
    (root / "home" / ".aws").mkdir(parents=True)
    (root / "home" / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = SECRET\n")
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _contained(name: str, result: dict[str, Any], record: dict[str, Any]) -> None:
    """The command failed (or did no harm) and says why, in what the model reads."""
    out, err = result["stdout"], result["stderr"]
    if name == "read-secrets":
        assert result["exit_code"] != 0 and "SECRET" not in out and "No such file" in err
    elif name == "connect-loopback":
        assert result["exit_code"] != 0 and record["accepted"] == 0
        assert "Network is unreachable" in err or "Connection refused" in err, err
    elif name == "kill-task-and-supervisor":
        assert result["exit_code"] != 0 and "No such process" in err  # the pids are not even visible
    elif name == "fork-bomb":
        assert result["exit_code"] == 0 and int(out) < 32, "the process limit did not stop the forks"
    elif name == "fill-disk":
        assert "big=153" in out, "a file past the size limit must die of SIGXFSZ (128 + 25)"
        assert "File size limit exceeded" in err and "No space left on device" in err
        assert int(out.split("tmp_files=")[1]) <= 4, "the private /tmp is capped at 4 MiB"
    elif name == "ignore-sigterm":
        assert out == "still here\n"  # harmless on its own: the kill below is the test
    elif name == "double-fork-daemon":
        assert out == "daemonized\n"  # its daemon must be gone: checked by the survivors below


@pytest.mark.skipif(
    not bwrap_support().boundary, reason=f"no boundary profile here: {bwrap_support().boundary_reason}"
)
def test_hostile_commands_are_contained_and_a_sigterm_during_them_unwinds(
    marker: str, secrets: Path, child_tasks: Callable[..., ChildTask]
) -> None:
    """Each hostile command, in its own boundary-profile sandbox, fails with a result the model
    can read and changes nothing outside; then, with all of them running (one ignores SIGTERM,
    one double-forked a daemon, one forked to its limit), a SIGTERM to the task unwinds within
    the budget with nothing left. The task surviving is also the ``kill -9`` check."""
    task = child_tasks("hostile", marker, str(secrets))
    ready = task.ready(timeout=60)
    started = time.monotonic()
    os.kill(task.proc.pid, signal.SIGTERM)
    record = task.result()
    unwind = time.monotonic() - started
    failures = []
    for name, result in ready["results"].items():
        try:
            _contained(name, result, record)
        except (AssertionError, ValueError, IndexError) as exc:
            failures.append(f"{name}: {exc!r} {result}")
    assert not failures, "\n".join(failures)
    assert survivors(marker) == [], "something a command started outlived the kill"
    summary = record["summary"]
    assert summary["stragglers"] == [] and record["zombies"] == []
    assert {k["command_id"] for k in summary["killed"]}, "the kills were not recorded"
    assert record["workdirs_left"] == [], "a sandbox was not destroyed"
    assert unwind < summary["budget_s"] + 1.0, f"unwind took {unwind:.2f}s"
    assert (secrets / "airflow" / "airflow.cfg").read_text().startswith("[database]")
