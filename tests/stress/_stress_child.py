"""The stress test's task process: many runs, each killed (or timed out) when the parent decides.

Per plan (one JSON line on stdin) it builds a fresh ``AgentOperator`` whose model is the local
server and whose tools are drawn by the parent (an async tool running a ``sleep`` subprocess, a
cooperative sync tool, the sandbox's ``run_shell``, a sub-agent, a slow-to-tear-down toolset), runs
it the way the Task SDK does (:mod:`tests.taskproc`: the real ``_on_term`` shape, the real
SIGALRM ``timeout``), and after the parent said ``proceed`` (every SIGTERM it sent has been
delivered) checks the invariants that need the inside view, waits (within the budget) for the
provider's threads to end, and reports. The cause query the Task SDK would answer through the
supervisor is answered by a stand-in that returns the task state the parent drew (``failed``,
``restarting``, ``running``), is slow (``hang``: longer than the classifier's limit) or fails.

Events (JSON lines on the inherited fd): ``started``, ``waiting_for_kill``, ``tool_started``,
``subagent_started``, ``teardown_started``, ``after_result``, ``finished``, ``report``.
A run with a violation, or one that ended in ``AirflowTaskTimeout`` (SIGALRM tore through the event
loop, which a real task process never reuses), ends this process after its report.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.toolsets import FunctionToolset

import cancellable_agents.airflow._adapter as adapter
from cancellable_agents import AgentOperator, TaskCancelled, current_cancellation
from cancellable_agents.airflow._adapter import verdict_for_state
from cancellable_agents.airflow.task_try import cancellation_of, try_of
from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.scope import Outcome
from cancellable_agents.hooks.model import build_model
from cancellable_agents.toolsets.sandbox import SandboxToolset
from cancellable_agents.toolsets.subagent_tools import run_subagent
from tests.kill_scenarios import CONN_ID, base_url, drain_events, model_string, warm_up
from tests.taskproc import (
    Channel,
    FakeTI,
    SignalLatch,
    execute_like_task_sdk,
    install_sigterm_handler,
    our_threads,
)

channel = Channel()
emit = channel.emit

#: What the stand-in for ``get_task_states`` answers; set per run.
_STATE = {"state": "running"}
#: How long the ``hang`` answer takes: past the classifier's 1 s limit, inside the 4 s budget.
HANG_SECONDS = 1.5

EXPECTED_CAUSE = {
    "failed": CancelCause.USER,
    "restarting": CancelCause.USER,
    "running": CancelCause.EVICTION,
    "hang": CancelCause.UNKNOWN,
    "error": CancelCause.UNKNOWN,
}


def fake_classify_sigterm(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> CauseVerdict:
    """Stands in for the supervisor round-trip (3-40 ms in a real Airflow)."""
    state = _STATE["state"]
    if state == "hang":
        time.sleep(HANG_SECONDS)
        return verdict_for_state("running")
    time.sleep(0.005)
    if state == "error":
        raise RuntimeError("the supervisor did not answer")
    return verdict_for_state(state)


class _OnKillLog(logging.Handler):
    """Collects the warnings the mixin writes when an ``on_kill`` failed inside it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "on_kill failed" in message:
            self.messages.append(message)


ON_KILL_LOG = _OnKillLog()


# -- the run's parts ------------------------------------------------------------------------


class SlowTeardown(FunctionToolset[Any]):
    """A toolset whose ``__aexit__`` takes a while (like closing a remote session)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def __aexit__(self, *args: Any) -> bool | None:
        emit("teardown_started")
        done = asyncio.ensure_future(asyncio.sleep(self.seconds))
        while not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(done)  # a teardown finishes even when cancelled again
        return await super().__aexit__(*args)


def _tools(plan: dict[str, Any]) -> tuple[list[Any], list[Any], list[str]]:
    """The run's tools and toolsets, and the names the model calls (all take ``command``)."""
    marker, spec = plan["marker"], plan["tools"]
    tools: list[Any] = []
    toolsets: list[Any] = [SlowTeardown(plan["teardown_ms"] / 1000)]
    names: list[str] = []
    if spec.get("async_ms") is not None:
        seconds = spec["async_ms"] / 1000

        async def async_wait(command: str) -> str:
            """Run a program for a while."""
            proc = await asyncio.create_subprocess_exec("sleep", marker)
            emit("tool_started", tool="async_wait")
            try:
                await asyncio.wait_for(proc.wait(), seconds)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
            return "ok"

        tools.append(async_wait)
        names.append("async_wait")
    if spec.get("sync_ms") is not None:
        seconds = spec["sync_ms"] / 1000

        def sync_wait(command: str) -> str:
            """Wait for something, checking for cancellation."""
            emit("tool_started", tool="sync_wait")
            scope = current_cancellation()
            if scope is None:
                raise RuntimeError("a sync tool must see the run's scope")
            return "cancelled" if scope.wait(seconds) else "ok"

        tools.append(sync_wait)
        names.append("sync_wait")
    if spec.get("busy_ms") is not None:
        busy_seconds = spec["busy_ms"] / 1000

        def busy_work(command: str) -> str:
            """Crunch for a while without looking at cancellation (ends well inside the budget)."""
            emit("tool_started", tool="busy_work")
            deadline = time.monotonic() + busy_seconds
            while time.monotonic() < deadline:
                time.sleep(0.002)  # busy work: this thread keeps running when the SIGTERM arrives
            return "ok"

        tools.append(busy_work)
        names.append("busy_work")
    if spec.get("shell"):
        toolsets.append(SandboxToolset(isolation=spec["shell"]))
        names.append("run_shell")
    if spec.get("subagent_tokens"):
        leaf = Agent(
            build_model(
                "openai:" + model_string("slow", tokens=spec["subagent_tokens"], delay=0.01),
                base_url=base_url(),
            )
        )

        async def delegate_work(command: str) -> str:
            """Ask a helper agent."""
            emit("subagent_started")
            result = await run_subagent(leaf, "dig", name="helper", event_stream_handler=drain_events)
            return str(result.output)

        tools.append(delegate_work)
        names.append("delegate_work")
    return tools, toolsets, names


def build_task(plan: dict[str, Any]) -> Any:
    """A fresh ``AgentOperator`` for ``plan``: the model script calls every drawn tool at once."""
    tools, toolsets, names = _tools(plan)
    delay = plan["delay_first"]
    if plan["timeout"]:
        behaviour = model_string("slow", tokens=400, delay=0.01)
    elif names:
        command = f"setsid sleep {plan['marker']} & sleep {plan['tools'].get('shell_s', 0.1)}"
        behaviour = model_string(
            "tools", names=",".join(names), args={"command": command}, then="done", delay_first=delay
        )
    else:
        behaviour = model_string("slow", tokens=plan["tokens"], delay=0.01, delay_first=delay)
    kwargs: dict[str, Any] = {}
    if plan["phase"] == "pre_execute":
        kwargs["pre_execute"] = _wait_for_kill_hook
    if plan["timeout"]:
        kwargs["execution_timeout"] = timedelta(seconds=plan["timeout"]["seconds"])
    task = AgentOperator(
        task_id="agent",
        prompt="go",
        llm_conn_id=CONN_ID,
        model=f"openai:{behaviour}",
        stream=True,
        tools=tools,
        toolsets=toolsets,
        **kwargs,
    )
    if plan["timeout"]:
        task.timeout_margin = plan["timeout"]["margin"]
    return task


_SEEN = SignalLatch()


def _wait_for_kill_hook(context: Any) -> None:
    """The ``pre_execute=`` hook of the ``pre_execute`` phase: the kill lands while it runs."""
    emit("waiting_for_kill")
    _SEEN.wait(10)


# -- one run --------------------------------------------------------------------------------


class Run:
    """One planned run: what happened, as the task process saw it."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.task = build_task(plan)
        self.signals: list[float] = []
        self.before_result: bool | None = None
        self.ti_known = False
        self.escaped: list[str] = []
        self.exc: BaseException | None = None
        self.returned = False
        self.ended_at = 0.0
        self.phase_at_kill: str | None = None
        self._wrap_on_kill()

    def _wrap_on_kill(self) -> None:
        original = self.task.on_kill

        def on_kill() -> None:
            try:
                original()
            except BaseException as exc:  # recorded, then raised on as the SDK's handler would
                self.escaped.append(repr(exc))
                raise

        self.task.on_kill = on_kill

    def scope(self) -> Any:
        return cancellation_of(self.task)

    def on_signal(self) -> None:
        if not self.signals:
            scope = self.scope()
            self.before_result = scope is None or scope.outcome is None
            task_try = try_of(self.task)
            self.ti_known = task_try is not None and task_try.key is not None
        self.signals.append(time.monotonic())
        _SEEN.set()

    def execute(self) -> None:
        _SEEN.clear()
        _STATE["state"] = self.plan["state"]
        install_sigterm_handler(self.task, before=self.on_signal)
        context = {"ti": FakeTI("agent", f"run_{self.plan['run']}"), "task": self.task}
        emit("started", run=self.plan["run"])
        if self.plan["phase"] == "before_start":
            emit("waiting_for_kill")
            _SEEN.wait(10)
        try:
            execute_like_task_sdk(self.task, context)
            self.returned = True
        except BaseException as exc:
            self.exc = exc
        self.ended_at = time.monotonic()
        if self.plan["phase"] == "after_result" and self.returned:
            emit("after_result")
            _SEEN.wait(10)

    def outcome(self) -> str:
        return "returned" if self.returned else f"raised {type(self.exc).__name__}"


def check(run: Run) -> list[str]:
    """The invariants that need the inside view; an empty list means the run was correct."""
    violations: list[str] = []
    scope = run.scope()
    events = [e.event for e in scope.timeline] if scope is not None else []
    if scope is None:
        return ["no cancellation scope was ever created"]
    if events.count("run_settled") != 1:
        violations.append(f"{events.count('run_settled')} terminal outcomes recorded (want exactly 1)")
    if events.count("kill_received") > 1:
        violations.append(f"kill_received recorded {events.count('kill_received')} times")
    if run.escaped or ON_KILL_LOG.messages:
        violations.append(f"an exception escaped on_kill: {run.escaped or ON_KILL_LOG.messages}")
    if run.plan["timeout"]:
        violations += _check_timeout(run, scope)
    elif not run.signals:
        violations.append("no SIGTERM reached the task process")
    elif run.before_result:
        violations += _check_cancelled(run, scope)
    else:
        violations += _check_completed(run, scope, events)
    return violations


def _check_cancelled(run: Run, scope: Any) -> list[str]:
    out = []
    if not isinstance(run.exc, TaskCancelled):
        return [f"killed before the result, but execute {run.outcome()}"]
    if scope.outcome is not Outcome.CANCELLED:
        out.append(f"killed before the result, but the scope's outcome is {scope.outcome}")
    # A kill before the task instance was known is remembered, and its cause asked for once the
    # try knows who it is: classified like any other.
    expected = EXPECTED_CAUSE[run.plan["state"]]
    if run.exc.cause is not expected or scope.cause is not expected:
        early = "" if run.ti_known else " (the kill came before the task instance was known)"
        out.append(
            f"cause {run.exc.cause.value} (scope: {scope.cause}) for task state {run.plan['state']!r}, "
            f"want {expected.value}{early}"
        )
    return out


def _check_completed(run: Run, scope: Any, events: list[str]) -> list[str]:
    if not run.returned:
        return [f"killed after the result, but execute {run.outcome()} ({run.exc!r:.200})"]
    out = []
    if scope.outcome is not Outcome.COMPLETED:
        out.append(f"killed after the result, but the outcome is {scope.outcome}")
    if "kill_received" in events or "cancel_ignored" not in events:
        out.append("a kill after the result must be a logged no-op (cancel_ignored, no kill_received)")
    return out


def _check_timeout(run: Run, scope: Any) -> list[str]:
    name = type(run.exc).__name__ if run.exc is not None else None
    if run.returned or name not in ("TaskCancelled", "AirflowTaskTimeout"):
        return [f"execution_timeout: execute {run.outcome()} ({run.exc!r:.200})"]
    if isinstance(run.exc, TaskCancelled) and run.exc.cause is not CancelCause.TIMEOUT:
        return [f"execution_timeout: cause {run.exc.cause.value}, want timeout"]
    if scope.cause is not CancelCause.TIMEOUT:
        return [f"execution_timeout: the scope's cause is {scope.cause}, want timeout"]
    return []


#: Threads that live as long as the process by design, one at most (the sandbox's spawner: a
#: command's ``--die-with-parent`` is tied to the thread that forked it).
PROCESS_WIDE = ("cancellable-agents-spawner",)


def wait_for_threads(run: Run, baseline: list[str]) -> list[str]:
    """Our threads still alive at the end of the budget (counted from the kill or the run's end)."""
    start = run.signals[0] if run.signals else run.ended_at
    deadline = start + run.task.cancellation_budget + 0.5
    while True:
        left = _new_threads(baseline)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.005)  # threads ending is not an event we can await from outside them


def _new_threads(baseline: list[str]) -> list[str]:
    now = our_threads()
    left = [name for name in now if name not in baseline and name not in PROCESS_WIDE]
    left += [name for name in PROCESS_WIDE if now.count(name) > 1]
    return left


def main() -> None:
    # The parent asks for every thread's stack (SIGUSR1) before it gives up on a hung run.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.getLogger("cancellable_agents").addHandler(ON_KILL_LOG)
    adapter.classify_sigterm = fake_classify_sigterm  # type: ignore[assignment]
    warm_up()
    lines = iter(sys.stdin)
    for line in lines:
        plan = _json(line)
        print(f"--- run {plan['run']}: {json.dumps(plan)}", file=sys.stderr, flush=True)
        baseline = our_threads()
        run = Run(plan)
        run.execute()
        emit("finished", outcome=run.outcome(), at=run.ended_at)
        proceed = _json(next(lines, "{}"))
        if proceed.get("signals"):
            _SEEN.wait(2)  # a handler can run a few bytecodes after the line arrived
        violations = check(run)
        threads = wait_for_threads(run, baseline)
        if threads:
            violations.append(f"threads of ours alive after the budget: {threads}")
        ON_KILL_LOG.messages.clear()
        scope = run.scope()
        exiting = bool(violations) or type(run.exc).__name__ == "AirflowTaskTimeout"
        emit(
            "report",
            violations=violations,
            outcome=run.outcome(),
            signals=len(run.signals),
            before_result=run.before_result,
            cause=scope.cause.value if scope is not None and scope.cause else None,
            phase_events=[e.event for e in scope.timeline][-12:] if scope is not None else [],
            exiting=exiting,
        )
        if exiting:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the Task SDK's fork wrapper ends a task process


def _json(line: str) -> dict[str, Any]:
    return json.loads(line) if line.strip() else {}


if __name__ == "__main__":
    main()
