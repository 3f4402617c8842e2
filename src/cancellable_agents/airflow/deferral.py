"""Deferred tool calls on Airflow 3.3+: a tool starts outside work and calls [`defer_to`][]
with an Airflow trigger; the durable run stops at that step (its record holds the step and the
pending call), the task defers (no worker slot, no process), and when the trigger fires the task
resumes and the run continues from the record with the trigger's event as the call's result.

The Airflow side of [`cancellable_agents.durable._deferred_calls`][], on the path approvals take
([`cancellable_agents.airflow._approval`][]): the execute guard turns the paused run into
``TaskDeferred`` here instead of ``TaskAwaitingInput`` there. The task defers to one
[`DeferredCallsTrigger`][cancellable_agents.airflow.triggers.DeferredCallsTrigger] that waits
for every call of the step; Airflow hands its event to [`CancellableAgentMixin.resume_after_deferral`][].
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from cancellable_agents.airflow._adapter import has_trigger_on_kill
from cancellable_agents.core.exceptions import ConfigurationError

if TYPE_CHECKING:
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.durable._pauses import ApprovalRequest, Decision

__all__ = ["defer_to"]

log = logging.getLogger(__name__)

#: The operator method Airflow calls when the trigger fired (``TaskDeferred.method_name``).
RESUME_METHOD = "resume_after_deferral"
#: How long after the longest call's own timeout Airflow's deferral timeout fails the task (the
#: trigger should have fired by then: only a triggerer that was down all that time misses it).
BACKSTOP_S = 300.0
#: Module names a trigger class must not live under: the triggerer cannot import them (Airflow
#: loads a DAG file as ``unusual_prefix_<hash>_<name>``).
_UNIMPORTABLE = ("__main__", "unusual_prefix_")


def defer_to(trigger: Any, *, timeout: timedelta | float | None = None, on_timeout: str = "tell") -> NoReturn:
    """From a tool: end this call until ``trigger`` (any Airflow ``BaseTrigger``) fires; its
    event's payload becomes the call's result. The task defers meanwhile and holds no worker slot.

    Start the outside work first, then defer; the trigger's ``on_kill`` stops it when a user marks
    the deferred task failed or clears it. ``timeout``: how long the wait may take; then the
    trigger's ``on_kill`` stops the work, and ``on_timeout`` says what follows: ``"tell"`` (the
    model is told the call timed out: its result is ``{"error": "... did not finish within its
    timeout ..."}``, and the run goes on) or ``"fail"`` (the task ends as ``timeout``, the work of
    every call of the step stopped; [`TaskCancelled`][] names the wait). Needs
    ``durable=True`` and Airflow 3.3+; the trigger must serialize to an importable class and JSON
    keyword arguments. Raises [`ConfigurationError`][] naming the fix where any of that is
    missing.
    """
    from cancellable_agents.durable._deferred_calls import ON_TIMEOUT, Wait, check_journaled, defer_call

    if on_timeout not in ON_TIMEOUT:
        raise ConfigurationError(f"defer_to(on_timeout={on_timeout!r}): must be one of {ON_TIMEOUT}")
    classpath, kwargs = _serialized(trigger)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    wait = Wait(classpath, kwargs, None if seconds is None else float(seconds), on_timeout)
    check_journaled(wait)  # first: the fix every Airflow needs
    if not has_trigger_on_kill():
        import airflow

        raise ConfigurationError(
            f"a tool deferred to {classpath}, which needs Airflow 3.3+ (a trigger's on_kill stops the "
            f"outside work when a user stops the deferred task); this is Airflow {airflow.__version__}. "
            f"Upgrade, or "
            f"wait for the work inside the tool."
        )
    defer_call(wait)


def _serialized(trigger: Any) -> tuple[str, dict[str, Any]]:
    """``trigger.serialize()``, refused where the triggerer could not rebuild it."""
    serialize = getattr(trigger, "serialize", None)
    if not callable(serialize):
        raise ConfigurationError(f"defer_to() takes an Airflow trigger (a BaseTrigger), got {trigger!r}")
    classpath, kwargs = serialize()
    if classpath.startswith(_UNIMPORTABLE) or "." not in classpath:
        raise ConfigurationError(
            f"a tool deferred to {classpath}: the triggerer cannot import a trigger defined in a DAG file; "
            f"put the trigger class in a module on the triggerer's path (a package, or plugins)"
        )
    return classpath, dict(kwargs)


def deferral_for(
    operator: Any, request: ApprovalRequest, try_waits: list[dict[str, Any]] | None = None
) -> BaseException:
    """The ``TaskDeferred`` that waits for every pending call of ``request`` (one trigger for all),
    with the shortest timeout any call gave; ``try_waits``, the try's waits so far, ride along to the
    resumed execution."""
    from airflow.sdk.exceptions import TaskDeferred

    from cancellable_agents.airflow.triggers import DeferredCallsTrigger
    from cancellable_agents.durable._deferred_calls import Wait

    waits = {c.tool_call_id: Wait.from_dict(c.wait) for c in request.calls if c.wait is not None}
    calls = [
        {
            "tool_call_id": c.tool_call_id,
            "tool": c.tool_name,
            "classpath": w.classpath,
            "kwargs": w.kwargs,
            "timeout_s": w.timeout_s,
            "on_timeout": w.on_timeout,
        }
        for c in request.calls
        if (w := waits.get(c.tool_call_id)) is not None
    ]
    log.warning(
        "deferred: %s wait%s on %s; the task holds no worker slot while it waits",
        ", ".join(c.tool_name for c in request.calls),
        "s" if len(calls) == 1 else "",
        ", ".join(sorted({w.classpath.rsplit(".", 1)[-1] for w in waits.values()})),
    )
    return TaskDeferred(
        trigger=DeferredCallsTrigger(request.run_key, calls, time.time()),
        method_name=RESUME_METHOD,
        kwargs={"run_key": request.run_key, "waits": list(try_waits or ())},
        timeout=_backstop(list(waits.values())),
    )


def _backstop(waits: list[Any]) -> timedelta | None:
    """Airflow's own timeout for the deferral: only a backstop. The trigger ends each call's wait
    at its timeout itself and stops that call's work (Airflow's timeout fails the task without
    the trigger's ``on_kill``); Airflow's fires only if no triggerer ran the trigger in time."""
    if not waits or any(w.timeout_s is None for w in waits):
        return None
    return timedelta(seconds=max(w.timeout_s for w in waits) + BACKSTOP_S)


def answers_from_event(event: Any) -> tuple[str, dict[str, Decision]]:
    """The run key and the deferred calls' results from the
    [`DeferredCallsTrigger`][cancellable_agents.airflow.triggers.DeferredCallsTrigger] event
    Airflow hands the resumed task. Raises [`ConfigurationError`][] for a result that is not
    JSON (the record keeps it, the model reads it)."""
    from cancellable_agents.durable._deferred_calls import results_as_decisions

    if not isinstance(event, dict) or not isinstance(event.get("results"), dict):
        raise ConfigurationError(f"resumed after a deferral without the trigger's results: {event!r}")
    return str(event.get("run_key", "0")), results_as_decisions(
        event["results"], "the deferred calls' trigger"
    )


def end_if_timed_out(task_try: TaskTry, event: dict[str, Any]) -> str | None:
    """If a call whose ``on_timeout`` is ``"fail"`` timed out: cancel the try's scope as
    ``TIMEOUT`` naming the wait (nothing runs: the run is not continued), and return the message
    the [`TaskCancelled`][] carries."""
    failed = event.get("failed")
    if not failed:
        return None
    from cancellable_agents.core.causes import CancelCause
    from cancellable_agents.core.scope import Outcome

    timeout_s = float(failed.get("timeout_s") or 0.0)
    wait = f"deferred call {failed.get('tool')} ({failed.get('tool_call_id')}) waited {timeout_s:g} s"
    log.warning("%s, its timeout: the outside work of the step was stopped; the task ends as timeout", wait)
    scope = task_try.scope
    scope.cancel(CancelCause.TIMEOUT, detail=f"deferral timeout: {wait}")
    scope.record("execute_refused", reason="the deferral timed out")
    scope.settle(Outcome.CANCELLED)
    return f"the wait for outside work timed out: {wait}"


def note_wait(task_try: TaskTry, event: dict[str, Any], earlier: Any = ()) -> None:
    """The wait that just ended, named where a try's facts go: one log line, the try's facts
    (``attached["deferred"]``, and with ``earlier``, the try's waits before it, ``attached["waits"]``:
    in the kill record of a later kill, or the try's stored facts) and the metrics
    (``deferred.wait``: the seconds the task held no worker slot)."""
    from cancellable_agents.airflow._metrics import emit_deferred_wait
    from cancellable_agents.airflow.kill_record._try_facts import WaitFacts, wait_facts

    fired = float(event.get("fired_at") or time.time())
    waited = max(0.0, fired - float(event.get("deferred_at") or fired))
    results = event["results"]
    timed_out = sorted(event.get("timed_out") or ())
    log.info(
        "deferred: %d call(s) answered after %.1f s without a worker slot%s",
        len(results),
        waited,
        f"; timed out, their work stopped: {timed_out}" if timed_out else "",
    )
    facts = {"waited_s": round(waited, 3), "calls": sorted(results), "timed_out": timed_out}
    if event.get("failed"):
        facts["failed"] = event["failed"]  # the call whose timeout ended the task
    task_try.waits = wait_facts(
        earlier or (), WaitFacts("deferred", waited, tuple(sorted(results)), tuple(timed_out), fired)
    )
    task_try.scope.attach(deferred=facts, waits=task_try.waits)
    emit_deferred_wait(task_try, waited, len(results))
