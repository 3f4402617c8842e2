"""Any backend plugs in: a second real backend (commands run by a separate helper process, pids
unknown to the task) attached through :func:`attach_sandbox` is stopped by a kill, also when the
kill lands while its ``start`` is still running; ``SandboxToolset`` takes it as it is."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.run.tool_calls import IDEMPOTENCY_KEY_ENV, RunIdentity
from cancellable_agents.toolsets.sandbox import (
    CommandResult,
    Sandbox,
    SandboxCapabilities,
    SandboxClosed,
    SandboxToolset,
    attach_sandbox,
)
from tests.process.helper_backend import HelperSandbox
from tests.process.trees import eventually

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def sleepers(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        info = proc.info
        running = info["status"] != psutil.STATUS_ZOMBIE
        if info["name"] == "sleep" and running and marker in " ".join(info["cmdline"] or []):
            found.append(proc.pid)
    return found


#: How long a sandboxed command may take to start on a busy machine.
START_S = 10.0


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"3{uuid.uuid4().int % 100:02d}.{uuid.uuid4().int % 10**8:08d}"
    yield value
    for pid in sleepers(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_helper_backend_is_a_sandbox() -> None:
    backend = HelperSandbox()
    try:
        assert isinstance(backend, Sandbox)
        result = backend.wait(backend.start("echo hi"))
        assert (result.exit_code, result.stdout) == (0, "hi\n")
    finally:
        backend.destroy()


def test_a_call_pending_when_the_helper_exits_fails_at_once(marker: str) -> None:
    """As a remote backend's call fails when its connection closes: a ``wait`` still pending when
    the helper went away must not block for its hour-long timeout."""
    backend = HelperSandbox()
    try:
        command_id = backend.start(f"sleep {marker}")
        outcome: list[BaseException | CommandResult] = []

        def wait() -> None:
            try:
                outcome.append(backend.wait(command_id))
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        eventually(lambda: sleepers(marker) and backend.pending == 1, timeout=START_S)
        backend.helper.kill()  # the helper dies without answering the wait it was sent
        waiter.join(10)
        assert outcome and isinstance(outcome[0], SandboxClosed), outcome
    finally:
        backend.destroy()


def test_a_kill_stops_an_attached_backends_commands_and_destroys_it(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    backend = HelperSandbox()
    attachment = attach_sandbox(backend, scope, name="helper")
    command_id = attachment.start(f"sleep {marker}")
    eventually(lambda: sleepers(marker), timeout=START_S)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert sleepers(marker) == []
    [record] = scope.killed
    assert record.command_id == command_id and record.sandbox == "helper"
    assert record.pid is None and "pid" not in record.as_dict(), (
        "the task does not know a remote command's pid"
    )
    assert backend.helper.wait(5) == 0, "the backend was not destroyed in teardown"
    with pytest.raises(TaskCancelled):
        attachment.start("echo after the kill")


def test_a_kill_during_start_stops_the_command_start_was_starting(marker: str) -> None:
    """The helper starts the command, then answers 1 s later; the cancel lands in between. The
    helper's own ``stop_all`` does not know the command yet: only the attachment can stop it."""
    scope = TaskCancellation("task", budget=4.0)
    backend = HelperSandbox(reply_delay=1.0)
    attachment = attach_sandbox(backend, scope, name="helper")
    outcome: list[BaseException | str] = []

    def start() -> None:
        try:
            outcome.append(attachment.start(f"sleep {marker}"))
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    eventually(lambda: sleepers(marker), timeout=START_S)  # running, and start() has not returned
    assert not outcome
    cancelled_at = time.monotonic()
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(6)
    starter.join(5)
    assert sleepers(marker) == [], "the command whose start raced the cancel is still running"
    assert isinstance(outcome[0], TaskCancelled)
    assert time.monotonic() - cancelled_at < scope.budget
    assert [k.command_id for k in scope.killed] == backend.started


class SlowStopSandbox(HelperSandbox):
    """A backend whose ``stop`` takes a while to answer (a remote API under load)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_entered = threading.Event()

    def stop(self, command_id: str) -> None:
        self.stop_entered.set()
        time.sleep(0.5)  # the slow answer under test, not a synchronisation
        super().stop(command_id)


def test_a_stop_begun_by_the_tool_is_recorded_before_the_scope_is_released(marker: str) -> None:
    """A cancelled tool call stops its own command (``SandboxToolset`` does) just as the task is
    cancelled; the in-flight phase then finds nothing left to stop, and must still wait for that
    stop, so the kill is in the record when the scope reports itself released."""
    scope = TaskCancellation("task", budget=4.0)
    backend = SlowStopSandbox()
    attachment = attach_sandbox(backend, scope, name="helper")
    command_id = attachment.start(f"sleep {marker}")
    eventually(lambda: sleepers(marker), timeout=START_S)
    stopper = threading.Thread(target=attachment.stop, args=(command_id,))
    stopper.start()
    assert backend.stop_entered.wait(5)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert [k.command_id for k in scope.killed] == [command_id], "released before the kill was recorded"
    stopper.join(5)
    assert sleepers(marker) == []


def test_sandbox_toolset_takes_any_backend_and_a_kill_stops_its_command(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    backend = HelperSandbox()
    toolset = SandboxToolset(backend)
    assert "read_file" not in toolset.tools, "no file tools for a backend without file access"

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", [])):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("run_shell", {"command": f"sleep {marker}"})])

    agent = Agent(FunctionModel(model), toolsets=[toolset])
    outcome: list[BaseException | Any] = []

    def run() -> None:
        try:
            outcome.append(run_agent_in_scope(scope, agent, "go"))
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    eventually(lambda: sleepers(marker), timeout=START_S)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    runner.join(10)
    assert isinstance(outcome[0], TaskCancelled)
    assert sleepers(marker) == []
    assert [k.command_id for k in scope.killed] == backend.started
    assert backend.helper.wait(5) == 0, "a kill destroys every attached backend, one passed in too"


def _python_then_done(code: str) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)]
        if returns:
            answer: Any = returns[0].content
            return ModelResponse(parts=[TextPart(str(answer["stdout"]))])
        return ModelResponse(parts=[ToolCallPart("run_python", {"code": code})])

    return FunctionModel(model)


def test_a_backend_passed_in_outlives_a_run_that_ends_without_a_kill() -> None:
    """Ownership without a kill: the caller made the backend, the caller destroys it. The toolset
    lets go of its attachment when the run ends; the backend still runs commands after it."""
    backend = HelperSandbox()
    try:
        agent = Agent(_python_then_done("print('ran')"), toolsets=[SandboxToolset(backend)])
        assert run_agent_in_scope(TaskCancellation("task"), agent, "go").output == "ran\n"
        assert backend.helper.poll() is None, "the toolset destroyed a backend that was not its own"
        after = backend.wait(backend.start(["echo", "still mine"]), timeout=10)
        assert (after.exit_code, after.stdout) == (0, "still mine\n")
    finally:
        backend.destroy()


def test_the_tool_calls_key_reaches_a_command_as_env_without_a_shell() -> None:
    """``run_python`` hands the backend the argv ``[python, "-"]`` and the call's key as ``env=``:
    no ``/bin/sh -c 'export ...'`` around it, so an image with no shell runs it too."""
    backend = HelperSandbox()
    try:
        code = f"import os; print(os.environ['{IDEMPOTENCY_KEY_ENV}'])"
        agent = Agent(_python_then_done(code), toolsets=[SandboxToolset(backend)])
        identity = RunIdentity(("dag", "task", "run", 1), "0", 1)
        output = run_agent_in_scope(TaskCancellation("task"), agent, "go", identity=identity).output
        assert len(output.strip()) == 32, output
        assert backend.argvs == [[sys.executable, "-"]], "the command was wrapped"
    finally:
        backend.destroy()


STALLED_WAIT_TASK = '''
import threading
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.function import FunctionModel
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.run.tool_calls import IDEMPOTENCY_KEY_ENV, RunIdentity
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.toolsets.sandbox import SandboxCapabilities, SandboxToolset

class StalledWait:
    """A backend whose wait never answers, not even once the command was stopped."""
    capabilities = SandboxCapabilities()
    def __init__(self):
        self.waiting = threading.Event()
    def start(self, command, *, timeout=None, stdin=None, env=None):
        return "c1"
    def wait(self, command_id, timeout=None):
        self.waiting.set()
        threading.Event().wait()
    def stop(self, command_id): pass
    def stop_all(self): pass
    def destroy(self): pass

backend = StalledWait()
scope = TaskCancellation("task", budget=2.0)
kill = lambda: backend.waiting.wait(60) and scope.cancel(CancelCause.USER)
threading.Thread(target=kill, daemon=True).start()
call = ModelResponse(parts=[ToolCallPart("run_shell", {"command": "x"})])
model = FunctionModel(lambda messages, info: call)
try:
    run_agent_in_scope(scope, Agent(model, toolsets=[SandboxToolset(backend)]), "go")
except TaskCancelled:
    print("cancelled", flush=True)
'''


def test_a_backend_wait_that_never_answers_does_not_keep_the_task_process_alive() -> None:
    """A cancelled tool stops its command and leaves; a backend whose ``wait`` does not answer
    even then (a stalled connection, a helper that went away) keeps that call blocked. It must not
    hold the task process at exit past Airflow's grace, as a thread of asyncio's default executor
    would: those are joined at interpreter exit (seen as a test session that hung after its last
    test)."""
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WAIT_TASK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "cancelled\n"
        try:
            assert proc.wait(5) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("the task process hung at exit on the backend's unanswered wait") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class DeclaringSandbox(HelperSandbox):
    """The helper backend declaring the capabilities under test, and telling which ids the
    attachment stopped one by one."""

    def __init__(self, capabilities: SandboxCapabilities) -> None:
        super().__init__()
        self.capabilities = capabilities  # type: ignore[misc]  # per instance, for the test
        self.stopped_one_by_one: list[str] = []

    def stop(self, command_id: str) -> None:
        self.stopped_one_by_one.append(command_id)
        super().stop(command_id)


@pytest.mark.parametrize(
    ("records_kills", "stops_all_at_once", "one_by_one", "recorded"),
    [
        (False, False, True, True),
        (True, False, True, False),
        (False, True, True, True),  # the attachment records what it stops, so it stops each
        (True, True, False, False),
    ],
)
def test_each_declared_capability_has_its_one_effect_on_a_kill(
    marker: str, records_kills: bool, stops_all_at_once: bool, one_by_one: bool, recorded: bool
) -> None:
    """``records_kills``: who writes the kill records; ``stops_all_at_once``: whether the attachment
    may leave stopping to ``stop_all``. Either way the kill stops the command."""
    scope = TaskCancellation("task", budget=4.0)
    backend = DeclaringSandbox(SandboxCapabilities(records_kills, stops_all_at_once))
    attachment = attach_sandbox(backend, scope, name="helper")
    command_id = attachment.start(f"sleep {marker}")
    eventually(lambda: sleepers(marker), timeout=START_S)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert sleepers(marker) == []
    assert (backend.stopped_one_by_one == [command_id]) is one_by_one, backend.stopped_one_by_one
    assert ([k.command_id for k in scope.killed] == [command_id]) is recorded, scope.killed
