"""Why a task was cancelled, and how to tell a user's stop from a worker eviction.

The enum is Airflow-free. :func:`classify_sigterm` talks to the Task SDK only inside the
function, so importing this module never imports Airflow.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class CancelCause(str, enum.Enum):
    """The reason a run was cancelled, decided once per scope."""

    USER = "user"
    """The server no longer has this try running: marked failed/success, or cleared."""
    EVICTION = "eviction"
    """SIGTERM while the server still has the try running: the worker is going away."""
    TIMEOUT = "timeout"
    """``execution_timeout`` or the run's own deadline."""
    PARENT = "parent"
    """The parent scope (a parent agent or the task) was cancelled."""
    UNKNOWN = "unknown"
    """The cause could not be decided in time. Never a guess."""


@dataclass(frozen=True)
class CauseVerdict:
    """A decided cause plus the detail that explains it (``marked failed``, ``cleared`` ...)."""

    cause: CancelCause
    detail: str = ""


#: What the server's view of the task instance's state means when a SIGTERM arrives.
_STATE_VERDICTS: dict[str | None, CauseVerdict] = {
    "failed": CauseVerdict(CancelCause.USER, "marked failed"),
    "success": CauseVerdict(CancelCause.USER, "marked success"),
    "skipped": CauseVerdict(CancelCause.USER, "marked skipped"),
    "restarting": CauseVerdict(CancelCause.USER, "cleared"),
    "up_for_retry": CauseVerdict(CancelCause.USER, "cleared"),
    "scheduled": CauseVerdict(CancelCause.USER, "cleared"),
    "queued": CauseVerdict(CancelCause.USER, "cleared"),
    None: CauseVerdict(CancelCause.USER, "cleared"),
    "running": CauseVerdict(CancelCause.EVICTION, "worker shutdown"),
}


def verdict_for_state(state: str | None) -> CauseVerdict:
    """Map the task instance state the server reports during a kill to a cause.

    ``None`` means the server no longer lists this try (cleared and recreated).
    """
    return _STATE_VERDICTS.get(state, CauseVerdict(CancelCause.UNKNOWN, f"unexpected state {state!r}"))


def bounded(query: Callable[[], CauseVerdict], timeout: float) -> CauseVerdict:
    """Run ``query`` on a daemon thread and give up after ``timeout`` seconds.

    A query that cannot answer in time (a deadlocked comms channel, a slow server) yields
    ``UNKNOWN`` instead of blocking the unwind: the cause must never cost grace time.
    """
    result: list[CauseVerdict] = []

    def target() -> None:
        try:
            result.append(query())
        except Exception as exc:  # the classifier must never break the unwind
            log.warning("Could not classify the cancellation: %s", exc)
            result.append(CauseVerdict(CancelCause.UNKNOWN, f"classifier failed: {exc}"))

    worker = threading.Thread(target=target, name="cancellable-agents-classify", daemon=True)
    worker.start()
    worker.join(timeout)
    if result:
        return result[0]
    return CauseVerdict(CancelCause.UNKNOWN, f"task state not known within {timeout:.1f}s")


def classify_sigterm(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> CauseVerdict:
    """Ask the API server (through the Task SDK supervisor) what it thinks this try is doing.

    Must run off the main thread: the supervisor comms lock is not re-entrant, and a SIGTERM
    that lands while the main thread is inside a comms call would deadlock (see DESIGN §1).
    """
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    states = RuntimeTaskInstance.get_task_states(
        dag_id=dag_id,
        task_ids=[task_id],
        run_ids=[run_id],
        map_index=None if map_index < 0 else map_index,
    )
    return verdict_for_state(_find_state(states, run_id, task_id, map_index))


def _find_state(states: dict, run_id: str, task_id: str, map_index: int) -> str | None:
    """Pick this task instance's state out of ``get_task_states``' ``{run_id: {key: state}}``."""
    for key, state in states.get(run_id, {}).items():
        if key in (task_id, f"{task_id}_{map_index}"):
            return None if state is None else str(state)
    return None
