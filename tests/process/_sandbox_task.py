"""A stand-in task process for ``test_sandbox_kill.py``.

Usage: ``_sandbox_task.py MODE MARKER`` where MODE is

- ``namespace`` / ``process-group``: a :class:`LocalSandbox` attached to the task's scope runs a
  process tree (incl. ``setsid`` and double-forked children) of ``sleep MARKER``;
- ``reaper``: no sandbox; an async tool of a pydantic-ai agent run (``run_agent_in_scope``)
  starts ``bash -c 'setsid sleep MARKER & sleep MARKER'`` with asyncio, while a
  :class:`DescendantReaper` watches the task process;
- ``reaper-baseline``: a ``sleep MARKER.1`` started *before* the reaper must survive its reap,
  a double-forked ``setsid sleep MARKER.2`` started during the run must not;
- ``reaper-orphans``: orphans reparented to the task process (a ``(sleep &)`` from a shell in its
  own session, bubblewrap's namespace init after the probe) are reaped as they exit, without the
  owner grace, while an exited ``Popen`` child is left for its ``Popen`` to wait for.

Like the mixin's ``on_kill``, the SIGTERM handler only calls ``scope.cancel(...)`` and returns;
the main thread then waits for the release and prints one JSON line: the scope's summary plus
the zombie children left in this process. ``READY`` is printed once the tree is running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.agent_run import run_agent_in_scope
from cancellable_agents.cancellation import TaskCancellation
from cancellable_agents.causes import CancelCause
from cancellable_agents.exceptions import TaskCancelled
from cancellable_agents.process_reaper import DescendantReaper, become_subreaper, children_of, read_proc
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support


def sleepers(marker: str) -> list[int]:
    """Running ``sleep`` processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        info = read_proc(int(entry))
        if cmdline.startswith("sleep ") and marker in cmdline and info is not None and not info.exited:
            found.append(int(entry))
    return found


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"condition not met within {timeout}s")
        time.sleep(0.01)


def ready(**detail: Any) -> None:
    print("READY " + json.dumps(detail), flush=True)


def zombie_children() -> list[int]:
    return [pid for pid in children_of(os.getpid()) if (info := read_proc(pid)) and info.exited]


def report(scope: TaskCancellation, **extra: Any) -> None:
    print(
        json.dumps({"summary": scope.summary(), "zombies": zombie_children(), **extra}, default=str),
        flush=True,
    )


def on_sigterm(scope: TaskCancellation) -> None:
    """What the Task SDK's handler does through ``on_kill``: start the cancel, return at once."""
    signal.signal(signal.SIGTERM, lambda *_: scope.cancel(CancelCause.UNKNOWN))


def sandbox_task(mode: str, marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    box = LocalSandbox(isolation=mode, scope=scope, stop_grace=1.0)  # type: ignore[arg-type]
    # A subreaper, as the mixin makes every task process: the command's orphans come back to us,
    # and the sandbox must collect them itself. (After the sandbox's bwrap probe, whose orphan is
    # the descendant reaper's to collect: see ``reaper_orphans_task``.)
    assert become_subreaper()
    command = box.start(f"setsid sleep {marker} & (sleep {marker} &) ; sleep {marker}")
    wait_for(lambda: len(sleepers(marker)) == 3)
    # The setsid'd sleep is a child of the shell: the tracker sees it within a poll or two.
    wait_for(lambda: len(set(box.descendants(command)) & set(sleepers(marker))) >= 2)
    on_sigterm(scope)
    ready(sleepers=sleepers(marker))
    scope.wait_released(30)
    report(scope)


def reaper_task(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    reaper = DescendantReaper.start(scope)
    assert reaper is not None

    async def spawn_tree() -> str:
        """Start a process tree and wait for it."""
        proc = await asyncio.create_subprocess_exec("bash", "-c", f"setsid sleep {marker} & sleep {marker}")
        while len(sleepers(marker)) < 2:
            await asyncio.sleep(0.01)
        ready(sleepers=sleepers(marker), bash=proc.pid)
        await proc.wait()
        return "finished"

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", [])):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("spawn_tree", {})])

    on_sigterm(scope)
    agent = Agent(FunctionModel(model), tools=[spawn_tree])
    outcome = "completed"
    try:
        run_agent_in_scope(scope, agent, "go")
    except TaskCancelled as exc:
        outcome = f"cancelled: {exc.cause.value}"
    scope.wait_released(30)
    reaper.reap(scope)  # as the mixin's _finish_reaper does
    report(scope, outcome=outcome)


def reaper_baseline_task(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    before = subprocess.Popen(["sleep", f"{marker}1"])
    reaper = DescendantReaper.start(scope)
    assert reaper is not None
    subprocess.run(["sh", "-c", f"(setsid sleep {marker}2 &)"], check=True, timeout=10)
    wait_for(lambda: sleepers(f"{marker}2"))
    wait_for(lambda: set(sleepers(f"{marker}2")) <= set(reaper.descendants()))
    ready(before=before.pid, during=sleepers(f"{marker}2"))
    killed = reaper.reap(scope)
    again = reaper.reap(scope)
    alive = before.poll() is None
    before.kill()
    before.wait(10)
    kills = [k.as_dict() for k in killed]
    report(
        scope,
        before_alive=alive,
        killed=kills,
        second_reap=[k.as_dict() for k in again],
        subreaper=reaper.subreaper,
    )


def reaper_orphans_task(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    reaper = DescendantReaper.start(scope)
    assert reaper is not None
    owned = subprocess.Popen(["sh", "-c", "exit 7"])
    # The shell leads a new session and exits at once: its background sleep is reparented to us
    # before the reaper's first look, so only its session tells that nobody here owns it.
    subprocess.run(["sh", "-c", "(sleep 0.2 &)"], start_new_session=True, check=True, timeout=10)
    bwrap = bwrap_support()  # a fresh process: this really probes, leaving bwrap's init to us
    ready(owned=owned.pid, bwrap=bwrap.usable)
    deadline = time.monotonic() + 5.0
    while set(children_of(os.getpid())) - {owned.pid} and time.monotonic() < deadline:
        time.sleep(0.01)
    orphans_left = sorted(set(children_of(os.getpid())) - {owned.pid})
    owned_exit = owned.wait(5)  # 0 if the reaper had stolen its status

    # With polling stopped, an orphan that exits is first met by reap() itself, which must not
    # wait an owner grace for it (made huge here, so waiting cannot go unnoticed).
    reaper.close()
    reaper.owner_grace = 30.0
    subprocess.run(["sh", "-c", "(exit 3 &)"], start_new_session=True, check=True, timeout=10)
    wait_for(zombie_children)
    started = time.monotonic()
    reaper.reap(scope)
    reap_s = time.monotonic() - started
    report(scope, orphans_left=orphans_left, owned_exit=owned_exit, reap_s=reap_s)


def main() -> None:
    mode, marker = sys.argv[1], sys.argv[2]
    if mode in ("namespace", "process-group"):
        sandbox_task(mode, marker)
    elif mode == "reaper":
        reaper_task(marker)
    elif mode == "reaper-baseline":
        reaper_baseline_task(marker)
    elif mode == "reaper-orphans":
        reaper_orphans_task(marker)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
