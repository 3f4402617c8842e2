"""One try of one task instance: everything the provider keeps for it, as one typed object.

Operators are deep-copied for each try, so the try lives on the operator instance under one key,
made at the first call that runs the task (``render_template_fields``) and never replaced. The
mixin is its Airflow face; the execute guard, the kill log, the metrics and the durable journal
take a [`TaskTry`][] and never reach into the operator.

Light on purpose: a DAG file imports this module (through the mixin) every time it is parsed, so
the scope, the reaper and the supervisor watch are imported when a try is made, never before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow._adapter import TaskInstanceKey, ti_key

if TYPE_CHECKING:
    from cancellable_agents.airflow._server_stop import LocalEvidence
    from cancellable_agents.airflow._supervisor import SupervisorWatch
    from cancellable_agents.core.causes import CauseVerdict
    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.core.wind_down import WindDownReport
    from cancellable_agents.durable._pauses import Decision
    from cancellable_agents.procs._reaper import DescendantReaper
    from cancellable_agents.run.tool_calls import RunIdentity

__all__ = ["TaskTry", "cancellation_of"]

log = logging.getLogger("cancellable_agents.airflow.mixin")  # the logger the task log has always named

#: The operator's ``__dict__`` key holding its `TaskTry`.
_KEY = "_task_try"
#: Set by a kill that came before the try was made (a signal handler must not import or build the
#: scope: the main thread may be in the middle of importing it); the try starts cancelled.
_KILLED_BEFORE_TRY = "_killed_before_try"


@dataclass(eq=False)
class TaskTry:
    """What one try of a task instance owns. Made and filled on the main thread; ``on_kill`` (a
    signal handler on the main thread) and the cause thread only read ``scope`` and ``key``."""

    #: The try's cancellation scope: made with the try, never replaced.
    scope: TaskCancellation
    #: The operator's class name (metric tags, log lines).
    operator: str
    #: The latest context Airflow handed the task (durable: the task state store, the try number).
    context: Any = None
    #: ``(dag_id, task_id, run_id, map_index)``, set once from the first context with a task
    #: instance; what the cause thread asks the server about.
    key: TaskInstanceKey | None = None
    #: The Task SDK's task instance (the server's ``should_retry`` for the retry outlook).
    ti: Any = None
    #: Watches for processes the task starts outside a sandbox; started once, reaped on a kill
    #: or a failure, closed on success.
    reaper: DescendantReaper | None = None
    #: Watches for the loss of the Task SDK supervisor (stops by itself once the run settled).
    supervisor_watch: SupervisorWatch | None = None
    #: Where a SIGTERM's cause can be read locally (the try's log file), looked up at the start.
    evidence: LocalEvidence | None = None
    #: After a pause (an approval, a deferral): the key of the run that paused and the answers
    #: its pending calls got (a reviewer's decisions, the outside work's results).
    answers: tuple[str, dict[str, Decision]] | None = None
    #: ``run_agent_sync`` calls made so far: each run's key (under ``durable=True``, in the record).
    durable_runs: int = 0
    #: The kill record is written once per try.
    record_logged: bool = False
    #: The wind-down report of each run of this try that answered at its wind-down.
    wound_down: list[WindDownReport] = field(default_factory=list)
    #: Each pause of this try that held no worker slot (a deferral, an approval), as plain
    #: values: the earlier executions' carried in the pause's kwargs, then this one's.
    waits: list[dict[str, Any]] = field(default_factory=list)
    #: Inside the guarded ``execute`` (a subclass's ``execute`` calling ``super()`` is guarded once).
    in_execute: bool = False

    def know(self, context: Any) -> None:
        """Remember the context, and who this task instance is (the first time it is known)."""
        self.context = context
        if self.key is None:
            self.key = ti_key(context)
            self.ti = context.get("ti") if hasattr(context, "get") else None

    def start_reaper(self) -> None:
        """Watch for processes the task starts (once per try)."""
        if self.reaper is None:
            from cancellable_agents.procs._reaper import DescendantReaper

            self.reaper = DescendantReaper.start(self.scope)

    def watch_supervisor(self, context: Any) -> None:
        """Watch for the loss of the supervisor (once per try), and look up where a SIGTERM's
        cause can be read locally, so the kill only reads it."""
        if self.supervisor_watch is None:
            from cancellable_agents.airflow._supervisor import watch_supervisor

            self.supervisor_watch = watch_supervisor(self.scope, context)
        if self.evidence is None:
            from cancellable_agents.airflow._server_stop import LocalEvidence

            self.evidence = LocalEvidence.gather()

    def finish_reaper(self) -> None:
        """Stop what the task started outside a sandbox (a kill or a failure leaves nothing behind)."""
        if self.reaper is not None:
            self.reaper.reap(self.scope)

    def close_reaper(self) -> None:
        """The work completed: stop the watcher's polling (a later kill is a no-op, so nothing will
        be reaped). Matters where one process runs several tasks (``dag.test``)."""
        if self.reaper is not None:
            self.reaper.close()

    def kill(self, classify_timeout: float) -> None:
        """A SIGTERM's cancel: returns within milliseconds. The cause comes from the try's log
        file when that tells (read here, on the signal's thread: a few milliseconds, however
        busy the machine); only otherwise is the API server asked, on the scope's helper
        thread, within ``classify_timeout`` of now."""
        from cancellable_agents.core.causes import CancelCause
        from cancellable_agents.core.scope import Outcome

        scope = self.scope
        local = self._local_verdict()
        if local is not None:
            started = scope.cancel(verdict=local)
        else:
            started = scope.cancel(
                CancelCause.UNKNOWN, classify=self._classifier(), classify_timeout=classify_timeout
            )
        if not started and scope.outcome is Outcome.COMPLETED:
            log.info("%s: kill after the task finished its work; nothing to cancel", scope.name)

    def _local_verdict(self) -> CauseVerdict | None:
        """The cause from what this process can read itself, if the evidence was looked up at
        the start (a kill before that leaves it to the helper thread: see `_classify`)."""
        if self.evidence is None or self.scope.cancelled:
            return None
        try:
            return self.evidence.verdict()
        except Exception:  # a signal handler must not raise: the server decides instead
            return None

    def _classifier(self) -> Callable[[], CauseVerdict] | None:
        key = self.key
        if key is None:
            return None
        return lambda: _classify(key)

    def next_run_key(self) -> str:
        """The key of the next durable run in this execution (its order in ``execute``)."""
        run_key = str(self.durable_runs)
        self.durable_runs += 1
        return run_key

    def run_identity(self, run_key: str) -> RunIdentity:
        """Who the agent run ``run_key`` of this try is, for its tool calls' idempotency keys: this
        task instance, the run's order in ``execute``, and this try (a durable run's journal puts
        the try its resumed record began in instead)."""
        from cancellable_agents.run.tool_calls import RunIdentity

        try_number = getattr(self.ti, "try_number", None)
        return RunIdentity(self.key, run_key, try_number if isinstance(try_number, int) else 0)

    def answers_for(self, run_key: str) -> dict[str, Decision] | None:
        """The answers if this execution resumes run ``run_key`` after its pause."""
        if self.answers is None or self.answers[0] != run_key:
            return None
        return self.answers[1]


def try_of(task: Any) -> TaskTry | None:
    """``task``'s try if it has one yet, else ``None``. Never makes one: a retry policy or a
    callback asking after the fact must not invent a scope that no kill could have reached."""
    found: TaskTry | None = getattr(task, "__dict__", {}).get(_KEY)
    return found


def try_for(task: Any, budget: float, context: Any = None) -> tuple[TaskTry, bool]:
    """``task``'s try, made on first use and never replaced; and whether a kill came before it
    was made (then the caller cancels it). A try made with ``context`` knows its task instance
    before anyone can see it: a SIGTERM handled the moment it appears must find the key, or its
    cause could not be asked for."""
    found = try_of(task)
    if found is not None:
        return found, False
    from cancellable_agents.core.scope import TaskCancellation

    name = getattr(task, "task_id", type(task).__name__)
    made = TaskTry(TaskCancellation(name, budget=budget), operator=type(task).__name__)
    if context is not None:
        made.know(context)
    # setdefault: of two threads making it at once, both get the first one stored.
    task_try: TaskTry = task.__dict__.setdefault(_KEY, made)
    return task_try, bool(task.__dict__.pop(_KILLED_BEFORE_TRY, False))


def note_kill_before_try(task: Any) -> None:
    """Remember a kill that came before the try was made (see [`try_for`][])."""
    task.__dict__[_KILLED_BEFORE_TRY] = True


def cancellation_of(task: Any) -> TaskCancellation | None:
    """The scope of ``task`` (an operator with the mixin) if it has one yet, else ``None``."""
    task_try = try_of(task)
    return task_try.scope if task_try is not None else None


def _classify(key: TaskInstanceKey) -> CauseVerdict:
    """Why a SIGTERM came (on the cause thread): from the try's log file, where the supervisor
    logs a refused heartbeat before it signals (``server_stop``); only where that cannot tell,
    the server's view through ``classify_sigterm`` (a round trip that queues behind every other
    task's requests at a busy API server, so the cause must not depend on it)."""
    from cancellable_agents.airflow._adapter import classify_sigterm
    from cancellable_agents.airflow._server_stop import server_stop_verdict

    return server_stop_verdict() or classify_sigterm(*key)
