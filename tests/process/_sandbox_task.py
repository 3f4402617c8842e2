"""A stand-in task process for ``test_sandbox_kill.py``.

Usage: ``_sandbox_task.py MODE MARKER`` where MODE is

- ``namespace`` / ``process-group``: a :class:`LocalSandbox` attached to the task's scope runs a
  process tree (incl. ``setsid`` and double-forked children) of ``sleep MARKER``;
- ``reaper``: no sandbox; an async tool of a pydantic-ai agent run (``run_agent_in_scope``)
  starts ``bash -c '(sleep 1; exec setsid sleep MARKER) & sleep MARKER'`` with asyncio, while a
  :class:`DescendantReaper` watches the task process;
- ``reaper-baseline``: a ``sleep MARKER.1`` started *before* the reaper must survive its reap,
  a double-forked ``setsid sleep MARKER.2`` started during the run must not;
- ``hostile SECRETS``: per command of :data:`HOSTILE`, a boundary-profile :class:`LocalSandbox`
  (small limits, no network) first runs it to its end (the results, as the model reads them, go
  into ``READY``), then starts its long-running form; all are running when the test's SIGTERM
  lands; the report says whether anything outside changed (the loopback listener);
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
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.procs._proc import become_subreaper, children_of, read_proc
from cancellable_agents.procs._reaper import DescendantReaper
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.toolsets.sandbox import Limits, LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.sandbox_tools import _for_model

#: Small limits, so the hostile commands hit them in milliseconds.
HOSTILE_LIMITS = Limits(max_processes=32, file_size_bytes=1_500_000, tmp_bytes=4 * 1024 * 1024, cpu_seconds=5)
FORKS = (
    "import os, subprocess\nstarted = 0\nfor _ in range(500):\n    try:\n"
    "        subprocess.Popen(['sleep', '{sleep}'])\n        started += 1\n"
    "    except OSError:\n        pass\n"
)
WAIT = "os.execvp('sleep', ['sleep', '{m}'])"
#: name -> (probe: runs to its end, running: still running at the SIGTERM; "{m}" is the marker).
#: ``{secrets}``, ``{host}``, ``{port}``, ``{task}``, ``{supervisor}``, ``{python}`` are filled in per run.
HOSTILE: dict[str, tuple[str, str]] = {
    "read-secrets": (
        "cat {secrets}/airflow/airflow.cfg {secrets}/home/.aws/credentials",
        "cat {secrets}/home/.aws/credentials; sleep {m}",
    ),
    "connect-loopback": (
        "{python} -c \"import socket; socket.create_connection(('{host}', {port}), 2); print('in')\"",
        "{python} -c \"import socket; socket.create_connection(('{host}', {port}), 2)\"; sleep {m}",
    ),
    "kill-task-and-supervisor": ("kill -9 {task} {supervisor}", "kill -9 {task} {supervisor}; sleep {m}"),
    # Forks until the process limit stops it (at most 500), then reports or waits.
    "fork-bomb": (
        f'{{python}} -c "{FORKS.replace("{sleep}", "1{m}")}print(started)"',
        f'{{python}} -c "{FORKS.replace("{sleep}", "{m}")}{WAIT}"',
    ),
    "fill-disk": (
        "head -c 2000000 /dev/zero > big; echo big=$?; i=0; "
        "while head -c 1000000 /dev/zero > ${{TMPDIR:-/tmp}}/f$i; do i=$((i+1)); done; echo tmp_files=$i",
        "yes > ${{TMPDIR:-/tmp}}/fill; sleep {m}",
    ),
    "ignore-sigterm": ("trap '' TERM; kill -TERM $$; echo still here", "trap '' TERM; sleep {m}; sleep {m}"),
    "double-fork-daemon": (
        "( ( setsid sh -c 'trap \"\" TERM HUP; exec sleep 1{m}' & ) & ); echo daemonized",
        "( ( setsid sh -c 'trap \"\" TERM HUP; exec sleep {m}' & ) & ); sleep {m}",
    ),
}
#: How many ``sleep {m}`` the running form has once it is in full swing.
HOSTILE_SLEEPERS = {"fork-bomb": 20, "ignore-sigterm": 1, "double-fork-daemon": 2}


class Listener:
    """A real TCP listener on loopback, counting the connections it accepted.

    It listens on an address of 127.0.0.0/8 drawn per listener (Linux routes the whole block to
    ``lo``), not on 127.0.0.1: in CI another lane's client may retry an ephemeral port of a server
    it lost, and a port number alone could land it here, counted as the sandbox's connection."""

    def __init__(self) -> None:
        host = f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"
        self.sock = socket.create_server((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


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


def zombie_children() -> list[str]:
    """``pid:name`` of this process's children that exited and nobody reaped."""
    return [
        f"{pid}:{info.name}" for pid in children_of(os.getpid()) if (info := read_proc(pid)) and info.exited
    ]


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


def hostile_task(marker: str, secrets: str, isolation: str, left_out: frozenset[str] = frozenset()) -> None:
    """Every command of :data:`HOSTILE` but ``left_out`` (those the worker cannot hold: see the
    test), each in its own sandbox (``isolation``: a boundary mode): probes first, one by one,
    then all the running forms at once, and one SIGTERM for the lot."""
    scope = TaskCancellation("task", budget=4.0)
    if isolation == "namespace":
        assert bwrap_support().boundary  # probed first: the probes' orphans are not the sandbox's to reap
    assert become_subreaper()
    listener = Listener()
    fill = {"secrets": secrets, "host": listener.host, "port": listener.port}
    fill |= {"task": os.getpid(), "supervisor": os.getppid()}
    boxes, results = {}, {}
    rows = {name: commands for name, commands in HOSTILE.items() if name not in left_out}
    for name, (probe, running) in rows.items():
        box = LocalSandbox(isolation=isolation, scope=scope, stop_grace=1.0, limits=HOSTILE_LIMITS)  # type: ignore[arg-type]
        boxes[name] = box
        fill["python"] = box.python
        started = time.monotonic()
        results[name] = _for_model(box.run(probe.format(m=marker, **fill), timeout=20), 20)
        results[name]["seconds"] = round(time.monotonic() - started, 3)
        box.start(running.format(m=marker, **fill))
    wait_for(lambda: len(sleepers(marker)) >= sum(HOSTILE_SLEEPERS.get(name, 1) for name in rows))
    on_sigterm(scope)
    ready(results=results, sleepers=len(sleepers(marker)))
    scope.wait_released(30)
    listener.sock.close()
    left = [name for name, box in boxes.items() if box.workdir.exists()]
    report(scope, accepted=listener.accepted, workdirs_left=left)


def reaper_task(marker: str) -> None:
    scope = TaskCancellation("task", budget=4.0)
    reaper = DescendantReaper.start(scope)
    assert reaper is not None

    async def spawn_tree() -> str:
        """Start a process tree and wait for it."""
        # The subshell is a bash for 1 s (the reaper sees it so), then becomes the setsid'd sleep.
        script = f"(sleep 1; exec setsid sleep {marker}) & sleep {marker}"
        proc = await asyncio.create_subprocess_exec("bash", "-c", script)
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
    if mode in ("namespace", "landlock", "process-group"):
        sandbox_task(mode, marker)
    elif mode == "hostile":
        hostile_task(
            marker,
            sys.argv[3],
            sys.argv[4],
            frozenset(filter(None, sys.argv[5:6][0].split(","))) if sys.argv[5:] else frozenset(),
        )
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
