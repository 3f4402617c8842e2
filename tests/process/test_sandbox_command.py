"""One sandbox command's process tree (``toolsets/sandbox/local/_command.py``), for real, in both
isolation modes: bounded output, the per-command timeout, leftovers killed when the command
ends, stops of the whole tree (setsid, double forks, the tag) and SIGKILL at the grace.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support
from tests.process.trees import MODES, eventually, sleepers, survivors

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


# -- a command on its own -------------------------------------------------------------------


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


def test_per_command_timeout_stops_the_tree(sandbox: LocalSandbox, marker: str) -> None:
    started = time.monotonic()
    result = sandbox.run(f"sleep {marker} & sleep {marker}", timeout=0.3)
    assert time.monotonic() - started < 3
    assert result.timed_out and result.stopped
    assert result.exit_code == -signal.SIGTERM
    assert survivors(marker) == []


def test_background_processes_do_not_outlive_their_command(sandbox: LocalSandbox, marker: str) -> None:
    result = sandbox.run(f"sleep {marker} >/dev/null 2>&1 & echo started", timeout=10)
    assert result.exit_code == 0 and result.stdout == "started\n"
    eventually(lambda: survivors(marker) == [], timeout=2)


# -- stop() kills the whole tree ------------------------------------------------------------


def test_a_stopped_command_that_exits_0_is_still_stopped(sandbox: LocalSandbox, marker: str) -> None:
    command = sandbox.start(f"trap 'exit 0' TERM; sleep {marker} & wait")
    eventually(lambda: sleepers(marker))
    sandbox.stop(command)
    result = sandbox.wait(command, timeout=2)
    assert result.stopped and not result.ok
    assert result.exit_code == -signal.SIGTERM


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
