"""The execute guard: ``execute`` ends as ``TaskCancelled`` whenever a kill landed before it
returned, and the scope's one outcome is settled there; a try that ends here without a kill
stores its wind-down, resume and wait facts for the Cancellations view (once, if it has any).

Wrapped around every ``execute`` of an operator with the mixin (its own, or one inherited from a
plain operator) by `CancellableAgentMixin.__init_subclass__`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.core.exceptions import TaskCancelled


class GuardedOperator(Protocol):
    """What the guard needs of an operator (the mixin's public face): its try, whether it reaps
    what its tools leave behind, and the error a killed task raises."""

    reap_descendants: bool

    def task_try(self, context: Any = None) -> TaskTry: ...

    def cancelled_error(self, message: str) -> TaskCancelled: ...


def guard_execute(execute: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``execute`` end as ``TaskCancelled`` if a kill landed before it returned.

    Wraps at class creation, so a DAG file pays for this function only; what the guard uses
    loads when a task runs.
    """
    if getattr(execute, "_cancellable_agents_guard", False):
        return execute

    @functools.wraps(execute)
    def guarded(self: GuardedOperator, context: Any) -> Any:
        from cancellable_agents.airflow.kill_record.document import hide_unwind_chain
        from cancellable_agents.core.exceptions import TaskCancelled

        task_try = self.task_try(context)
        if task_try.in_execute:
            return execute(self, context)  # a subclass's execute calling super(): guard once
        task_try.in_execute = True
        try:
            return _run_guarded(self, execute, context)
        except TaskCancelled as exc:
            # Airflow logs the chain: unless a real error is in it, show our frames, not anyio's.
            hide_unwind_chain(exc)
            raise
        finally:
            task_try.in_execute = False

    guarded._cancellable_agents_guard = True  # type: ignore[attr-defined]
    return guarded


def _run_guarded(operator: GuardedOperator, execute: Callable[..., Any], context: Any) -> Any:
    from cancellable_agents.airflow._adapter import is_execution_timeout
    from cancellable_agents.airflow._approval import park
    from cancellable_agents.airflow.deferral import deferral_for
    from cancellable_agents.airflow.kill_record._stored import store_try_facts
    from cancellable_agents.core.exceptions import TaskCancelled
    from cancellable_agents.core.scope import Outcome
    from cancellable_agents.durable._pauses import AwaitingApproval

    task_try = operator.task_try(context)
    scope = task_try.scope
    # Here, not only in pre_execute: an operator that overrides pre_execute without super()
    # must not silently lose the reaping of what its tools leave behind.
    if operator.reap_descendants:
        task_try.start_reaper()
    if scope.cancelled:
        # Killed before execute began (while rendering templates, in pre_execute): don't build
        # agents or open clients only to tear them down again.
        scope.record("execute_refused", reason="cancelled before execute started")
        scope.settle(Outcome.CANCELLED)
        raise operator.cancelled_error("killed before execute started; no work was done")
    try:
        # Active for all of execute, so tools and sandboxes find the scope outside a run too.
        with scope.activate():
            result = execute(operator, context)
    except TaskCancelled:
        scope.settle(Outcome.CANCELLED)
        raise
    except AwaitingApproval as paused:
        # The run stopped at a step boundary with its record written (awaiting a person, or the
        # outside work a tool deferred to): this execution's work is done, and nothing of it may
        # keep running while the task waits without a worker.
        scope.settle(Outcome.COMPLETED)
        task_try.finish_reaper()
        if paused.request.is_deferral:
            raise deferral_for(operator, paused.request, task_try.waits) from None
        raise park(operator, paused.request, context, task_try.waits) from None
    except Exception as exc:
        if scope.cancelled:
            # Whatever broke after the kill (a tool whose process the unwind killed, a closed
            # client) is the kill's consequence: the outcome is cancelled, with the error chained.
            scope.settle(Outcome.CANCELLED)
            raise operator.cancelled_error(f"killed; then execute failed with {exc!r}") from exc
        scope.settle(Outcome.FAILED)
        task_try.finish_reaper()  # a failed task leaves nothing running behind it
        raise
    except BaseException as exc:
        scope.settle(Outcome.FAILED)
        if not is_execution_timeout(exc):  # on the timeout path on_kill unwinds and reaps
            task_try.finish_reaper()  # a failed task leaves nothing running behind it
        raise
    if scope.settle(Outcome.COMPLETED) is Outcome.CANCELLED:
        raise operator.cancelled_error("killed before execute returned; its result is discarded")
    task_try.close_reaper()
    # The try ends here: its wind-down, resume and wait facts, if any, in one bounded write for
    # the Cancellations view (a killed try's record is written on the kill's path instead).
    store_try_facts(task_try)
    return result
