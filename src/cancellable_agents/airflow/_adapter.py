"""Every Airflow fact the provider depends on, in one place.

Supporting a new Airflow release means reading this module against it: the grace before
SIGKILL, how a timeout reaches the task, what the server's task-instance state means during a
kill, and the imports that moved between 3.1, 3.2 and 3.3.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from typing import Any

from cancellable_agents.core.causes import CancelCause, CauseSource, CauseVerdict, UserAction

#: Seconds between SIGTERM and SIGKILL on Airflow's user-initiated kill paths (mark failed, clear).
GRACE_SECONDS = 5.0

#: What the server's view of the task instance's state means when a SIGTERM arrives. ``None``:
#: the server no longer lists this try (cleared and recreated).
_STATE_VERDICTS: dict[str | None, CauseVerdict] = {
    "failed": CauseVerdict.of_user(UserAction.MARKED_FAILED),
    "success": CauseVerdict.of_user(UserAction.MARKED_SUCCESS),
    "skipped": CauseVerdict.of_user(UserAction.MARKED_SKIPPED),
    "restarting": CauseVerdict.of_user(UserAction.CLEARED),
    "up_for_retry": CauseVerdict.of_user(UserAction.CLEARED),
    "scheduled": CauseVerdict.of_user(UserAction.CLEARED),
    "queued": CauseVerdict.of_user(UserAction.CLEARED),
    None: CauseVerdict.of_user(UserAction.CLEARED),
    "running": CauseVerdict(CancelCause.EVICTION, "worker shutdown"),
}


def verdict_for_state(state: str | None) -> CauseVerdict:
    """Map the task instance state the server reports during a kill to a cause."""
    return _STATE_VERDICTS.get(state, CauseVerdict(CancelCause.UNKNOWN, f"unexpected state {state!r}"))


def classify_sigterm(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> CauseVerdict:
    """Ask the API server (through the Task SDK supervisor) what it thinks this try is doing.

    Must run off the main thread: the supervisor comms lock is not re-entrant, and a SIGTERM
    that lands while the main thread is inside a comms call would deadlock.
    """
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    states = RuntimeTaskInstance.get_task_states(
        dag_id=dag_id,
        task_ids=[task_id],
        run_ids=[run_id],
        map_index=None if map_index < 0 else map_index,
    )
    verdict = verdict_for_state(_find_state(states, run_id, task_id, map_index))
    return dataclasses.replace(verdict, source=CauseSource.API_SERVER)


def _find_state(states: dict, run_id: str, task_id: str, map_index: int) -> str | None:
    """Pick this task instance's state out of ``get_task_states``' ``{run_id: {key: state}}``."""
    for key, state in states.get(run_id, {}).items():
        if key in (task_id, f"{task_id}_{map_index}"):
            return None if state is None else str(state)
    return None


TaskInstanceKey = tuple[str, str, str, int]


def ti_key(context: Any) -> TaskInstanceKey | None:
    """``(dag_id, task_id, run_id, map_index)`` of the context's task instance, if any."""
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is None:
        return None
    return (ti.dag_id, ti.task_id, ti.run_id, getattr(ti, "map_index", -1))


@functools.cache
def execution_timeout_type() -> type[BaseException]:
    """The class the Task SDK raises on ``execution_timeout`` (SIGALRM): ``airflow.sdk.exceptions``
    has it from 3.2; on 3.1 the Task SDK raises airflow-core's class."""
    try:
        from airflow.sdk.exceptions import AirflowTaskTimeout
    except ImportError:  # Airflow 3.1
        from airflow.exceptions import AirflowTaskTimeout  # type: ignore[no-redef]
    return AirflowTaskTimeout


def is_execution_timeout(exc: BaseException | None) -> bool:
    """Whether ``exc`` is Airflow's ``execution_timeout`` (SIGALRM raises it wherever the main
    thread is, and ``on_kill`` runs after ``execute`` exited with it)."""
    return exc is not None and isinstance(exc, execution_timeout_type())


#: Where retry policies live; they exist from Airflow 3.3.
RETRY_POLICY_MODULE = "airflow.sdk.definitions.retry_policy"


def has_retry_policies() -> bool:
    """Whether this Airflow has retry policies (3.3+). Finds the module without importing it."""
    return importlib.util.find_spec(RETRY_POLICY_MODULE) is not None


@functools.cache
def has_task_state_store() -> bool:
    """Airflow 3.3+ gives every task instance a store that survives its retries (AIP-103)."""
    try:
        from airflow.sdk.execution_time.context import TaskStateStoreAccessor  # noqa: F401
    except ImportError:
        return False
    return True


def comms_used_from_a_loop() -> bool:
    """Whether this task's channel to its supervisor has been used from an event loop.

    Task SDK 1.3's ``CommsDecoder.asend`` (the async Connection, Variable, XCom and task state
    store APIs) remembers its loop's thread in ``_loop_thread_id``; from then on a sync call on
    that thread refuses to wait for the channel's lock and raises ``DeadlockImminentError``
    while another thread holds it. A release without the attribute has no such refusal.
    """
    runner = sys.modules.get("airflow.sdk.execution_time.task_runner")
    comms = getattr(runner, "SUPERVISOR_COMMS", None)
    return getattr(comms, "_loop_thread_id", None) is not None


@functools.cache
def has_task_awaiting_input() -> bool:
    """Airflow 3.3+ parks a task waiting for a person in AWAITING_INPUT (no worker slot, no trigger)."""
    try:
        from airflow.sdk.exceptions import TaskAwaitingInput  # noqa: F401
    except ImportError:
        return False
    return True


def has_trigger_on_kill() -> bool:
    """Airflow 3.3+ calls a trigger's ``on_kill`` when a user marks its deferred task failed or
    clears it: where a deferred tool call's outside work is stopped."""
    try:
        from airflow.triggers.base import BaseTrigger
    except ImportError:
        return False
    return "on_kill" in vars(BaseTrigger)


def base_operator() -> type:
    from airflow.sdk.bases.operator import BaseOperator

    return BaseOperator


def determine_kwargs(python_callable: Any, op_args: Any, context: Any) -> Any:
    """Airflow's helper that picks a TaskFlow callable's keyword arguments out of the context
    (``airflow.sdk.bases.decorator`` from 3.2; ``airflow.utils.operator_helpers`` on 3.1)."""
    try:
        from airflow.sdk.bases.decorator import determine_kwargs as determine
    except ImportError:  # Airflow 3.1
        from airflow.utils.operator_helpers import determine_kwargs as determine  # type: ignore[no-redef]
    return determine(python_callable, op_args, context)
