"""LocalSandbox against real commands: results, waits, stops, ``arun`` under cancels, its scope,
the environment its commands see. (How one command's tree is stopped: ``test_sandbox_command.py``.)

Every long-running command is ``sleep 3NN.<digits>`` with a per-test marker (see
``tests/process/trees.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox, SandboxClosed, bwrap_support
from tests.process.trees import MODES, eventually, sleepers, survivors

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


# -- running commands -----------------------------------------------------------------------


def test_run_captures_exit_code_and_both_streams(sandbox: LocalSandbox) -> None:
    result = sandbox.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.stopped and not result.timed_out and not result.ok


def test_commands_run_in_the_workdir_and_argv_is_not_shell_parsed(sandbox: LocalSandbox) -> None:
    assert sandbox.run("pwd").stdout.strip() == str(sandbox.workdir)
    assert sandbox.run(["echo", "$HOME;", "x"]).stdout == "$HOME; x\n"


def test_stdin_is_fed(sandbox: LocalSandbox) -> None:
    assert sandbox.run(["cat"], stdin="piped\n").stdout == "piped\n"


@pytest.mark.parametrize("mode", MODES)
def test_a_commands_env_wins_for_that_command_alone_also_when_starts_race(mode: str) -> None:
    """``env=`` of one command is added on top of the sandbox's ``env=`` for that command only;
    commands started at once from several threads each get their own."""
    box = LocalSandbox(isolation=mode, env={"SHARED": "box", "OVERRIDDEN": "box"})  # type: ignore[arg-type]
    try:
        probe = ["printenv", "SHARED", "OVERRIDDEN"]
        assert box.run(probe, env={"OVERRIDDEN": "command"}).stdout == "box\ncommand\n"
        assert box.run(probe).stdout == "box\nbox\n", "a command's env leaked into the next one"
        outputs: dict[int, str] = {}
        barrier = threading.Barrier(8)

        def run(i: int) -> None:
            barrier.wait(30)
            outputs[i] = box.run(["printenv", "WHO"], env={"WHO": str(i)}).stdout

        workers = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        assert outputs == {i: f"{i}\n" for i in range(8)}
    finally:
        box.destroy()


# -- waiting and stopping -------------------------------------------------------------------


def test_wait_times_out_without_stopping_and_unknown_ids_raise(sandbox: LocalSandbox, marker: str) -> None:
    command = sandbox.start(f"sleep {marker}")
    with pytest.raises(TimeoutError):
        sandbox.wait(command, timeout=0.05)
    assert survivors(marker)
    with pytest.raises(KeyError):
        sandbox.wait("nope")
    sandbox.stop(command)


def test_stop_is_idempotent_for_running_finished_and_unknown_ids(sandbox: LocalSandbox, marker: str) -> None:
    finished = sandbox.start("echo done")
    assert sandbox.wait(finished, timeout=10).ok
    sandbox.stop(finished)
    assert sandbox.wait(finished, timeout=1).ok, "stopping a finished command must not change its result"

    sandbox.stop("no-such-command")

    running = sandbox.start(f"sleep {marker}")
    eventually(lambda: sleepers(marker))
    sandbox.stop(running)
    sandbox.stop(running)
    result = sandbox.wait(running, timeout=1)
    assert result.stopped and result.exit_code == -signal.SIGTERM
    assert survivors(marker) == []


def test_arun_does_not_block_the_loop_and_stops_the_command_when_cancelled(
    sandbox: LocalSandbox, marker: str
) -> None:
    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        assert (await sandbox.arun("sleep 0.3; echo ok")).stdout == "ok\n"
        assert ticks >= 10, "arun blocked the event loop"
        run = asyncio.create_task(sandbox.arun(f"sleep {marker}"))
        while not sleepers(marker):
            await asyncio.sleep(0.01)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, timeout=5)
        assert survivors(marker) == [], "arun re-raised CancelledError before stopping the command"
        tick.cancel()

    asyncio.run(main())


def test_arun_cancelled_again_and_again_still_stops_the_command_first(marker: str) -> None:
    """An anyio cancel scope re-delivers its cancel at every await: the stop is still awaited
    to the end (here, through a 0.5 s grace for a command that ignores SIGTERM)."""
    sandbox = LocalSandbox(isolation="process-group", stop_grace=0.5)

    async def main() -> None:
        run = asyncio.create_task(sandbox.arun(f"trap '' TERM; sleep {marker}"))
        while not sleepers(marker):
            await asyncio.sleep(0.01)
        run.cancel()
        while not run.done():
            await asyncio.sleep(0)
            run.cancel()
        assert run.cancelled()
        assert survivors(marker) == [], "arun ended before the command it was stopping"

    try:
        asyncio.run(main())
    finally:
        sandbox.destroy()


# -- the scope ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_the_scope_stops_commands_then_destroys_the_sandbox(mode: str, marker: str) -> None:
    scope = TaskCancellation("t", budget=3.0)
    box = LocalSandbox(isolation=mode, scope=scope)  # type: ignore[arg-type]
    command = box.start(f"sleep {marker} & sleep {marker}")
    eventually(lambda: len(sleepers(marker)) == 2)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert survivors(marker) == []
    assert not box.workdir.exists()
    assert box.wait(command, timeout=1).stopped
    kills = [k for k in scope.killed if k.command_id == command]
    assert (
        sorted(k.command for k in kills)
        == [f"/bin/sh -c sleep {marker} & sleep {marker}"] + [f"sleep {marker}"] * 2
    )
    events = [e.event for e in scope.timeline]
    assert events.index("token_cancelled") < events.index("resources_released")
    with pytest.raises((SandboxClosed, TaskCancelled)):
        box.start("true")


def test_sandbox_attaches_to_the_current_scope_at_first_use(marker: str) -> None:
    box = LocalSandbox(isolation="process-group")
    scope = TaskCancellation("t")
    try:
        with scope.activate():
            box.start(f"sleep {marker}")
        assert box.scope is scope
        eventually(lambda: sleepers(marker))
        scope.cancel(CancelCause.USER)
        assert scope.wait_released(5)
        assert survivors(marker) == []
    finally:
        box.destroy()


def test_no_command_starts_in_a_cancelled_scope() -> None:
    scope = TaskCancellation("t")
    scope.cancel(CancelCause.USER)
    scope.wait_released(5)
    box = LocalSandbox(isolation="process-group", scope=scope)
    with pytest.raises((TaskCancelled, SandboxClosed)):
        box.start("true")
    box.destroy()


# -- environment ----------------------------------------------------------------------------


def test_commands_do_not_see_airflow_secrets_unless_passed_explicitly(
    sandbox: LocalSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MY_DB", "postgres://user:pw@db/x")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("LANG", "C.UTF-8")
    hidden = sandbox.run("env | grep -E 'AIRFLOW_CONN_MY_DB|OPENAI_API_KEY'")
    assert hidden.exit_code == 1 and hidden.stdout == ""
    assert sandbox.run("echo $LANG").stdout == "C.UTF-8\n"
    # The boundary profile puts the sandbox's interpreter first (other PATH entries may be hidden).
    assert sandbox.run("echo $PATH").stdout.strip().endswith(os.environ["PATH"])

    explicit = LocalSandbox(sandbox.workdir, isolation=sandbox.mode, env={"AIRFLOW_CONN_MY_DB": "given"})
    assert explicit.run("env | grep AIRFLOW_CONN_MY_DB").stdout == "AIRFLOW_CONN_MY_DB=given\n"


@pytest.mark.skipif(not bwrap_support().usable, reason=f"no PID namespaces here: {bwrap_support().reason}")
def test_an_interpreter_installed_under_tmp_stays_visible_in_namespace_mode() -> None:
    # CI clones (and their venvs) often live under /tmp, which the sandbox replaces privately.
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        venv = Path(root) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
        box = LocalSandbox(isolation="namespace", python=str(venv / "bin" / "python"))
        try:
            result = box.run(["python", "-c", "import sys; print(sys.prefix)"])
            assert result.exit_code == 0, result.stderr
            result = box.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"])
            assert (result.exit_code, result.stdout.strip()) == (0, str(venv)), result.stderr
        finally:
            box.destroy()
