"""A stand-in for outside work a tool starts and defers to (a Spark or dbt job, a batch
inference, a review in another system), for examples and tests: a job is a JSON file under a
directory, and nothing runs on the task's worker while it waits.

A job is finished by :func:`finish` (a test's hand, or whatever does the work), or by the clock
when it was started with ``seconds`` (a job that takes that long); :func:`cancel` stops it, as a
real job's cancel API would. :func:`status` is the :class:`~cancellable_agents.PollTrigger`
protocol (``None`` while running, the result once done), so the triggerer, which imports it by
name, needs nothing but this package. Stdlib only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def _path(root: str, job: str) -> Path:
    return Path(root) / f"{job}.json"


def start(root: str, job: str, seconds: float | None = None, result: Any = None) -> str:
    """Start ``job``: it runs until :func:`finish` or :func:`cancel`, or for ``seconds`` (then
    its result is ``result``). Returns the job file's path."""
    Path(root).mkdir(parents=True, exist_ok=True)
    path = _path(root, job)
    due = None if seconds is None else time.time() + seconds
    path.write_text(json.dumps({"state": "running", "due": due, "result": result}))
    return str(path)


def finish(root: str, job: str, result: Any) -> None:
    _path(root, job).write_text(json.dumps({"state": "done", "result": result}))


def status(root: str, job: str, events_fd: int | None = None) -> Any:
    """``None`` while ``job`` runs, its result once done (the PollTrigger protocol); raises for a
    cancelled job. ``events_fd``: a process test's event pipe, told of each poll (so the test
    knows the trigger waits, without sleeping)."""
    state = json.loads(_path(root, job).read_text())
    if events_fd is not None:
        line = {"event": "polled", "job": job, "state": state["state"], "t": time.monotonic()}
        os.write(events_fd, (json.dumps(line) + "\n").encode())
    if state["state"] == "cancelled":
        raise RuntimeError(f"job {job} was cancelled")
    if state["state"] == "done" or (state.get("due") is not None and time.time() >= state["due"]):
        return state["result"]
    return None


def cancel(root: str, job: str, **_: Any) -> None:
    """Stop ``job`` (what a trigger's ``on_kill`` calls); extra keyword arguments (the status
    call's, such as ``events_fd``) are ignored."""
    state = json.loads(_path(root, job).read_text())
    _path(root, job).write_text(json.dumps({**state, "state": "cancelled", "cancelled_at": time.time()}))


def state_of(root: str, job: str) -> str:
    return str(json.loads(_path(root, job).read_text())["state"])
