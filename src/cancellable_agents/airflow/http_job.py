"""Outside work behind an HTTP status URL: [`HttpJobTrigger`][] polls it until the job is done
and, when a user stops the deferred task, asks the job's cancel URL to stop it.

The common shape of a job service (a batch inference API, a Spark/dbt/CI service's REST API):
``GET status_url`` answers JSON with a state field; a done state carries the result; a failed
state ends the wait with an error. Stdlib HTTP on a thread of the triggerer (no client library
to install there). For auth, signing or another protocol, write a status callable around your
own client and pass it to [`PollTrigger`][cancellable_agents.airflow.triggers.PollTrigger]: a trigger's
keyword arguments are stored in Airflow's database, so no secret belongs in them.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Sequence
from typing import Any

from cancellable_agents.airflow.triggers import PollTrigger

__all__ = ["HttpJobFailed", "HttpJobTrigger"]

log = logging.getLogger(__name__)

DONE_STATES = ("done", "succeeded", "success", "completed", "finished")
FAILED_STATES = ("failed", "error", "cancelled", "canceled", "aborted")


class HttpJobFailed(RuntimeError):
    """The job service reported the job failed: the deferred call's wait ends with this error."""


def status(
    status_url: str,
    state_field: str = "state",
    result_field: str | None = "result",
    done: Sequence[str] = DONE_STATES,
    failed: Sequence[str] = FAILED_STATES,
    request_timeout: float = 30.0,
    **_: Any,
) -> Any:
    """The [`PollTrigger`][] status of the job at ``status_url``: ``None`` while it runs; once
    its ``state_field`` is a ``done`` state, its ``result_field`` (the whole body if ``None`` or
    absent). Raises [`HttpJobFailed`][] for a ``failed`` state; an HTTP or network error raises
    too (the wait ends: a status URL that fails is not retried behind the task's back)."""
    with urllib.request.urlopen(status_url, timeout=request_timeout) as response:
        body = json.loads(response.read() or b"null")
    state = str(body.get(state_field, "")).lower() if isinstance(body, dict) else ""
    if state in {s.lower() for s in failed}:
        raise HttpJobFailed(f"{status_url} reports the job {state}: {json.dumps(body)[:500]}")
    if state not in {s.lower() for s in done}:
        return None
    if result_field is not None and isinstance(body, dict) and result_field in body:
        return body[result_field]
    return body


def cancel(
    status_url: str,
    cancel_url: str | None = None,
    cancel_method: str = "POST",
    request_timeout: float = 30.0,
    **_: Any,
) -> None:
    """Ask the job service to stop the job (``cancel_method`` to ``cancel_url``); from the
    trigger's ``on_kill``. Without a ``cancel_url`` there is nothing to ask: logged, not raised."""
    if cancel_url is None:
        log.warning(
            "no cancel_url for the job at %s: it keeps running after the task was stopped", status_url
        )
        return
    method = cancel_method.upper()
    request = urllib.request.Request(cancel_url, method=method, data=None if method == "DELETE" else b"")
    with urllib.request.urlopen(request, timeout=request_timeout) as response:
        log.info("asked %s %s to stop the job: HTTP %s", method, cancel_url, response.status)


class HttpJobTrigger(PollTrigger):
    """Wait for the job behind ``status_url`` (see [`status`][]); a user's *Mark failed* or
    *Clear* of the deferred task sends ``cancel_method`` to ``cancel_url`` (see [`cancel`][]).

    :param status_url: ``GET`` answers JSON with ``state_field``.
    :param cancel_url: where to ask the job to stop; ``None``: the job is not stopped.
    :param done: states that mean the job finished; its ``result_field`` is the call's result.
    :param failed: states that mean it failed; the wait ends with [`HttpJobFailed`][].
    :param interval: seconds between polls.
    """

    def __init__(
        self,
        status_url: str,
        *,
        cancel_url: str | None = None,
        cancel_method: str = "POST",
        state_field: str = "state",
        result_field: str | None = "result",
        done: Sequence[str] = DONE_STATES,
        failed: Sequence[str] = FAILED_STATES,
        interval: float = 5.0,
        request_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            f"{__name__}.status",
            {
                "status_url": status_url,
                "cancel_url": cancel_url,
                "cancel_method": cancel_method,
                "state_field": state_field,
                "result_field": result_field,
                "done": list(done),
                "failed": list(failed),
                "request_timeout": float(request_timeout),
            },
            interval=interval,
            cancel=f"{__name__}.cancel",
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Rebuilt as a PollTrigger: the same behaviour, and one class the triggerer imports.
        return PollTrigger(self.status, self.kwargs, self.interval, self.cancel).serialize()
