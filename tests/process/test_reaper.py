"""The descendant reaper (``procs/_reaper.py``) in a real task process that is a subreaper:
what a run started without a sandbox is killed and reaped on a real SIGTERM, what existed
before the run is spared, orphans are reaped at once and owned children left to their owner.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from tests.process.trees import ChildTask, survivors

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def test_sigterm_to_the_task_pid_reaps_what_an_async_tool_started_without_a_sandbox(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper", marker)
    ready = task.ready()
    os.kill(task.proc.pid, signal.SIGTERM)
    record = task.result()
    assert survivors(marker) == []
    assert record["outcome"] == "cancelled: unknown"
    assert record["zombies"] == [], "orphans reparented to the subreaper must be reaped"
    killed = {k["pid"]: k["command"] for k in record["summary"]["killed"]}
    assert set(ready["sleepers"]) <= set(killed), record["summary"]["killed"]
    # Named as they were when killed: the setsid'd one was seen as a bash for its first second.
    assert all(killed[pid] == f"sleep {marker}" for pid in ready["sleepers"]), killed


def test_reaper_spares_what_existed_before_the_run_and_is_idempotent(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper-baseline", marker)
    ready = task.ready()
    record = task.result()
    assert record["subreaper"] is True
    assert record["before_alive"] is True
    assert {k["pid"] for k in record["killed"]} == set(ready["during"])
    assert record["second_reap"] == []
    assert record["zombies"] == []
    assert survivors(f"{marker}2") == []


def test_reaper_reaps_reparented_orphans_at_once_and_leaves_owned_children_to_their_owner(
    marker: str, child_tasks: Callable[..., ChildTask]
) -> None:
    task = child_tasks("reaper-orphans", marker)
    task.ready()
    record = task.result()
    assert record["orphans_left"] == [], "orphans reparented to the subreaper must be reaped as they exit"
    assert record["owned_exit"] == 7, "a Popen child's exit status must be left for its Popen"
    assert record["reap_s"] < 2.0, "reap() waited an owner grace for an orphan nobody here owns"
    assert record["zombies"] == []
