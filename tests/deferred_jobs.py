"""A stand-in for outside work a tool starts (a Spark job, a batch inference): a job is a file
under a directory, its status the file's content, and it is cancelled by writing that. Importable
by name (the triggers name their callables by import path), and shared by the unit and process
tests: a test reads what happened to the job from the file, not from the process that did it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def start(root: str, job: str) -> str:
    """Start ``job``: it runs until :func:`finish` or :func:`cancel`."""
    path = Path(root) / f"{job}.json"
    path.write_text(json.dumps({"state": "running"}))
    return str(path)


def finish(root: str, job: str, result: Any) -> None:
    (Path(root) / f"{job}.json").write_text(json.dumps({"state": "done", "result": result}))


def status(root: str, job: str, events_fd: int | None = None) -> Any:
    """``None`` while ``job`` runs, its result once done (the PollTrigger protocol).
    ``events_fd``: a process test's event pipe, told of each poll (so the test knows the
    trigger waits, without sleeping)."""
    state = json.loads((Path(root) / f"{job}.json").read_text())
    if events_fd is not None:
        line = {"event": "polled", "job": job, "state": state["state"], "t": time.monotonic()}
        os.write(events_fd, (json.dumps(line) + "\n").encode())
    if state["state"] == "done":
        return state["result"]
    if state["state"] == "cancelled":
        raise RuntimeError(f"job {job} was cancelled")
    return None


def cancel(root: str, job: str) -> None:
    (Path(root) / f"{job}.json").write_text(json.dumps({"state": "cancelled"}))


def state_of(root: str, job: str) -> str:
    return str(json.loads((Path(root) / f"{job}.json").read_text())["state"])
