"""``tests/dag_test_compat.py``'s in-process comms: one request at a time, and the comms hidden
only from the thread serving one. 3.1 CI found the race this closes: a helper thread's cause query
was being served when the main thread's ``run()`` read ``SUPERVISOR_COMMS`` as a global to send
the task's final state; Airflow's comms had deleted it for every thread, so that read raised
``NameError`` and the task ended before its failure callback ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: A helper thread sends while the main thread reads the comms the two ways Airflow's code does.
CHILD = r"""
import json, threading
from airflow.sdk.execution_time import supervisor, task_runner
from tests.dag_test_compat import prepare_dag_test

prepare_dag_test()
serving, release, seen = threading.Event(), threading.Event(), {}


class Server:
    def _handle_request(self, msg, log, req_id):
        seen["server_sees_comms"] = hasattr(task_runner, "SUPERVISOR_COMMS")
        serving.set()
        release.wait(30)
        comms.messages.append(msg)


comms = supervisor.InProcessSupervisorComms(supervisor=Server())
with supervisor.set_supervisor_comms(comms):
    helper = threading.Thread(target=lambda: seen.update(reply=task_runner.SUPERVISOR_COMMS.send("ping")))
    helper.start()
    assert serving.wait(30), "the helper's request was never served"
    try:
        seen["global_read"] = eval("SUPERVISOR_COMMS is comms", vars(task_runner), {"comms": comms})
    except NameError as exc:
        seen["global_read"] = repr(exc)
    seen["attribute_read"] = getattr(task_runner, "SUPERVISOR_COMMS", None) is comms
    release.set()
    helper.join(30)
seen["after"] = hasattr(task_runner, "SUPERVISOR_COMMS")
print(json.dumps(seen))
"""


def test_other_threads_see_the_comms_while_one_is_served() -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen == {
        "server_sees_comms": False,  # the serving thread must not send again (mask_secret would)
        "global_read": True,  # task_runner's own code, e.g. run()'s final TaskState
        "attribute_read": True,  # `from task_runner import SUPERVISOR_COMMS`, hasattr checks
        "reply": "ping",
        "after": False,  # dag.test() left no comms behind
    }, seen
