"""Deferred tool calls in a durable run: a tool starts outside work and hands its result to a
trigger, the run stops at that step, and a later execution continues with the trigger's event as
the call's result.

The run side of the path [`cancellable_agents.durable._pauses`][] already takes for approvals:
a tool raises pydantic-ai's ``CallDeferred`` carrying a [`Wait`][] (what to wait on, as JSON)
in its metadata; the run ends with ``DeferredToolRequests``; the record holds the pending calls
with their waits; the outside work's results come back as
[`returned`][cancellable_agents.durable._pauses.Decision.returned] decisions, which the record keeps
and the continuing run gets as ``DeferredToolResults``. Airflow-free: a [`Wait`][] names a
trigger by class path and JSON keyword arguments; what runs it is the Airflow side's
([`cancellable_agents.airflow.deferral`][]).
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.durable._pauses import WAIT_KEY, Decision

#: What a deferred call's timeout does: the model is told (and the run goes on), or the task ends
#: as ``timeout``.
ON_TIMEOUT = ("tell", "fail")

#: Set while a journaled run goes (``Journal.attach`` to its end): only there may a tool defer,
#: since only a record lets a later execution continue the run with the result.
journaled_run: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cancellable_agents_journaled_run", default=False
)


@dataclass(frozen=True)
class Wait:
    """What a deferred call waits on: a trigger, rebuilt as ``import(classpath)(**kwargs)``.

    ``timeout_s``: how long the wait may take (``None``: no limit of its own). ``on_timeout``:
    what its end does, one of `ON_TIMEOUT` (``"tell"``: the model is told the call timed out;
    ``"fail"``: the task ends as ``timeout``).
    """

    classpath: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    on_timeout: str = "tell"

    def as_dict(self) -> dict[str, Any]:
        return {
            "classpath": self.classpath,
            "kwargs": self.kwargs,
            "timeout_s": self.timeout_s,
            "on_timeout": self.on_timeout,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Wait:
        timeout = data.get("timeout_s")
        return cls(
            str(data["classpath"]),
            dict(data.get("kwargs") or {}),
            None if timeout is None else float(timeout),
            str(data.get("on_timeout") or "tell"),
        )


def defer_call(wait: Wait) -> NoReturn:
    """End the current tool call as deferred until ``wait`` fires (raises pydantic-ai's
    ``CallDeferred``). Raises [`ConfigurationError`][] outside a journaled run, or for a
    ``wait`` whose keyword arguments are not JSON: the record could not hold it."""
    from pydantic_ai.exceptions import CallDeferred

    check_journaled(wait)
    try:
        json.dumps(wait.kwargs, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"a tool deferred to {wait.classpath} whose serialize() kwargs are not JSON ({exc}); the "
            f"record must hold them so a later try can wait again without running the tool again"
        ) from None
    raise CallDeferred(metadata={WAIT_KEY: wait.as_dict()})


def check_journaled(wait: Wait) -> None:
    """Refuse a deferral outside a journaled run ([`ConfigurationError`][] naming the fix)."""
    if not journaled_run.get():
        raise ConfigurationError(
            f"a tool deferred to {wait.classpath}, which needs durable=True on the task: the run stops at "
            f"that step, the task defers without a worker slot, and the next execution continues from the "
            f"record with the trigger's event as the tool's result"
        )


def results_as_decisions(results: Mapping[str, Any], source: str) -> dict[str, Decision]:
    """The outside work's results, by tool call id, as the decisions the record keeps. Raises
    [`ConfigurationError`][] for a result that is not JSON (``source`` names where it came
    from): the record could not hold it, and the model gets JSON."""
    decisions = {}
    for call_id, result in results.items():
        try:
            json.dumps(result, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"the result of deferred call {call_id} from {source} is not JSON ({exc}): "
                f"the trigger's event payload becomes the tool's result and must be JSON"
            ) from None
        decisions[str(call_id)] = Decision.returned(result)
    return decisions
