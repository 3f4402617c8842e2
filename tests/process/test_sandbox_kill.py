"""Killing sandboxed process trees for real: a real SIGTERM (and SIGKILL) to a task process, kills
that stay targeted, hostile commands contained. (A stop of one command's tree:
``test_sandbox_command.py``; the descendant reaper without a sandbox: ``test_reaper.py``.)

Long-running processes are ``sleep 3NN.<digits>`` with a per-test marker; survivors are found in
/proc by that marker and, if a test fails, SIGKILLed by pid (see ``trees.py``).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary._cgroups import cgroup_support
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import landlock_support
from tests.process.trees import (
    MODES,
    NAMESPACE_BOUNDARY,
    ChildTask,
    eventually,
    landlock_reason,
    landlock_usable,
    sleepers,
    survivors,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


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
    not bwrap_support().boundary,
    reason=f"no boundary profile: {bwrap_support().boundary_reason or bwrap_support().reason}",
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


@pytest.mark.skipif(not landlock_usable(), reason=landlock_reason())
def test_sigkill_of_a_landlock_task_leaves_nothing_running(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    """No namespace ends the tree with the task: each command's init does, told by its
    parent-death signal, within a second (the ``setsid`` and double-forked sleepers too)."""
    task = child_tasks("landlock", marker)
    assert len(task.ready()["sleepers"]) == 3
    task.proc.kill()
    task.proc.wait(10)
    eventually(lambda: survivors(marker) == [], timeout=1.0)


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


#: What each boundary mode says to the model when a hostile probe fails: namespace mode shows
#: no such file, network or process; landlock mode refuses (EACCES, EPERM).
REFUSALS = {
    "namespace": {
        "read-secrets": ("No such file",),
        "connect-loopback": ("Network is unreachable", "Connection refused"),
        "kill-task-and-supervisor": ("No such process",),  # the pids are not even visible
    },
    "landlock": {
        "read-secrets": ("Permission denied",),
        "connect-loopback": ("Operation not permitted",),  # socket(AF_INET) refused
        "kill-task-and-supervisor": ("Operation not permitted",),  # signals scoped (ABI 6)
    },
}


def _contained(mode: str, name: str, result: dict[str, Any], record: dict[str, Any]) -> None:
    """The command failed (or did no harm) and says why, in what the model reads."""
    out, err = result["stdout"], result["stderr"]
    said = any(words in err for words in REFUSALS[mode].get(name, ("",)))
    if name == "read-secrets":
        assert result["exit_code"] != 0 and "SECRET" not in out and said, err
    elif name == "connect-loopback":
        assert result["exit_code"] != 0 and record["accepted"] == 0
        assert said, err
    elif name == "kill-task-and-supervisor":
        assert result["exit_code"] != 0 and said, err
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


@pytest.mark.parametrize(
    "mode",
    [
        NAMESPACE_BOUNDARY,
        pytest.param(
            "landlock",
            marks=[
                pytest.mark.skipif(not landlock_usable(), reason=landlock_reason()),
                pytest.mark.skipif(
                    landlock_support().abi < 6, reason="kill -9 of the task needs ABI 6 scoping"
                ),
            ],
        ),
    ],
)
def test_hostile_commands_are_contained_and_a_sigterm_during_them_unwinds(
    mode: str, marker: str, secrets: Path, child_tasks: Callable[..., ChildTask]
) -> None:
    """Each hostile command, in its own boundary sandbox, fails with a result the model can read
    and changes nothing outside; then, with all of them running (one ignores SIGTERM, one
    double-forked a daemon, one forked to its limit), a SIGTERM to the task unwinds within the
    budget with nothing left. The task surviving is also the ``kill -9`` check."""
    # Where landlock mode's answer differs on this worker, the probe is left out (not weakened):
    # without a cgroup the sandbox kills the fork bomb at its count (the kernel refuses no fork),
    # without root it kills the /tmp fill at its size (no tmpfs, no ENOSPC); test_sandbox_limits.py
    # tests both (test_without_a_cgroup_*, test_without_a_tmpfs_*).
    left_out = []
    if mode == "landlock" and cgroup_support().version is None:
        left_out.append("fork-bomb")
    if mode == "landlock" and os.geteuid() != 0:
        left_out.append("fill-disk")
    task = child_tasks("hostile", marker, str(secrets), mode, ",".join(left_out))
    ready = task.ready(timeout=60)
    started = time.monotonic()
    os.kill(task.proc.pid, signal.SIGTERM)
    record = task.result()
    unwind = time.monotonic() - started
    failures = []
    assert len(ready["results"]) == 7 - len(left_out) and not set(left_out) & set(ready["results"])
    for name, result in ready["results"].items():
        try:
            _contained(mode, name, result, record)
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
