"""A stand-in for outside work a tool starts and defers to (a Spark or dbt job, a batch
inference, a review in another system), for examples and tests: a job is a JSON file under a
directory, and nothing runs on the task's worker while it waits.

A job is finished by `finish` (a test's hand, or whatever does the work), or by the clock
when it was started with ``seconds`` (a job that takes that long); [`cancel`][] stops it, as a
real job's cancel API would. [`status`][] is the
[`PollTrigger`][cancellable_agents.airflow.triggers.PollTrigger] protocol (``None`` while running, the result
once done), so the triggerer, which imports it by name, needs nothing but this package. Stdlib only.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["acancel", "cancel", "finish", "last_polled", "start", "state_of", "status"]


def _path(root: str, job: str) -> Path:
    return Path(root) / f"{job}.json"


def _replace(path: Path, text: str) -> None:
    """Replace ``path`` in one step: another process reads it at any moment (the triggerer's poll
    the job's state, a test the poll's time), and a half-written file would be read as garbage."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _write(root: str, job: str, state: dict[str, Any]) -> None:
    _replace(_path(root, job), json.dumps(state))


def start(root: str, job: str, seconds: float | None = None, result: Any = None) -> str:
    """Start ``job``: it runs until `finish` or [`cancel`][], or for ``seconds`` (then
    its result is ``result``). Returns the job file's path."""
    Path(root).mkdir(parents=True, exist_ok=True)
    due = None if seconds is None else time.time() + seconds
    _write(root, job, {"state": "running", "due": due, "result": result})
    return str(_path(root, job))


def finish(root: str, job: str, result: Any) -> None:
    _write(root, job, {"state": "done", "result": result})


def status(root: str, job: str, events_fd: int | None = None, **_: Any) -> Any:
    """``None`` while ``job`` runs, its result once done (the PollTrigger protocol); raises for a
    cancelled job. Each poll leaves its time for [`last_polled`][]: a trigger is waiting on the
    job, and so a user's stop reaches its ``on_kill``. ``events_fd``: a process test's event
    pipe, told of each poll (so the test knows the trigger waits, without sleeping); other
    keyword arguments (the cancel call's) are ignored."""
    state = json.loads(_path(root, job).read_text())
    _note_poll(root, job)
    if events_fd is not None:
        line = {"event": "polled", "job": job, "state": state["state"], "t": time.monotonic()}
        os.write(events_fd, (json.dumps(line) + "\n").encode())
    if state["state"] == "cancelled":
        raise RuntimeError(f"job {job} was cancelled")
    if state["state"] == "done" or (state.get("due") is not None and time.time() >= state["due"]):
        return state["result"]
    return None


def _polled_path(root: str, job: str) -> Path:
    return Path(root) / f"{job}.polled"


def _note_poll(root: str, job: str) -> None:
    _replace(_polled_path(root, job), repr(time.time()))


def last_polled(root: str, job: str) -> float | None:
    """When a trigger last polled ``job`` (``time.time()``), or ``None`` if none has yet."""
    try:
        return float(_polled_path(root, job).read_text())
    except FileNotFoundError:
        return None


def cancel(root: str, job: str, **_: Any) -> None:
    """Stop ``job`` (what a trigger's ``on_kill`` calls); extra keyword arguments (the status
    call's, such as ``events_fd``) are ignored."""
    state = json.loads(_path(root, job).read_text())
    _write(root, job, {**state, "state": "cancelled", "cancelled_at": time.time()})


async def acancel(root: str, job: str, answer_s: float = 0.0, **_: Any) -> None:
    """[`cancel`][] as an ``async`` job API whose cancel call takes ``answer_s`` seconds to
    answer (a remote service's), on the triggerer's event loop; the job stops at the answer."""
    await asyncio.sleep(answer_s)
    cancel(root, job)


def state_of(root: str, job: str) -> str:
    return str(json.loads(_path(root, job).read_text())["state"])
