"""What a killed task writes at the end of its log, once, after the unwind: one human line, the
structured record ([`document`][cancellable_agents.airflow.kill_record.document] renders it), its
metrics; then the task process exits promptly."""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow._metrics import emit_kill
from cancellable_agents.airflow._supervisor import notice_exit_at_once
from cancellable_agents.airflow.config import deployment_setting
from cancellable_agents.airflow.kill_record._outlook import airflow_logs_next, retry_outlook
from cancellable_agents.airflow.kill_record._stored import store_record
from cancellable_agents.airflow.kill_record.document import KillReport, render_record, summary_line
from cancellable_agents.core._usage import usage_dict
from cancellable_agents.core.causes import CancelCause, UserAction
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.procs._proc import lower_priority, read_proc

if TYPE_CHECKING:
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.core.scope import TaskCancellation

log = logging.getLogger("cancellable_agents.airflow.mixin")  # the logger the task log has always named


def cancelled_error(task_try: TaskTry, retry_policy: Any, message: str) -> TaskCancelled:
    """The [`TaskCancelled`][] to raise for a killed try, with its kill record logged first."""
    exc = task_try.scope.cancelled_error(message)
    log_kill_record(task_try, retry_policy, exc)
    return exc


def log_kill_record(task_try: TaskTry, retry_policy: Any, exc: TaskCancelled | None = None) -> None:
    """Once per try: wait for the unwind (within the budget), then write what happened for the
    task log in the UI: one human line, then the structured record. ``retry_policy`` is the
    operator's (what happens next is decided as the Task SDK will decide it)."""
    if task_try.record_logged:
        return
    task_try.record_logged = True
    scope = task_try.scope
    scope.wait_released(scope.remaining())
    yield_cpu_if_evicted(scope)
    task_try.finish_reaper()
    record = scope.summary()
    record["usage"] = usage_dict(exc.usage if exc else None)
    record["messages"] = len(exc.messages) if exc else 0
    cause, action = scope.cause, scope.user_action
    report = KillReport(
        record,
        action=action,
        processes_left=_still_running(record["killed"]),
        retry=retry_outlook(retry_policy, task_try.ti, cause, action),
        airflow_logs_next=airflow_logs_next(cause, action),
    )
    log.warning("%s", summary_line(report))
    full = report.full_record()
    log.warning("%s", render_record(full))
    # A cleared try's task instance was already replaced by the next one: the store refuses it.
    storing = action is not UserAction.CLEARED and bool(deployment_setting("store_cancellation_record"))
    store_record(task_try.context, task_try.ti, full, enabled=storing)
    emit_kill(task_try, report)  # after the record: metrics can never delay or hide it
    _exit_promptly()


#: The nice value an evicted task takes once its unwind is over (``yield_cpu_if_evicted``).
EVICTED_NICENESS = 10


def yield_cpu_if_evicted(scope: TaskCancellation) -> None:
    """An evicted task whose unwind is over lowers its priority (nice 10) for what is left: its
    record, its journal's end, Airflow's bookkeeping, its exit.

    A worker shutdown stops every task of the worker at once, and on the cores they share the
    kernel would give the bookkeeping of those done the same share as the unwind of those still
    stopping: with 32 agents evicted on 2 cores, storms in alternation, the slowest unwind took
    236-445 ms without this and 215-263 ms with it. Only for an eviction: a task a user stopped
    runs beside the worker's other tasks, and its remaining work keeps its share of the CPU.
    """
    if scope.cause is CancelCause.EVICTION:
        lower_priority(EVICTED_NICENESS)


def _exit_promptly() -> None:
    """Spare the killed task process the interpreter's final garbage collection.

    With Airflow, pydantic-ai and the model SDKs imported, that last collection takes 1.5-5 s
    (measured on 2 cores): enough to push a cancelled task past Airflow's 5 s SIGKILL even
    though its unwind took milliseconds. Frozen objects are left to the OS at exit.
    """
    gc.freeze()
    notice_exit_at_once()  # and spare it Airflow's supervisor sleeping through its exit


def _still_running(killed: list[dict[str, Any]]) -> int:
    """How many of the processes the unwind signalled still run code (zombies count as gone)."""
    pids = {k["pid"] for k in killed if isinstance(k.get("pid"), int)}
    return sum(1 for pid in pids if (info := read_proc(pid)) is not None and not info.exited)
