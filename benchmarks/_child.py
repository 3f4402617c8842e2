"""The benchmark's task process: runs repetitions the parent sends, one fresh operator each.

Per command ``{"scenario", "impl", "marker", "rep"}`` it builds the operator, installs the Task
SDK's SIGTERM handler for it, runs it like the Task SDK (:mod:`tests.taskproc`) and reports
``started``, ``signal`` (handler entered), ``ready`` (before-run only), ``trigger`` (timeout only),
``raised`` / ``returned``, and ``rep_done``. A repetition that leaves a tool thread running, or
ends in anything but a cancellation, ends this process the way a real task process ends after
``execute`` (``os._exit`` from the supervisor's fork wrapper: threads die, started processes
do not); the parent then starts a fresh child.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from typing import Any

from tests import kill_scenarios as scenarios
from tests.taskproc import (
    Channel,
    SignalLatch,
    execute_like_task_sdk,
    install_sigterm_handler,
    marker_processes,
)

from cancellable_agents.airflow.task_try import cancellation_of

channel = Channel()
seen = SignalLatch()


def run_rep(command: dict[str, Any]) -> bool:
    """Run one repetition; return whether this process can serve another one."""
    scenario = scenarios.BY_NAME[command["scenario"]]
    rep = scenarios.Rep(scenario, command["impl"], command["marker"], channel.emit, set())
    task = scenarios.build_task(rep)
    seen.clear()

    def on_signal() -> None:
        channel.emit("signal")
        seen.set()

    install_sigterm_handler(task, before=on_signal)
    channel.emit("started", rep=command["rep"])
    if scenario.ready == "ready":
        channel.emit("ready")
        if not seen.wait(30):
            channel.emit("no_signal")
    armed: list[float] = []
    outcome, exc_type = "returned", ""
    try:
        execute_like_task_sdk(task, {}, timeout_armed=lambda: armed.append(time.monotonic()))
    except BaseException as exc:
        outcome, exc_type = "raised", type(exc).__name__
    ended = time.monotonic()
    if scenario.trigger == "timeout":
        channel.emit("trigger", at=_timeout_trigger(task, armed))
    channel.emit(outcome, at=ended, exc_type=exc_type, cause=_cause(task))
    clean = outcome == "raised" and exc_type in ("TaskCancelled", "RunCancelled") and not _alive(rep)
    channel.emit(
        "rep_done",
        clean=clean,
        threads=[t.name for t in rep.tool_threads if t.is_alive()],
        processes=len(marker_processes(rep.marker)) if scenario.marker_count else 0,
    )
    return clean


def _timeout_trigger(task: Any, armed: list[float]) -> float:
    """When the implementation's timeout fires: our run's own deadline, else Airflow's SIGALRM."""
    scope = cancellation_of(task)
    if scope is not None:
        return float(scope.created_at + scenarios.TIMEOUT_SECONDS - task.timeout_margin)
    return armed[0] + scenarios.TIMEOUT_SECONDS


def _cause(task: Any) -> str | None:
    scope = cancellation_of(task)
    return scope.cause.value if scope is not None and scope.cause is not None else None


def _alive(rep: scenarios.Rep) -> bool:
    return any(t.is_alive() for t in rep.tool_threads)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's dump_stacks()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    scenarios.warm_up()
    for command in Channel.commands():
        if not run_rep(command):
            break
    sys.stdout.flush()
    sys.stderr.flush()
    # As the Task SDK's fork wrapper ends a task process: no thread is waited for.
    os._exit(0)


if __name__ == "__main__":
    main()
