"""Tool approval on Airflow 3.3+: a durable run stopped at an approval parks its task in
AWAITING_INPUT with a Required Actions form, holding no worker slot and no process; the answer
(or the wait's timeout) resumes the task, which continues the run from its record.

The Airflow side of [`cancellable_agents.durable._pauses`][]. Airflow hands the resumed task
the form's answer as ``next_kwargs["event"]`` (``chosen_options``, ``params_input``,
``responded_by_user``, ``timedout``; or ``error`` when the wait timed out with no default), the
same payload as the standard provider's ``HITLOperator.execute_complete`` gets.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from cancellable_agents.airflow._adapter import has_task_awaiting_input
from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.durable._fingerprint import tools_requiring_approval

if TYPE_CHECKING:  # checked at parse time; the requests and decisions exist when a task runs
    from cancellable_agents.airflow.task_try import TaskTry
    from cancellable_agents.durable._pauses import ApprovalRequest, Decision

log = logging.getLogger(__name__)

APPROVE, REJECT = "Approve", "Reject"
#: The operator method Airflow calls when the answer arrives (``TaskAwaitingInput.method_name``).
RESUME_METHOD = "resume_after_approval"
#: The form field naming the call its ``arguments`` belong to.
CALL_FIELD = "tool_call_id"
#: Under every form: Airflow keeps a task instance's first form (subject, body, fields) for its
#: later pauses in the same try (3.3.2, ``upsert_hitl_detail``), so a reviewer of a later one
#: reads an earlier call here.
LATER_PAUSES_NOTE = (
    "_If this task asks again later in this try, Airflow keeps showing this first form: the call "
    'then waiting is named in the task log\'s last "awaiting approval" line, and arguments edited '
    "here apply only to the call above._"
)
#: What to do when nobody answers within ``approval_timeout``.
TIMEOUT_DEFAULTS = ("reject", "fail")


def check_approvals(operator: Any, tools: Any = (), toolsets: Any = (), agent: Any = None) -> None:
    """At DAG parse time: refuse ``requires_approval`` tools where the task cannot wait for the
    answer without holding a worker (no ``durable=True``, or Airflow below 3.3), naming the fix."""
    names = tools_requiring_approval(tools, toolsets, agent)
    if not names:
        return
    task = getattr(operator, "task_id", type(operator).__name__)
    if getattr(operator, "approval_timeout_default", "reject") not in TIMEOUT_DEFAULTS:
        raise ConfigurationError(f"{task}: approval_timeout_default must be one of {TIMEOUT_DEFAULTS}")
    if not getattr(operator, "durable", False):
        raise ConfigurationError(
            f"{task}: tool(s) {names} require approval, which needs durable=True: the run stops at "
            f"the approval, the task waits without a worker slot, and the next execution continues "
            f"from the record."
        )
    if not has_task_awaiting_input():
        import airflow

        raise ConfigurationError(
            f"{task}: tool(s) {names} require approval, which needs Airflow 3.3+ (a task waiting for input "
            f"holds no worker slot there); this is Airflow {airflow.__version__}. Upgrade to Airflow 3.3, or "
            f"drop requires_approval from these tools."
        )


def park(
    operator: Any, request: ApprovalRequest, context: Any, waits: list[dict[str, Any]] | None = None
) -> BaseException:
    """Ask for the answer (the Required Actions form) and return the ``TaskAwaitingInput`` that
    parks the task until it comes; the request, when it was asked and ``waits`` (the try's waits
    so far) ride along for the resumed execution."""
    from airflow.sdk.exceptions import TaskAwaitingInput
    from airflow.sdk.execution_time.hitl import upsert_hitl_detail

    timeout_default = getattr(operator, "approval_timeout_default", "reject")
    upsert_hitl_detail(
        ti_id=context["task_instance"].id,
        options=[APPROVE, REJECT],
        subject=f"Approve {', '.join(c.tool_name for c in request.calls)}?",
        body=f"{request.describe()}\n\n{LATER_PAUSES_NOTE}",
        defaults=[REJECT] if timeout_default == "reject" else None,
        params=_form(request),
    )
    log.warning(
        "awaiting approval of %s; the task holds no worker slot while it waits",
        ", ".join(f"{c.tool_name}({c.args_text()})" for c in request.calls),
    )
    return TaskAwaitingInput(
        method_name=RESUME_METHOD,
        kwargs={"request": request.as_dict(), "asked_at": time.time(), "waits": list(waits or ())},
        timeout=getattr(operator, "approval_timeout", None),
    )


def _form(request: ApprovalRequest) -> dict[str, Any]:
    """The form's fields (serialized ``Param``\\ s): a message the model gets on reject; for a
    single call, its arguments, which the reviewer may edit before approving."""
    from airflow.sdk import Param

    fields = {
        "message": Param(
            "",
            type=["null", "string"],
            title="Message to the model",
            description="On Reject: what the agent is told instead of the tool's result.",
        )
    }
    if len(request.calls) == 1:
        fields["arguments"] = Param(
            request.calls[0].args,
            type="object",
            title="Arguments",
            description="On Approve: the tool runs with these (edit them to change the call).",
        )
        # Which call the arguments belong to: Airflow keeps a task instance's first form (its
        # body and fields) for every later pause of the same try, so a later answer may come
        # from a form made for an earlier call; its arguments must not be applied to this one.
        fields[CALL_FIELD] = Param(request.calls[0].tool_call_id, type="string", title="Call (do not edit)")
    return {name: param.serialize() for name, param in fields.items()}


def note_approval_wait(task_try: TaskTry, request: ApprovalRequest, asked_at: Any, earlier: Any = ()) -> None:
    """The approval wait that just ended (from ``asked_at``, when the form was asked, to now),
    after the try's ``earlier`` waits: the try's facts (``attached["waits"]``: in the kill record
    of a later kill, or the try's stored facts). A pause parked before ``asked_at`` was carried
    has no start: its wait is not counted."""
    from cancellable_agents.airflow.kill_record._try_facts import WaitFacts, wait_facts

    if not isinstance(asked_at, int | float) or isinstance(asked_at, bool):
        return
    now = time.time()
    calls = tuple(sorted(c.tool_name for c in request.calls))
    wait = WaitFacts("approval", max(0.0, now - asked_at), calls, (), now)
    task_try.waits = wait_facts(earlier or (), wait)
    task_try.scope.attach(waits=task_try.waits)


def decisions_from_event(event: dict[str, Any], request: ApprovalRequest) -> dict[str, Decision]:
    """The reviewer's answer as a decision for every pending call (one answer for the step).

    Raises ``AirflowFailException`` (no retry) for a wait that timed out with no default
    (``approval_timeout_default="fail"``).
    """
    if "error" in event:
        # Failed for good: a retry would only ask again, which is what the default "reject" is for.
        from airflow.sdk.exceptions import AirflowFailException

        names = [c.tool_name for c in request.calls]
        raise AirflowFailException(f"no answer to the approval of {names} in time: {event['error']}")
    from cancellable_agents.durable._pauses import Decision

    params = event.get("params_input") or {}
    if APPROVE in (event.get("chosen_options") or ()):
        edited = params.get("arguments") if _form_of(request, params) else None
        return {
            c.tool_call_id: Decision(
                True,
                override_args=edited if len(request.calls) == 1 and edited and edited != c.args else None,
                args=c.args,
            )
            for c in request.calls
        }
    message = params.get("message") or _rejection(event)
    return {c.tool_call_id: Decision(False, message, args=c.args) for c in request.calls}


def _form_of(request: ApprovalRequest, params: dict[str, Any]) -> bool:
    """Whether the answered form was made for ``request`` (not kept from an earlier pause)."""
    if len(request.calls) == 1 and params.get(CALL_FIELD) == request.calls[0].tool_call_id:
        return True
    if params.get("arguments") is not None:
        log.warning(
            "the answered form was made for an earlier approval of this task (Airflow keeps a task "
            "instance's first form); its arguments are not applied to %s",
            [c.tool_name for c in request.calls],
        )
    return False


def _rejection(event: dict[str, Any]) -> str:
    if event.get("timedout"):
        return "Nobody answered the approval request in time; the call was rejected by default."
    who = (
        (event.get("responded_by_user") or {}).get("name")
        if isinstance(event.get("responded_by_user"), dict)
        else None
    )
    return f"A reviewer{f' ({who})' if who else ''} rejected this tool call."
