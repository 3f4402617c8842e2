"""The resume decision: whether a try continues what an earlier try recorded, as a plan.

[`plan_resume`][] is pure: it takes what was read from the store (a checked record, none, or
the problem that makes it unusable) and this try's facts, and returns [`StartFresh`][] or
[`Resume`][]. It reads no store, writes nothing and logs nothing ([`announce`][] logs a
plan); the journal applies the plan. Apart from the journal so that the policy reads in one
place: a try resumes when the previous one was evicted, timed out, ended for an unknown reason
or died without a word; a user's stop (Clear) starts fresh unless ``resume_after_clear``; any
doubt about the record starts fresh (a partial transcript is never fed to the model silently).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import ModelResponse, ToolCallPart

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.durable._deferred_calls import Wait
from cancellable_agents.durable._pauses import ApprovalRequest, Decision
from cancellable_agents.durable._reasons import FreshStart
from cancellable_agents.durable._record_format import AWAITING, LoadedRecord, RecordProblem
from cancellable_agents.durable._resume import ResumeInfo
from cancellable_agents.durable._try_usage import TryUsage

log = logging.getLogger(__name__)

#: An older try whose last entry is younger than this and that wrote no end may still be alive.
LIVE_WINDOW_S = 30.0


@dataclass(frozen=True)
class StartFresh:
    """This try does not continue the record: it runs from its prompt and starts a new chain."""

    reason: FreshStart
    #: What the one log line names: the record's problem, or what the user did.
    detail: str = ""
    #: The try a user stopped (`FreshStart.USER_STOP` only).
    stopped_try: int | None = None


@dataclass(frozen=True)
class Approval:
    """The approval the resumed record is stopped at, and how this execution answers it."""

    request: ApprovalRequest
    #: What the run continues with; ``None``: nobody answered yet (the run still waits).
    decisions: dict[str, Decision] | None
    #: The decisions came with this execution: they are recorded before the run goes on.
    new: bool = False
    #: Tool names of the pending calls the given answers leave undecided (the run cannot go on).
    undecided: tuple[str, ...] = ()
    #: Tool names of the pending calls whose given answer was for other arguments: asked again.
    stale: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resume:
    """This try continues ``record``: its messages are the run's history."""

    record: LoadedRecord
    #: What the run's tools are told (``current_resume()``).
    info: ResumeInfo
    #: Results of the resumed response's calls that had returned, by tool call id: each is
    #: handed back once instead of running the call.
    replay: dict[str, Any]
    #: Usage of every earlier try (the record's head carries it on).
    earlier: list[TryUsage]
    #: This try's own usage before an approval pause it continues; ``None``: no such pause.
    paused: TryUsage | None
    #: The approval the record is stopped at; ``None``: it is not.
    approval: Approval | None
    #: How the previous try ended, for the log line.
    how_ended: str
    #: Age in seconds of the last entry of a previous try that wrote no end and may still run.
    alive_age: float | None = None


def plan_resume(
    found: LoadedRecord | RecordProblem | None,
    *,
    try_number: int,
    clear_count: int | None,
    resume_after_clear: bool,
    answers: dict[str, Decision] | None,
    now: float,
) -> StartFresh | Resume:
    """Whether try ``try_number`` continues ``found`` (what the store held), and how.

    ``answers``: a reviewer's decisions this execution brings for an approval the record is
    stopped at; ``now``: the journal's clock, to tell whether the previous try may still run.
    """
    if isinstance(found, RecordProblem):
        return StartFresh(found.reason, str(found))
    if found is None:
        return StartFresh(FreshStart.NO_RECORD)
    previous = found.owner_try
    end = found.end_of(previous)
    stopped_by_user = _stopped_by_user(found, end, clear_count)
    if stopped_by_user and not resume_after_clear:
        return StartFresh(FreshStart.USER_STOP, stopped_by_user, previous)
    if not found.messages:
        return StartFresh(FreshStart.NOTHING_RECORDED)
    replay = found.returned_in_flight()
    paused = found.approval()
    # A user's stop of a deferred try reached its trigger's on_kill, and a failing timeout ran it
    # itself: either way the outside work is stopped.
    stopped = bool(stopped_by_user) or _failing_wait_timed_out(found, paused, now)
    approval = _approval(paused, answers, work_stopped=stopped and previous != try_number)
    ran = paused
    if approval is not None and paused is not None and approval.new and paused[0].is_deferral:
        ran = (approval.request, approval.decisions)  # its calls started their work: they run again
    info = ResumeInfo(
        try_number, previous, len(found.messages), _in_flight(found, ran) - set(replay), frozenset(replay)
    )
    tries = found.tries()
    this_try = next((t for t in tries if t.try_number == try_number), None)
    return Resume(
        record=found,
        info=info,
        replay=replay,
        earlier=[t for t in tries if t.try_number != try_number],
        paused=this_try if previous == try_number else None,
        approval=approval,
        how_ended=_how_ended(end, paused),
        alive_age=_alive_age(found, now) if end is None and previous != try_number else None,
    )


def announce(plan: StartFresh | Resume) -> None:
    """Log ``plan``: a warning for a resume and for a record not used, a note for a user's stop."""
    if isinstance(plan, Resume):
        _announce_resume(plan)
    elif plan.reason == FreshStart.USER_STOP:
        log.info(
            "durable: try %s was stopped by a user (%s); starting fresh (resume_after_clear=True "
            "would resume)",
            plan.stopped_try,
            plan.detail,
        )
    elif plan.detail:
        log.warning("durable: not resuming from the stored record: %s; starting fresh", plan.detail)


def _announce_resume(plan: Resume) -> None:
    if plan.approval is not None and plan.approval.stale:
        log.warning(
            "durable: the answer given was for other arguments of %s than the run would call "
            "them with; asking again",
            list(plan.approval.stale),
        )
    if plan.alive_age is not None:
        log.warning(
            "durable: try %s wrote no end and its last step is %.0f s old: it may still be running. "
            "It is fenced off: its further appends land under its own keys, which no newer try reads, "
            "and it cancels itself when it next looks.",
            plan.info.from_try,
            plan.alive_age,
        )
    rerun, replayed = plan.info.rerun_tool_calls, plan.info.replayed_tool_calls
    log.warning(
        "durable: resuming from try %s (%s): %d messages restored, %d tool call(s) in flight run again%s",
        plan.info.from_try,
        plan.how_ended,
        plan.info.messages,
        len(rerun),
        f", {len(replayed)} that had returned get their recorded result" if replayed else "",
    )


def _how_ended(
    end: dict[str, Any] | None, paused: tuple[ApprovalRequest, dict[str, Decision] | None] | None
) -> str:
    """How the previous execution ended, for the log line."""
    if end is None:
        return "died without a word"
    if paused is not None and end.get("state") == AWAITING:
        return "deferred to outside work" if paused[0].is_deferral else "awaiting approval"
    return f"ended {end.get('cause') or end.get('state')}"


def _stopped_by_user(loaded: LoadedRecord, end: dict[str, Any] | None, clear_count: int | None) -> str:
    """What the user did to the previous try, if anything: its end entry says so, or (a cleared
    try can no longer write: its task instance is gone) the clear count grew since it began."""
    if end is not None and end.get("cause") == CancelCause.USER.value:
        return str(end.get("action") or "user")
    before = loaded.head.get("clears")
    if clear_count is not None and isinstance(before, int) and clear_count > before:
        return f"cleared: the DAG run's clear count went from {before} to {clear_count}"
    return ""


def _in_flight(
    loaded: LoadedRecord, paused: tuple[ApprovalRequest, dict[str, Decision] | None] | None
) -> frozenset[str]:
    """The tool calls that may have started and not returned: those of the last message (a
    model response whose step did not complete). At an approval, calls still waiting never ran;
    approved ones ran only if an execution took the answer in (its decisions are in the record)
    and stopped before its next step."""
    if paused is not None:
        # A deferred call's result came from outside: it does not run again.
        return frozenset(call_id for call_id, d in (paused[1] or {}).items() if d.approved and not d.external)
    last = loaded.messages[-1]
    if not isinstance(last, ModelResponse):
        return frozenset()
    return frozenset(p.tool_call_id for p in last.parts if isinstance(p, ToolCallPart))


def _approval(
    paused: tuple[ApprovalRequest, dict[str, Decision] | None] | None,
    answers: dict[str, Decision] | None,
    *,
    work_stopped: bool,
) -> Approval | None:
    """The answer to the approval the record is stopped at: the record's, else ``answers``'.

    A deferral whose outside work was stopped (``work_stopped``: a user cleared the deferred try
    and the run resumes after a clear, or a failing timeout ended it) is not waited on again: its
    pending calls run again (as any call in flight), each starting its work anew. Otherwise a new
    try waits on the same work (Airflow's own deferral timeout fails a try without stopping it)."""
    if paused is None:
        return None
    request, recorded = paused
    if recorded is not None:
        return Approval(request, recorded)
    if answers is None and work_stopped and request.is_deferral:
        return Approval(request, {c.tool_call_id: Decision(True) for c in request.calls}, new=True)
    if answers is None:
        return Approval(request, None)
    stale = tuple(
        c.tool_name
        for c in request.calls
        if c.tool_call_id in answers and not answers[c.tool_call_id].answers(c)
    )
    if stale:  # the reviewer consented to other arguments than the run would call with
        return Approval(request, None, stale=stale)
    decisions = {c.tool_call_id: answers[c.tool_call_id] for c in request.calls if c.tool_call_id in answers}
    undecided = tuple(c.tool_name for c in request.calls if c.tool_call_id not in decisions)
    return Approval(request, decisions, new=True, undecided=undecided)


def _failing_wait_timed_out(
    loaded: LoadedRecord, paused: tuple[ApprovalRequest, dict[str, Decision] | None] | None, now: float
) -> bool:
    """Whether a deferred call the record is stopped at had ``on_timeout="fail"`` and its timeout
    has passed since the run paused: its trigger then stopped the step's work and ended the try
    (``airflow.deferral.end_if_timed_out``), so nothing is left to wait on."""
    if paused is None or not paused[0].is_deferral:
        return False
    pauses = [e for e in loaded.entries if e["kind"] == "end" and e.get("state") == AWAITING]
    at = [float(e.get("at", 0.0)) for e in pauses]
    waits = [Wait.from_dict(c.wait) for c in paused[0].calls if c.wait is not None]
    return bool(at) and any(
        w.on_timeout == "fail" and w.timeout_s is not None and now >= at[-1] + w.timeout_s for w in waits
    )


def _alive_age(loaded: LoadedRecord, now: float) -> float | None:
    """How old the previous try's last entry is, if young enough for that try to still run."""
    if not loaded.entries:
        return None
    age = now - float(loaded.entries[-1].get("at", 0.0))
    return age if age < LIVE_WINDOW_S else None
