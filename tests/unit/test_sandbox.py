"""LocalSandbox and SandboxToolset against real commands: results, limits, stops, environment, files.

Every long-running command is ``sleep 3NN.<digits>`` with a per-test marker, so a survivor can be
found in /proc (and cleaned up by pid) without touching anyone else's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.procs.proc import ProcKey, read_proc, reap_zombie
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.toolsets.sandbox import (
    CommandResult,
    LocalSandbox,
    Sandbox,
    SandboxClosed,
    SandboxFiles,
    SandboxPathError,
    SandboxToolset,
    bwrap_support,
    scrubbed_environment,
)

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).parents[2] / "src"
MODES = [
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(
            not bwrap_support().usable, reason=f"no PID namespaces here: {bwrap_support().reason}"
        ),
    ),
    "process-group",
]


# -- helpers --------------------------------------------------------------------------------


def eventually(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def survivors(marker: str, name: str | None = None) -> list[int]:
    """Pids of running processes whose command line contains ``marker`` (and named ``name``)."""
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
    """The marker's ``sleep`` processes: the command really runs (not just its bwrap wrapper)."""
    return survivors(marker, name="sleep")


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique ``sleep`` duration; leftovers are SIGKILLed by pid after the test."""
    value = f"3{uuid.uuid4().int % 100:02d}.{uuid.uuid4().int % 10**9:09d}"
    yield value
    for pid in survivors(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=MODES)
def sandbox(request: pytest.FixtureRequest) -> Iterator[LocalSandbox]:
    box = LocalSandbox(isolation=request.param, stop_grace=0.5)
    yield box
    box.destroy()


# -- running commands -----------------------------------------------------------------------


@pytest.mark.process
def test_run_captures_exit_code_and_both_streams(sandbox: LocalSandbox) -> None:
    result = sandbox.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.stopped and not result.timed_out and not result.ok


@pytest.mark.process
def test_commands_run_in_the_workdir_and_argv_is_not_shell_parsed(sandbox: LocalSandbox) -> None:
    assert sandbox.run("pwd").stdout.strip() == str(sandbox.workdir)
    assert sandbox.run(["echo", "$HOME;", "x"]).stdout == "$HOME; x\n"


@pytest.mark.process
def test_stdin_is_fed(sandbox: LocalSandbox) -> None:
    assert sandbox.run(["cat"], stdin="piped\n").stdout == "piped\n"


@pytest.mark.process
def test_output_is_capped_with_a_marker_and_huge_output_does_not_hang(sandbox: LocalSandbox) -> None:
    small = LocalSandbox(sandbox.workdir, isolation=sandbox.mode, output_limit=1000)
    result = small.run("head -c 5000 /dev/zero | tr '\\0' x; head -c 1500 /dev/zero | tr '\\0' y >&2")
    assert result.stdout.startswith("x" * 1000)
    assert result.stdout[1000:] == "\n[... truncated 4000 bytes ...]"
    assert result.stderr.endswith("[... truncated 500 bytes ...]")
    assert result.stdout_truncated and result.stderr_truncated
    big = sandbox.run("head -c 20000000 /dev/zero", timeout=20)
    assert big.exit_code == 0 and big.stdout_truncated
    assert len(big.stdout) < 70_000


@pytest.mark.process
def test_per_command_timeout_stops_the_tree(sandbox: LocalSandbox, marker: str) -> None:
    started = time.monotonic()
    result = sandbox.run(f"sleep {marker} & sleep {marker}", timeout=0.3)
    assert time.monotonic() - started < 3
    assert result.timed_out and result.stopped
    assert result.exit_code == -signal.SIGTERM
    assert survivors(marker) == []


@pytest.mark.process
def test_background_processes_do_not_outlive_their_command(sandbox: LocalSandbox, marker: str) -> None:
    result = sandbox.run(f"sleep {marker} >/dev/null 2>&1 & echo started", timeout=10)
    assert result.exit_code == 0 and result.stdout == "started\n"
    eventually(lambda: survivors(marker) == [], timeout=2)


# -- stop semantics -------------------------------------------------------------------------


@pytest.mark.process
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


@pytest.mark.process
def test_a_stopped_command_that_exits_0_is_still_stopped(sandbox: LocalSandbox, marker: str) -> None:
    command = sandbox.start(f"trap 'exit 0' TERM; sleep {marker} & wait")
    eventually(lambda: sleepers(marker))
    sandbox.stop(command)
    result = sandbox.wait(command, timeout=2)
    assert result.stopped and not result.ok
    assert result.exit_code == -signal.SIGTERM


@pytest.mark.process
@pytest.mark.parametrize("mode", MODES)
def test_a_command_ignoring_sigterm_is_sigkilled_at_the_grace(mode: str, marker: str) -> None:
    scope = TaskCancellation("t")
    box = LocalSandbox(isolation=mode, stop_grace=0.3, scope=scope)  # type: ignore[arg-type]
    try:
        command = box.start(f'trap "" TERM; sleep {marker}')
        eventually(lambda: sleepers(marker))
        started = time.monotonic()
        box.stop(command)
        took = time.monotonic() - started
        assert 0.25 < took < 2.5, took
        assert box.wait(command, timeout=1).exit_code == -signal.SIGKILL
        assert survivors(marker) == []
        kills = [k for k in scope.killed if marker in k.command]
        assert kills and all(k.signal == signal.SIGKILL for k in kills), scope.killed
        assert all(k.command_id == command and k.mode == mode for k in kills)
    finally:
        box.destroy()


@pytest.mark.process
def test_wait_times_out_without_stopping_and_unknown_ids_raise(sandbox: LocalSandbox, marker: str) -> None:
    command = sandbox.start(f"sleep {marker}")
    with pytest.raises(TimeoutError):
        sandbox.wait(command, timeout=0.05)
    assert survivors(marker)
    with pytest.raises(KeyError):
        sandbox.wait("nope")
    sandbox.stop(command)


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "pid"])
def test_reap_zombie_collects_exactly_that_exited_child(
    pidfd: bool, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pidfd:
        monkeypatch.setattr("cancellable_agents.procs.proc._pidfd_open", lambda pid: None)

    def zombie(proc: subprocess.Popen[bytes]) -> ProcKey:
        info = eventually(lambda: (i := read_proc(proc.pid)) is not None and i.exited and i)
        return ProcKey(proc.pid, info.start)

    running = subprocess.Popen(["sleep", marker])
    exited = subprocess.Popen(["sh", "-c", "exit 5"])
    try:
        key = zombie(exited)
        assert reap_zombie(ProcKey(key.pid, key.start + 1)) is None, "another start time: not that process"
        assert read_proc(key.pid) is not None, "a process with another identity was reaped"
        assert reap_zombie(key) == 5
        assert read_proc(key.pid) is None and reap_zombie(key) is None
        info = read_proc(running.pid)
        assert info is not None
        assert reap_zombie(ProcKey(running.pid, info.start)) is None, "a running process was reaped"
        running.kill()
        assert reap_zombie(zombie(running)) == -signal.SIGKILL
    finally:
        for proc in (running, exited):
            if proc.poll() is None:  # not reaped above: the test failed early
                proc.kill()
                proc.wait(10)


# -- the scope ------------------------------------------------------------------------------


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_no_command_starts_in_a_cancelled_scope() -> None:
    scope = TaskCancellation("t")
    scope.cancel(CancelCause.USER)
    scope.wait_released(5)
    box = LocalSandbox(isolation="process-group", scope=scope)
    with pytest.raises((TaskCancelled, SandboxClosed)):
        box.start("true")
    box.destroy()


# -- environment ----------------------------------------------------------------------------


@pytest.mark.process
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


def test_scrubbed_environment_rules() -> None:
    base = {
        "PATH": "/bin",
        "HOME": "/root",
        "LANG": "C",
        "AIRFLOW__CORE__FERNET_KEY": "k",
        "AIRFLOW_CONN_X": "c",
        "AIRFLOW_VAR_Y": "v",
        "GITHUB_TOKEN": "t",
        "db_password": "p",
        "MY_SECRET_THING": "s",
        "ANTHROPIC_API_KEY": "a",
        "AIRFLOW_HOME": "/opt/airflow",
    }
    assert scrubbed_environment(base) == {
        "PATH": "/bin",
        "HOME": "/root",
        "LANG": "C",
        "AIRFLOW_HOME": "/opt/airflow",
    }
    assert scrubbed_environment(base, {"GITHUB_TOKEN": "given"})["GITHUB_TOKEN"] == "given"


# -- files and workdir ----------------------------------------------------------------------


def test_file_access_is_confined_to_the_workdir(tmp_path: Path) -> None:
    box = LocalSandbox(tmp_path / "wd", isolation="process-group")
    assert box.write_file("sub/a.txt", "hello") == 5
    assert box.read_file("sub/a.txt") == "hello"
    assert box.list_files() == ["sub/"]
    assert box.list_files("sub") == ["a.txt"]
    (box.workdir / "link").symlink_to("/etc")
    for escape in ("../outside.txt", "/etc/passwd", "link/passwd", "sub/../../x"):
        with pytest.raises(SandboxPathError, match="outside the sandbox working directory"):
            box.resolve(escape)
    box.destroy()


def test_workdir_is_removed_only_if_the_sandbox_created_it(tmp_path: Path) -> None:
    existing = tmp_path / "mine"
    existing.mkdir()
    LocalSandbox(existing, isolation="process-group").destroy()
    assert existing.exists()
    temp = LocalSandbox(isolation="process-group")
    assert temp.workdir.is_dir()
    temp.destroy()
    temp.destroy()
    assert not temp.workdir.exists()
    with pytest.raises(SandboxClosed):
        temp.start("true")


def test_local_sandbox_satisfies_the_protocols() -> None:
    box = LocalSandbox(isolation="process-group")
    assert isinstance(box, Sandbox) and isinstance(box, SandboxFiles)
    box.destroy()


def test_namespace_mode_without_bubblewrap_says_how_to_fix_it() -> None:
    code = (
        "from cancellable_agents.toolsets.sandbox import LocalSandbox, SandboxUnavailable\n"
        "box = LocalSandbox(isolation='auto')\nprint(box.mode)\nbox.destroy()\n"
        "try:\n    LocalSandbox(isolation='namespace')\n"
        "except SandboxUnavailable as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mode, message = out.stdout.split("\n", 1)
    assert mode == "process-group"
    assert "apt-get install bubblewrap" in message and "user namespaces" in message


# -- the toolset ----------------------------------------------------------------------------


def _tool_returns(messages: list[ModelMessage]) -> list[Any]:
    parts = [p for m in messages for p in getattr(m, "parts", [])]
    return [p.content for p in parts if isinstance(p, (ToolReturnPart, RetryPromptPart))]


def _scripted(calls: list[ToolCallPart], seen: list[Any]) -> FunctionModel:
    """A model that makes ``calls`` one per turn, then answers with what the tools returned."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = _tool_returns(messages)
        if len(returns) < len(calls):
            return ModelResponse(parts=[calls[len(returns)]])
        seen.extend(returns)
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


@pytest.mark.process
@pytest.mark.parametrize("mode", MODES)
def test_toolset_runs_echo_for_a_pydantic_ai_agent(mode: str) -> None:
    seen: list[Any] = []
    toolset = SandboxToolset(isolation=mode)  # type: ignore[arg-type]
    calls = [
        ToolCallPart("run_shell", {"command": "echo hi"}),
        ToolCallPart("run_python", {"code": "print(6 * 7)"}),
        ToolCallPart("write_file", {"path": "notes/a.txt", "content": "x"}),
        ToolCallPart("list_files", {"path": "notes"}),
        ToolCallPart("read_file", {"path": "notes/a.txt"}),
    ]
    agent = Agent(_scripted(calls, seen), toolsets=[toolset])
    result = run_agent_in_scope(TaskCancellation("t"), agent, "go")
    assert result.output == "done"
    assert seen[0] == {"exit_code": 0, "stdout": "hi\n", "stderr": ""}
    assert seen[1]["stdout"] == "42\n"
    assert seen[2:] == ["wrote 1 bytes to notes/a.txt", ["a.txt"], "x"]
    assert toolset.sandbox is None, "the toolset destroys the sandbox it created"


@pytest.mark.process
def test_toolset_rejects_escaping_paths_and_keeps_a_sandbox_it_was_given(tmp_path: Path) -> None:
    box = LocalSandbox(tmp_path / "wd", isolation="process-group")
    seen: list[Any] = []
    calls = [
        ToolCallPart("read_file", {"path": "../../etc/passwd"}),
        ToolCallPart("run_shell", {"command": "sleep 5", "timeout": 0.2}),
    ]
    agent = Agent(_scripted(calls, seen), toolsets=[SandboxToolset(box, command_timeout=30)])
    run_agent_in_scope(TaskCancellation("t"), agent, "go")
    assert "outside the sandbox working directory" in str(seen[0])
    assert seen[1]["timed_out"] == "killed after 0.2s"
    assert box.workdir.exists(), "a sandbox passed in belongs to the caller"
    assert box.run("echo still usable").ok
    box.destroy()


def test_command_result_ok_means_exit_0_and_not_stopped() -> None:
    assert CommandResult("c", 0, "", "").ok
    assert not CommandResult("c", 0, "", "", stopped=True).ok


@pytest.mark.process
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
