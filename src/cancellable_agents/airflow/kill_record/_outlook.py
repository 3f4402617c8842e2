"""The Airflow facts behind a killed try's log: what happens next, and which of Airflow's own
error lines follow our record on each kill path (measured on Airflow 3.3, LocalExecutor).

[`cancellable_agents.airflow.kill_record.document`][] renders; this module only knows Airflow. The lines are
the supervisor's and the Task SDK's, written after the task's record; nothing of ours can stop
them, so the record names them as expected (docs: ``kill-paths.md``, "Expected Airflow noise").
"""

from __future__ import annotations

from typing import Any

from cancellable_agents.airflow.kill_record.document import ExpectedLine, RetryOutlook
from cancellable_agents.core.causes import CancelCause, UserAction

_TASK_KILLED = ExpectedLine(
    "Task killed!",
    "the supervisor logs this (at ERROR) once the task process it SIGTERMed has exited; "
    "that process is this one, after the unwind above",
)
_TERMINAL_404 = ExpectedLine(
    "Failed to report terminal task state to supervisor",
    "the clear already replaced this try on the server, so reporting its end gets 404 Not Found",
)
_EXITED_ABNORMALLY = ExpectedLine(
    "Process exited abnormally",
    "after that 404 the Task SDK exits with code 1 (fail closed); the next try is already running",
)

#: Per kill path, the Airflow lines that follow the record. Eviction and timeouts add none.
_AFTER_RECORD: dict[UserAction, tuple[ExpectedLine, ...]] = {
    UserAction.MARKED_FAILED: (_TASK_KILLED,),
    UserAction.MARKED_SUCCESS: (_TASK_KILLED,),
    UserAction.MARKED_SKIPPED: (_TASK_KILLED,),
    UserAction.CLEARED: (_TERMINAL_404, _EXITED_ABNORMALLY, _TASK_KILLED),
}


def airflow_logs_next(cause: CancelCause | None, action: UserAction | None) -> tuple[ExpectedLine, ...]:
    """Airflow's own error lines that will follow the record on this kill path."""
    if cause is not CancelCause.USER or action is None:
        return ()
    return _AFTER_RECORD.get(action, ())


def retry_outlook(
    retry_policy: Any, ti: Any, cause: CancelCause | None, action: UserAction | None
) -> RetryOutlook:
    """What happens after this try, decided as the Task SDK will decide it.

    A user's stop is final on the server (a clear already made the next try); otherwise the
    operator's ``retry_policy`` (Airflow 3.3+) decides, and a retry needs retries left, which
    the server told the task instance ``ti`` at its start.
    """
    if action is UserAction.CLEARED:
        return RetryOutlook.NEXT_TRY_STARTS
    if cause is CancelCause.USER:
        return RetryOutlook.NOT_RETRYING
    decide = getattr(retry_policy, "decide", None)
    if callable(decide) and cause is not None:  # CancellationAwareRetryPolicy: Airflow 3.3+
        from airflow.sdk.definitions.retry_policy import RetryAction

        if decide(cause, action).action is RetryAction.FAIL:
            return RetryOutlook.NOT_RETRYING
    should_retry = _should_retry(ti)
    if should_retry is None:
        return RetryOutlook.UNDECIDED
    return RetryOutlook.RETRYING if should_retry else RetryOutlook.NO_RETRIES_LEFT


def _should_retry(ti: Any) -> bool | None:
    """The server's word on whether this try may be retried (sent with the task's start)."""
    server = getattr(ti, "_ti_context_from_server", None)
    answer = getattr(server, "should_retry", None)
    return answer if isinstance(answer, bool) else None
