"""``execute_workload`` with a warm-shutdown supervisor: apache/airflow#69034's behaviour, emulated.

#69034 (merged upstream, not in task-sdk 1.3.2) replaces the supervisor's ``_forward_signal``
(SIGTERM/SIGINT forwarded to the task process) with a warm shutdown that signals nothing: the
supervisor keeps supervising until the task ends by itself or the container is killed. Until a
release ships it, a pod runs ``python -m tests.e2e.pod_supervisor --json-string …`` instead of
``python -m airflow.sdk.execution_time.execute_workload --json-string …``: the same entry point,
with the handler the supervisor installs as ``_forward_signal`` swapped for one that only logs.
Every other ``signal.signal`` call (the task child resetting its handlers after the fork, the
supervisor restoring them) goes through unchanged.
"""

from __future__ import annotations

import signal
import sys
import types
from typing import Any

from airflow.sdk.execution_time import execute_workload, supervisor


def _warm_shutdown(signum: int, frame: Any) -> None:
    print(f"warm shutdown: {signal.Signals(signum).name} received, the task is not signalled", flush=True)


class _WarmSignals(types.ModuleType):
    """The ``signal`` module as the supervisor sees it, minus signal forwarding."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signalnum: int, handler: Any) -> Any:
        if getattr(handler, "__name__", "") == "_forward_signal":
            handler = _warm_shutdown
        return signal.signal(signalnum, handler)


def main() -> None:
    supervisor.signal = _WarmSignals("signal")  # type: ignore[assignment]
    sys.argv[0] = execute_workload.__file__
    execute_workload.main()


if __name__ == "__main__":
    main()
