"""Kills that land while a task's scope is being created: SIGTERMs hammered at this process.

Usage: ``python -m tests.stress._scope_race_child SECONDS``. The main thread creates task
instances and their scopes (``CancellableAgentMixin.cancellation``, the lazy creation every
operator goes through in ``pre_execute``) in a loop, each with the Task SDK's SIGTERM handler
shape installed; another thread sends SIGTERM to this process every ~0.5 ms, so handlers (which
run on the main thread and need the scope) keep landing inside the creation. Prints one JSON line:
how many scopes were created, how many tasks were killed, and how many kills were lost (the
handler ran for a task whose scope ended up not cancelled). A deadlock shows as no output: the parent's
timeout, with this process's stacks dumped by ``faulthandler``.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from cancellable_agents.airflow.mixin import CancellableAgentMixin
from tests.taskproc import install_sigterm_handler


class _Base:
    def on_kill(self) -> None:
        """BaseOperator's no-op ``on_kill``, without BaseOperator's construction cost."""


class RaceTask(CancellableAgentMixin, _Base):
    """Just the mixin: scope creation is the whole iteration, so the window is hit often."""

    task_id = "race"


def hammer(stop: threading.Event) -> None:
    pid = os.getpid()
    while not stop.is_set():
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.0005)  # the spacing between kills is what is being varied, not a sync wait


def main() -> None:
    seconds = float(sys.argv[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.getLogger("cancellable_agents").setLevel(logging.ERROR)  # one line per kill otherwise
    stop = threading.Event()
    killed: dict[int, Any] = {}
    created = hit = lost = 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # until the first task's handler
    threading.Thread(target=hammer, args=(stop,), daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        task = RaceTask()
        install_sigterm_handler(task, before=functools.partial(killed.setdefault, id(task), task))
        scope = task.cancellation
        created += 1
        if killed.pop(id(task), None) is not None:
            hit += 1
            lost += not scope.cancelled
    stop.set()
    print(json.dumps({"created": created, "killed": hit, "lost": lost}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
