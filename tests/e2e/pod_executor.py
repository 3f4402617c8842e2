"""A test executor that hands each task's workload to a "kubelet" (tests/e2e/pod.py), as the
KubernetesExecutor hands it to the Kubernetes API.

Why an executor, not a workload built by the test: the scheduler then queues, sends and
re-sends each try exactly as it does for the KubernetesExecutor (one workload per try, with its
own execution-API token), the retry of a killed try reaches a *new* pod by the scheduler's own
decision, and a pod that died without its supervisor reporting (node loss, a drain's SIGKILL) is
reported back the way the KubernetesExecutor's pod watcher does: ``fail(key)`` for a failed pod,
which the scheduler turns into ``up_for_retry`` (its "state mismatch" path) at once instead of
after ``task_instance_heartbeat_timeout`` (300 s).

Configured beside the LocalExecutor (``[core] executor =
LocalExecutor,PodExecutor:tests.e2e.pod_executor.PodExecutor``); a task picks it with
``executor="PodExecutor"``. The hand-off is a directory (``$E2E_STATE_DIR/pods``): the executor
writes ``queue/<ti id>.json`` (the workload, as the pod's ``--json-string`` would carry it); the
kubelet writes ``exit/<ti id>.json`` (``{"exit_code": N}``) when that pod is gone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.executors.base_executor import BaseExecutor

#: The executor's alias in ``[core] executor`` and the tasks' ``executor=``.
POD_EXECUTOR = "PodExecutor"
POD_EXECUTOR_CONFIG = f"{POD_EXECUTOR}:tests.e2e.pod_executor.PodExecutor"


def pod_dir(state_dir: str | os.PathLike[str]) -> Path:
    """Where the executor and the kubelet meet (under the e2e state dir)."""
    return Path(state_dir) / "pods"


class PodExecutor(BaseExecutor):
    """Queues workloads to the kubelet's directory; reports each pod's end as success/failure."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        root = pod_dir(os.environ["E2E_STATE_DIR"])
        self._queue, self._exits = root / "queue", root / "exit"
        self._queue.mkdir(parents=True, exist_ok=True)
        self._exits.mkdir(parents=True, exist_ok=True)
        self._keys: dict[str, Any] = {}  # ti id -> TaskInstanceKey of the pod's try

    def _process_workloads(self, workload_items: Sequence[Any]) -> None:
        for workload in workload_items:
            ti = workload.ti
            tmp = self._queue / f"{ti.id}.tmp"
            tmp.write_text(workload.model_dump_json())
            tmp.replace(self._queue / f"{ti.id}.json")
            self.queued_tasks.pop(ti.key, None)
            self.running.add(ti.key)
            self._keys[str(ti.id)] = ti.key

    def sync(self) -> None:
        """Report every pod that ended since the last heartbeat (exit 0: success, else failed)."""
        for ti_id, key in list(self._keys.items()):
            path = self._exits / f"{ti_id}.json"
            if not path.exists():
                continue
            exit_code = json.loads(path.read_text())["exit_code"]
            del self._keys[ti_id]
            if exit_code == 0:
                self.success(key)
            else:
                self.fail(key, info=f"pod exited with {exit_code}")

    def end(self) -> None:
        """Pods belong to the kubelet (the test); nothing to wait for here."""

    def terminate(self) -> None:
        """As :meth:`end`."""
