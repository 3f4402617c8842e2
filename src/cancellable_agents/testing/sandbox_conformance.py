"""The [`Sandbox`][cancellable_agents.toolsets.sandbox.protocol.Sandbox] contract as tests, for any
backend.

A backend author writes one pytest fixture, ``sandbox_factory`` (a callable that makes a fresh
backend; parametrize it to cover several configurations), and subclasses
[`SandboxConformance`][cancellable_agents.testing.sandbox_conformance.SandboxConformance] in a
test module::

    import pytest
    from cancellable_agents.testing.sandbox_conformance import SandboxConformance

    @pytest.fixture(params=["small", "large"])
    def sandbox_factory(request):
        return lambda: MyPodSandbox(size=request.param)

    class TestMyPodSandbox(SandboxConformance):
        pass

Every backend the factory makes is destroyed after its test. The tests hold what the task needs
from a backend on a kill and otherwise: ``stop``, ``stop_all`` and ``destroy`` idempotent; a kill
(the scope's cancel) reaching a running command, within the budget, and recorded on the scope;
no command started after a kill or after ``destroy``; ownership (an attachment let go of leaves
the backend to its maker, a kill destroys it); ``env=`` reaching the command without a shell,
``stdin`` reaching it, its ``timeout`` enforced by the backend; concurrent starts and stops.
They use the protocol only (no pid, no local file), so a remote backend runs them as they are.
Commands are ``sh`` lines, ``cat`` and ``printenv``: override
``SandboxConformance.long_command`` for an image without ``sleep``.

Needs pytest (this module is only imported by tests). Imports no Airflow.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import pytest

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox._attach import SandboxAttachment, attach_sandbox
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    Sandbox,
    SandboxCapabilities,
    SandboxClosed,
)

__all__ = ["SandboxConformance", "SandboxFactory"]

#: What the backend author's ``sandbox_factory`` fixture returns: a fresh backend per call.
SandboxFactory = Callable[[], Sandbox]

#: Seconds any one wait of the suite may take before the test fails (never a sleep).
WAIT = 30.0


class SandboxConformance:
    """The contract's tests; subclass it as ``Test<YourBackend>`` beside a ``sandbox_factory``
    fixture. Class attributes tune it for a backend without changing what is held."""

    #: A command that runs until stopped (much longer than any test).
    long_command: ClassVar[str] = "sleep 600"
    #: The scope's budget in the kill tests: Airflow's grace is 5 s.
    budget: ClassVar[float] = 5.0
    #: Threads that start and stop at once in the thread-safety tests.
    threads: ClassVar[int] = 6

    # -- fixtures ----------------------------------------------------------------------------

    @pytest.fixture
    def make_sandbox(self, sandbox_factory: SandboxFactory) -> Iterator[SandboxFactory]:
        """The author's factory, with every backend it made destroyed after the test."""
        made: list[Sandbox] = []

        def make() -> Sandbox:
            backend = sandbox_factory()
            made.append(backend)
            return backend

        yield make
        for backend in made:
            backend.destroy()

    @pytest.fixture
    def backend(self, make_sandbox: SandboxFactory) -> Sandbox:
        return make_sandbox()

    # -- the protocol ------------------------------------------------------------------------

    def test_it_is_a_sandbox_and_declares_its_capabilities(self, backend: Sandbox) -> None:
        assert isinstance(backend, Sandbox)
        assert isinstance(backend.capabilities, SandboxCapabilities)

    def test_a_command_runs_and_says_how_it_ended(self, backend: Sandbox) -> None:
        result = backend.wait(backend.start("echo out; exit 3", timeout=WAIT), timeout=WAIT)
        assert (result.exit_code, result.stdout) == (3, "out\n")
        assert not result.ok and not result.stopped and not result.timed_out

    def test_stdin_reaches_the_command(self, backend: Sandbox) -> None:
        """``run_python`` hands its code over on stdin."""
        result = backend.wait(backend.start(["cat"], stdin="piped\n"), timeout=WAIT)
        assert (result.exit_code, result.stdout) == (0, "piped\n")

    def test_a_command_past_its_timeout_is_stopped_and_says_so(self, backend: Sandbox) -> None:
        """The backend enforces ``timeout`` itself: the toolset waits for the result with none."""
        result = backend.wait(backend.start(self.long_command, timeout=0.5), timeout=WAIT)
        assert result.timed_out and result.stopped and not result.ok, result

    def test_env_reaches_the_command_without_a_shell(self, backend: Sandbox) -> None:
        """An argv with ``env=``: no shell is needed to set a variable (an image may have none)."""
        value = uuid.uuid4().hex
        command_id = backend.start(["printenv", "CONFORMANCE_PROBE"], env={"CONFORMANCE_PROBE": value})
        result = backend.wait(command_id, timeout=WAIT)
        assert (result.exit_code, result.stdout) == (0, f"{value}\n")

    def test_stop_stop_all_and_destroy_are_idempotent(self, backend: Sandbox) -> None:
        command_id = backend.start(self.long_command)
        backend.stop(command_id)
        backend.stop(command_id)
        backend.stop("no-such-command")
        backend.stop_all()
        backend.stop_all()
        result = backend.wait(command_id, timeout=WAIT)
        assert result.stopped and not result.ok
        backend.destroy()
        backend.destroy()

    def test_a_start_after_destroy_is_refused(self, backend: Sandbox) -> None:
        backend.destroy()
        with pytest.raises(SandboxClosed):
            backend.start("echo too late")

    # -- a kill ------------------------------------------------------------------------------

    def test_a_kill_stops_a_running_command_and_no_command_starts_after_it(self, backend: Sandbox) -> None:
        """The scope's cancel (what Airflow's SIGTERM becomes) stops the command within the budget,
        and the attachment refuses any start after it."""
        scope, attachment, command_id = self._started_in_a_task(backend)
        results = _waiting_for(backend, command_id)
        scope.cancel(CancelCause.USER)
        assert scope.wait_released(self.budget + WAIT), "the kill did not unwind"
        result = results.get()
        assert result.stopped, f"the kill did not reach the running command: {result}"
        with pytest.raises(TaskCancelled):
            attachment.start("echo after the kill")

    def test_a_kill_is_recorded_on_the_scope(self, backend: Sandbox) -> None:
        """What the kill stopped is on the scope's record (the task log's kill report): at least
        one record with the command's id (a pid only where the backend knows one), written by the
        backend or by its attachment, as its capabilities say, before the scope is released."""
        scope, _, command_id = self._started_in_a_task(backend)
        scope.cancel(CancelCause.USER)
        assert scope.wait_released(self.budget + WAIT), "the kill did not unwind"
        assert command_id in {record.command_id for record in scope.killed}, scope.killed

    def _started_in_a_task(self, backend: Sandbox) -> tuple[TaskCancellation, SandboxAttachment, str]:
        """A task's scope, the backend attached to it and one long command started through the
        attachment. The scope is not made current: a backend must reach it through its
        attachment alone (a tool's thread may not carry the task's context)."""
        scope = TaskCancellation("conformance", budget=self.budget)
        attachment = attach_sandbox(backend, scope, name="conformance")
        return scope, attachment, attachment.start(self.long_command)

    def test_a_kill_destroys_the_backend_and_a_detach_does_not(self, backend: Sandbox) -> None:
        """Ownership: the run that let go of its attachment (it ended without a kill) leaves the
        backend to its maker, still working; a kill destroys every backend attached to the task."""
        ended = TaskCancellation("ended")
        attach_sandbox(backend, ended, name="conformance").detach()
        ended.cancel(CancelCause.USER)  # a later kill of a scope it was let go of: not its kill
        assert ended.wait_released(self.budget + WAIT)
        still = backend.wait(backend.start("echo mine"), timeout=WAIT)
        assert (still.exit_code, still.stdout) == (0, "mine\n"), "a detached backend was destroyed"
        killed = TaskCancellation("killed", budget=self.budget)
        attach_sandbox(backend, killed, name="conformance")
        killed.cancel(CancelCause.USER)
        assert killed.wait_released(self.budget + WAIT)
        with pytest.raises(SandboxClosed):
            backend.start("echo after the kill")

    # -- threads -----------------------------------------------------------------------------

    def test_concurrent_starts_and_stops_stop_every_command(self, backend: Sandbox) -> None:
        """Threads start and stop commands while ``stop_all`` runs beside them: no call fails,
        every command ends stopped."""
        started: list[str] = []
        failures: list[BaseException] = []
        lock = threading.Lock()

        def start_then_stop() -> None:
            try:
                command_id = backend.start(self.long_command)
                with lock:
                    started.append(command_id)
                backend.stop(command_id)
            except BaseException as exc:
                failures.append(exc)

        def stop_everything() -> None:
            try:
                for _ in range(3):
                    backend.stop_all()
            except BaseException as exc:
                failures.append(exc)

        _run_together([start_then_stop] * self.threads + [stop_everything])
        assert failures == []
        assert len(started) == self.threads
        results = [backend.wait(command_id, timeout=WAIT) for command_id in started]
        assert all(result.stopped for result in results), results

    def test_destroy_racing_starts_leaves_no_command_and_refuses_the_rest(self, backend: Sandbox) -> None:
        """A start either returns an id or raises
        [`SandboxClosed`][cancellable_agents.toolsets.sandbox.protocol.SandboxClosed]; after
        ``destroy`` no command it started runs (its result says stopped, or the backend is gone)."""
        started: list[str] = []
        failures: list[BaseException] = []
        lock = threading.Lock()

        def start() -> None:
            try:
                command_id = backend.start(self.long_command)
                with lock:
                    started.append(command_id)
            except SandboxClosed:
                pass
            except BaseException as exc:
                failures.append(exc)

        _run_together([start] * self.threads + [backend.destroy])
        assert failures == []
        with pytest.raises(SandboxClosed):
            backend.start("echo too late")
        for command_id in started:
            try:
                result = backend.wait(command_id, timeout=WAIT)
            except SandboxClosed:
                continue  # a remote backend that is gone has no results to give
            assert result.stopped, f"a command outlived destroy: {result}"


class _Result:
    """One ``wait`` running on its own thread, so a kill can land while it blocks."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.done = threading.Event()
        self.value: CommandResult | BaseException | None = None

    def get(self) -> CommandResult:
        assert self.done.wait(WAIT), f"wait did not return within {WAIT}s"
        if isinstance(self.value, BaseException):
            raise AssertionError(f"wait failed: {self.value!r}") from self.value
        assert self.value is not None
        return self.value


def _waiting_for(backend: Sandbox, command_id: str) -> _Result:
    """A thread blocked in ``backend.wait(command_id)``, returned once it is calling it: a remote
    backend may refuse a ``wait`` that only begins after the kill destroyed it."""
    result = _Result()

    def wait() -> None:
        result.waiting.set()
        try:
            result.value = backend.wait(command_id, timeout=WAIT)
        except BaseException as exc:
            result.value = exc
        result.done.set()

    threading.Thread(target=wait, name=f"conformance-wait-{command_id}", daemon=True).start()
    assert result.waiting.wait(WAIT), "the waiting thread did not start"
    return result


def _run_together(calls: Sequence[Callable[[], object]]) -> None:
    """Start every call on its own thread at the same moment (a barrier), and join them all."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], object]) -> None:
        barrier.wait(WAIT)
        call()

    workers = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WAIT * 2)
    assert not any(worker.is_alive() for worker in workers), "a call did not return"
