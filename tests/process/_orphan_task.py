"""A task process whose "supervisor" (its parent) the test SIGKILLs: no Airflow, real processes.

argv: STATE_DIR MARKER. Starts a sandboxed three-process tree carrying MARKER, the descendant
reaper and a :class:`SupervisorWatch` on its parent, says it is ready, and then keeps its main
thread busy the way an orphaned task's would be (the run unwinds, then it would try to report to
the dead supervisor): it never exits by itself, so only the watch can end it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cancellable_agents import LocalSandbox, TaskCancellation
from cancellable_agents.airflow._supervisor import SupervisorWatch
from cancellable_agents.core.scope import Outcome
from cancellable_agents.procs._reaper import DescendantReaper

TREE = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.fork()\ntime.sleep(300)\n"


def main() -> None:
    state, marker = Path(sys.argv[1]), sys.argv[2]
    scope = TaskCancellation("agent", budget=4.0)
    DescendantReaper.start(scope)
    LocalSandbox(scope=scope).start([sys.executable, "-c", TREE, marker])
    watch = SupervisorWatch(scope, os.getppid(), state / "record.json").start()
    ready = {"pid": os.getpid(), "ppid": os.getppid(), "poll_s": watch.poll_interval}
    (state / "ready.tmp").write_text(json.dumps(ready))
    (state / "ready.tmp").replace(state / "ready.json")
    with scope.activate():
        scope.wait()
        scope.settle(Outcome.CANCELLED)
    time.sleep(300)  # "reporting" to a supervisor that is gone


if __name__ == "__main__":
    main()
