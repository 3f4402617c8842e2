"""Why a scope was cancelled: the cause, what the user did, and a bounded way to decide it.

Airflow-free. How an Airflow task-instance state maps to a cause lives in
[`cancellable_agents.airflow._adapter`][].
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CancelCause", "CauseSource", "CauseVerdict", "UserAction"]

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

    @property
    def words(self) -> str:
        """The cause as the task log and the retry decision say it."""
        return _CAUSE_WORDS[self]


class UserAction(str, enum.Enum):
    """What a user did to stop a try (the ``USER`` cause's kinds); the retry policy acts on it."""

    MARKED_FAILED = "marked failed"
    MARKED_SUCCESS = "marked success"
    MARKED_SKIPPED = "marked skipped"
    CLEARED = "cleared"

    @property
    def words(self) -> str:
        """What the user did, as the task log and the retry decision say it."""
        return _ACTION_WORDS[self]


_CAUSE_WORDS = {
    CancelCause.USER: "stopped by a user",
    CancelCause.EVICTION: "the worker is shutting down (eviction)",
    CancelCause.TIMEOUT: "timed out",
    CancelCause.PARENT: "its parent was cancelled",
    CancelCause.UNKNOWN: "cause unknown",
}
_ACTION_WORDS = {
    UserAction.MARKED_FAILED: "user marked it failed",
    UserAction.MARKED_SUCCESS: "user marked it success",
    UserAction.MARKED_SKIPPED: "user marked it skipped",
    UserAction.CLEARED: "user cleared it",
}


class CauseSource(str, enum.Enum):
    """What a cause was decided from: the kill record's ``cause_source``, so a wrong or unknown
    cause says which evidence was missing or slow."""

    LOCAL = "local"
    """The kill itself told: a deadline, a parent's cancel, a lost supervisor, the caller."""
    TASK_LOG = "task log"
    """The try's log file on local disk: the supervisor's line about the server's refused
    heartbeat (a user's stop), or its absence (an eviction)."""
    API_SERVER = "api server"
    """The API server's view of the try (a round trip through the supervisor)."""
    UNANSWERED = "unanswered"
    """Nothing answered within the budget, or the query failed (the cause is ``unknown``)."""


@dataclass(frozen=True)
class CauseVerdict:
    """A decided cause, what the user did (for ``USER``), a human detail, and what it was
    decided from."""

    cause: CancelCause
    detail: str = ""
    action: UserAction | None = None
    source: CauseSource = CauseSource.LOCAL

    @classmethod
    def of_user(cls, action: UserAction) -> CauseVerdict:
        return cls(CancelCause.USER, action.value, action)


def bounded(query: Callable[[], CauseVerdict], timeout: float) -> CauseVerdict:
    """Run ``query`` on a daemon thread and give up after ``timeout`` seconds.

    A query that cannot answer in time (a deadlocked comms channel, a slow server) yields
    ``UNKNOWN`` (source ``UNANSWERED``) instead of blocking the unwind: the cause must never
    cost grace time.
    """
    result: list[CauseVerdict] = []

    def target() -> None:
        try:
            result.append(query())
        except Exception as exc:  # the classifier must never break the unwind
            log.warning("Could not classify the cancellation: %s", exc)
            detail = f"classifier failed: {exc}"
            result.append(CauseVerdict(CancelCause.UNKNOWN, detail, source=CauseSource.UNANSWERED))

    worker = threading.Thread(target=target, name="cancellable-agents-classify", daemon=True)
    worker.start()
    worker.join(timeout)
    if result:
        return result[0]
    return CauseVerdict(
        CancelCause.UNKNOWN, f"task state not known within {timeout:.1f}s", source=CauseSource.UNANSWERED
    )
