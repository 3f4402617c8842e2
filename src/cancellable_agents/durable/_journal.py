"""The journal: one durable run's continuity record in one try (``durable=True``), its life in
order: take the record over before the run, record each step while it goes, write how it ended.

The record lives in a key-value store that survives the task's retries (Airflow 3.3's task state
store, or files under an ``ObjectStoragePath``). It is written while the run goes, never at kill
time (a SIGKILL leaves no time), at most one store call per step that calls tools, stored while
those tools run (``write_ahead=True``: before they start); entries that queue while a call is in
flight go out together in the next, and the run waits for the store only when more than
``max_unconfirmed`` are not yet stored. So a stop that lets the try unwind never
costs a model request that was answered, and the cost of a step does not grow with the history.

Rooms, each with its contract at its top: [`resume_plan`][cancellable_agents.durable._resume_plan] decides
whether this try continues an earlier one (pure: a plan, applied here);
[`appender`][cancellable_agents.durable._appender] chains, stores and fences the entries (the writer
thread lives there, and the thread rules with it); [`steps`][cancellable_agents.durable._steps]
decides which messages go into which entry, and when;
[`run_arguments`][cancellable_agents.durable._run_arguments] rewrites the run's arguments to
resume; [`record_format`][cancellable_agents.durable._record_format] is the format.
This module holds what spans them: the order of one try's life, its usage, and the facts the
kill record and the metrics read. Airflow-free: the store is anything with
``get``/``set``/``delete`` of JSON values.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelResponse

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable import _run_arguments as run_arguments
from cancellable_agents.durable._appender import MAX_UNCONFIRMED, OWNER_CHECK_S, Appender
from cancellable_agents.durable._capability import JournalCapability
from cancellable_agents.durable._deferred_calls import journaled_run
from cancellable_agents.durable._fingerprint import fingerprint
from cancellable_agents.durable._pauses import (
    ApprovalNotPossible,
    ApprovalRequest,
    AwaitingApproval,
    Decision,
    request_of,
)
from cancellable_agents.durable._reasons import FreshStart, RecordingOff
from cancellable_agents.durable._record_format import (
    AWAITING,
    KEY_PREFIX,
    LoadedRecord,
    RecordProblem,
    dump_messages,
    load_record,
)
from cancellable_agents.durable._resume import ResumeInfo, active_resume
from cancellable_agents.durable._resume_plan import Resume, StartFresh, announce, plan_resume
from cancellable_agents.durable._steps import StepRecorder
from cancellable_agents.durable._stores import Store
from cancellable_agents.durable._try_usage import TryUsage, minus_usage, total_usage

log = logging.getLogger(__name__)

#: How long the tool returns wait for the next model response before they are appended alone.
RETURNS_FLUSH_S = 1.0


@dataclass
class Journal:
    """One run's continuity record in one try: resume from it, append to it, end it.

    Used from the run's thread only (the store may not be called from a signal handler; its
    [`Appender`][cancellable_agents.durable._appender.Appender] stores appends on a writer
    thread, one at a time, in order): [`attach`][] before the run, each graph step recorded by
    the capability it adds ([`steps`][cancellable_agents.durable._steps]), [`cancelled`][] then
    [`write_end`][], or [`completed`][], after the run. That order is kept in one place,
    ``run.runner._run_journaled``: pass the journal to ``run_agent_in_scope(..., journal=)``. Building one
    touches no store; its parameters are read then. A store error disables the journal for the rest of the run
    with
    one warning; the run itself goes on.

    :param try_number: this try (Airflow's ``ti.try_number``); written into every entry.
    :param resume_after_clear: resume also after a user's stop (Clear); default: fresh start.
    :param usage_spans_tries: the run's ``usage_limits`` also count earlier tries' usage.
    :param clear_count: how often the task's run was cleared by a user so far (Airflow's
        ``dag_run.clear_number``); a try cleared away cannot write its end, so a count that grew
        since the previous try began means that try was cleared.
    :param on_step_written: called with the milliseconds each recorded step took to write
        (one store call; with the ownership check when it is due), on the writer's thread: how the
        Airflow side times the journal without this module knowing about metrics. It must be
        quick; what it raises is ignored.
    :param returns_flush_s: how long tool returns wait to ride along with the next model
        response's entry before they are appended on their own (``0``: at once, two store calls
        per step). It bounds the window in which a SIGKILL reruns a call that had returned.
    :param write_ahead: store each step's entry before its tools start (the run waits for the
        round trip) instead of while they run: a call started just before a SIGKILL is then
        always known to the next try as a rerun, at the cost of one store round trip per step.
    :param beside_is_safe: asked before each append that would overlap the run; ``False`` stores
        that entry before the run goes on, as ``write_ahead`` does. The Airflow side says
        ``False`` once the task used Airflow's async API on its event loop: from then on Airflow's
        comms refuse a sync call on that loop while another thread (this journal's writer)
        holds the channel (``DeadlockImminentError``).
    :param max_unconfirmed: how many appended entries may be not yet stored before the run
        waits for the store (each is a completed step or a parallel call's result): what a
        SIGKILL can cost is at most this many completed steps, repeated by the next try. The
        entries that queue meanwhile are stored together, in one call.
    :param batch_window_s: how long an entry may wait for later ones to share its store call
        (``0``: it goes out as soon as no call is in flight). Where every call is a round trip
        through a shared server (Airflow's API server), fewer calls leave it to the fleet's
        heartbeats; a SIGKILL in the window repeats its steps, still at most
        ``max_unconfirmed``. An entry that came more than half a window after the one before
        waits for none; a batch that holds half of ``max_unconfirmed`` goes out without waiting
        for the rest of its window (the other half rides out the call); an unwind, the run's
        end, ``write_ahead`` and a full ``max_unconfirmed`` store what waits at once.
    :param owner_check_s: how often (seconds of ``clock``) the run looks whether a newer try of
        the task took over, and cancels itself if so (``0``: before every append). Fencing does
        not depend on it: a stale try's appends never reach what a newer try resumes from; this
        only stops its wasted work should Airflow's heartbeat not end it first.
    :param answers: a reviewer's decisions, by tool call id, for the approval the record is
        stopped at (see [`cancellable_agents.durable._pauses`][]): this execution continues
        the same try after its pause (its own segment is read too) and the answer is recorded
        before the run goes on. A record stopped at an approval with no answers, here or in
        the record, raises [`AwaitingApproval`][] again from [`attach`][], with no request.
    """

    store: Store
    try_number: int
    run_key: str = "0"
    resume_after_clear: bool = False
    usage_spans_tries: bool = False
    scope: TaskCancellation | None = None
    clear_count: int | None = None
    clock: Any = time.time
    on_step_written: Callable[[float], None] | None = None
    returns_flush_s: float = RETURNS_FLUSH_S
    owner_check_s: float = OWNER_CHECK_S
    max_unconfirmed: int = MAX_UNCONFIRMED
    batch_window_s: float = 0.0
    write_ahead: bool = False
    beside_is_safe: Callable[[], bool] | None = None
    answers: dict[str, Decision] | None = None
    resume: ResumeInfo | None = None
    earlier: list[TryUsage] = field(default_factory=list)
    # The run's thread only (the writer thread's state is the appender's, stated there).
    _appender: Appender = field(init=False)
    _steps: StepRecorder = field(init=False)
    _fresh: FreshStart | None = None
    _resume_token: contextvars.Token[ResumeInfo | None] | None = None
    _journaled_token: contextvars.Token[bool] | None = None
    _end: dict[str, Any] | None = None  # the end `cancelled` noted for `write_end`
    #: This try's usage before an approval pause it continues (added to the run's own).
    _paused: TryUsage | None = None
    #: The try the resumed record began in (``None``: this try's run begins its own).
    _origin: int | None = None
    #: Model responses restored from earlier tries' segments (the steps not repeated), by try.
    _reused: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._appender = Appender(
            self.store,
            self.key,
            self.try_number,
            scope=self.scope,
            clock=self.clock,
            owner_check_s=self.owner_check_s,
            write_ahead=self.write_ahead,
            beside_is_safe=self.beside_is_safe,
            on_step_written=self.on_step_written,
            max_unconfirmed=self.max_unconfirmed,
            batch_window_s=self.batch_window_s,
        )
        self._steps = StepRecorder(
            self._appender, returns_flush_s=self.returns_flush_s, write_ahead=self.write_ahead
        )

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}.{self.run_key}"

    @property
    def origin_try(self) -> int:
        """The try whose run began the transcript this try continues: the first segment of a
        resumed record, else this try (a fresh start begins a new transcript). The run's tool
        calls derive their idempotency keys from it, so a resumed call keeps its key."""
        return self.try_number if self._origin is None else self._origin

    @property
    def fresh_start(self) -> FreshStart | None:
        """Why this try started fresh; ``None`` if it resumed (or [`attach`][] has not run)."""
        return self._fresh

    @property
    def recording_off(self) -> RecordingOff | None:
        """Why this try stopped writing its record; ``None`` while it still writes."""
        return self._appender.off_reason

    # -- before the run ----------------------------------------------------------------------

    def attach(self, agent: Any, user_prompt: Any, run_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Take over the record; return the prompt and run kwargs that resume it (or start fresh).

        Adds the capability that appends each step. Raises nothing for a bad record (fresh
        start, one warning); a store that fails here disables the journal (one warning). Writes
        nothing but a reviewer's answers: this try's first entry carries its head (a given
        ``message_history`` rides along with it too).
        """
        fp = fingerprint(agent, user_prompt, run_kwargs)
        run_kwargs = run_arguments.with_pauses(agent, dict(run_kwargs))
        try:
            plan = plan_resume(
                self._read(fp),
                try_number=self.try_number,
                clear_count=self.clear_count,
                resume_after_clear=self.resume_after_clear,
                answers=self.answers,
                now=self.clock(),
            )
            announce(plan)
            self._take_over(fp, plan)
            decisions = self._answered(plan)
        except ApprovalNotPossible:
            raise
        except Exception as exc:
            # Whatever was decided before the store failed is void: this try runs fresh.
            self.resume, self._fresh, self._origin = None, FreshStart.STORE_ERROR, None
            self._reused = {}
            self._appender.turn_off(f"the record could not be read or written ({exc!r})")
            self._attach_facts()
            return user_prompt, run_kwargs
        run_kwargs = run_arguments.with_capability(run_kwargs, JournalCapability(self._steps))
        if isinstance(plan, Resume):
            user_prompt, run_kwargs = None, run_arguments.resumed(agent, run_kwargs, plan, decisions)
            self._steps.resumed(len(plan.record.messages), plan.replay)
        if self.usage_spans_tries:
            run_kwargs = run_arguments.with_earlier_usage(run_kwargs, self.earlier)
        self._resume_token = active_resume.set(self.resume)
        self._journaled_token = journaled_run.set(True)
        self._attach_facts()
        return user_prompt, run_kwargs

    def _read(self, fp: str) -> LoadedRecord | RecordProblem | None:
        """What the store holds for this run (a store error raises): the record, checked, or why
        it cannot be used. An execution with answers continues its own try: its segment too."""
        try:
            return load_record(self.store, self.key, self.try_number, fp, own=self.answers is not None)
        except RecordProblem as problem:
            return problem

    def _take_over(self, fp: str, plan: StartFresh | Resume) -> None:
        """Apply ``plan``: what the run resumes, and this try's segment chained after it."""
        if isinstance(plan, StartFresh):
            self._fresh = plan.reason
            self._appender.take_over(fp, self.clear_count, self.earlier, None)
            return
        self.resume, self.earlier, self._paused = plan.info, plan.earlier, plan.paused
        self._origin = plan.record.segments[0][0]
        self._reused = _responses_by_try(plan.record, self.try_number)
        self._appender.take_over(fp, self.clear_count, self.earlier, plan.record)

    def _answered(self, plan: StartFresh | Resume) -> dict[str, Decision] | None:
        """The decisions the resumed run continues with, if the record is stopped at an approval
        (this execution's are recorded first, one store call). Raises [`AwaitingApproval`][]
        when there are none yet: nothing runs, nothing is written."""
        approval = plan.approval if isinstance(plan, Resume) else None
        if approval is None:
            return None
        if approval.decisions is None:
            log.info(
                "durable: the run is still %s %s",
                _waiting_for(approval.request),
                [c.tool_name for c in approval.request.calls],
            )
            raise AwaitingApproval(approval.request)
        if approval.undecided:
            raise ApprovalNotPossible(f"no decision for the pending call(s) {list(approval.undecided)}")
        if approval.new:
            decisions = {k: d.as_dict() for k, d in approval.decisions.items()}
            self._appender.append({"kind": "answer", "decisions": decisions})
        return approval.decisions

    # -- after the run -----------------------------------------------------------------------

    def cancelled(self, exc: Any) -> None:
        """The run unwound cancelled (main thread, after the unwind): its usage into the kill
        record's facts, its cause and usage kept for [`write_end`][]. Touches no store: the
        kill record is logged right after this and must not wait for one."""
        usage = self._ended(getattr(exc, "usage", None))
        cause = getattr(exc, "cause", None)
        action = getattr(exc, "action", None)
        self._end = {
            "kind": "end",
            "state": "cancelled",
            "cause": cause.value if cause is not None else None,
            "action": action.value if action is not None else None,
            "usage": usage.as_dict(),
        }

    def write_end(self) -> None:
        """Append the end [`cancelled`][] noted, once the kill record is in the task log, with
        the tool returns still pending: one write, which through Airflow's task state store is an
        API call that a busy API server answers seconds later (measured 3.7 s under load, 5 s
        when it stalls on SQLite), and the task is SIGKILLed 5 s after the SIGTERM. The entries
        not yet stored go out with it, in the same call when they are still queued."""
        end, self._end = self._end, None
        if end is None:
            self._appender.settle()
            return
        if self._appender.off is not None:
            return
        if self._steps.pending:
            end["messages"] = dump_messages(self._steps.pending)
        try:
            self._appender.append(end)
        except Exception as exc_:
            self._appender.turn_off(f"appending the end failed ({exc_!r})")

    def awaiting_approval(self, result: Any) -> ApprovalRequest:
        """The run ended asking for approval (its output is ``DeferredToolRequests``): append the
        end that stops it there, with the messages not yet written (the returns of its calls
        that needed no approval), and return what the reviewer is asked. Raises
        [`ApprovalNotPossible`][] if the record is not being written: a pause whose record is
        lost could never continue."""
        self._steps.stop_flush()
        messages = result.all_messages()
        request = request_of(result.output, messages, self.try_number, self.run_key)
        usage = self._ended(getattr(result, "usage", None))
        self._appender.settle()
        if self._appender.off is not None:
            raise ApprovalNotPossible(
                f"the run cannot wait for approval: its record is off ({self._appender.off})"
            )
        self._appender.append(
            {
                "kind": "end",
                "state": AWAITING,
                "messages": dump_messages(self._steps.unwritten(messages)),
                "request": request.as_dict(),
                "usage": usage.as_dict(),
            }
        )
        self._steps.all_written(len(messages))
        log.info("durable: run stopped %s %s", _waiting_for(request), [c.tool_name for c in request.calls])
        return request

    def completed(self, result: Any, wound_down: Any = None) -> None:
        """The run completed: one entry says so (a later try of the task starts fresh), then the
        record's keys are dropped where listing them is cheap (see ``Appender.drop_record``).

        ``wound_down`` (a ``WindDownReport``): the run answered at its wind-down; the entry's
        state is ``wound_down`` and holds the report. Like ``completed``, it ends the record: the
        answer is the task's result, so a Clear starts fresh.

        The end joins the entries still queued: one store call ends the run, not two (a fleet's
        API server sees one call fewer per run). After a failed store call nothing more is
        stored, the end included: the record turns off, as it would have at the next step."""
        usage = self._ended(getattr(result, "usage", None))
        facts = self._facts(usage)
        state = "wound_down" if wound_down is not None else "completed"
        log.info(
            "durable: run %s; usage this try %s, all tries %s",
            state.replace("_", " "),
            facts["usage_this_try"],
            facts["usage_total"],
        )
        if self._appender.off is not None or (self._appender.segment_length == 0 and self.resume is None):
            self._appender.settle()
            return  # nothing of this run is where a later try looks
        end: dict[str, Any] = {"kind": "end", "state": state, "usage": usage.as_dict()}
        if wound_down is not None:
            end["wound_down"] = wound_down.as_dict()
        try:
            self._appender.append(end)
        except Exception as exc:
            why = f"storing the record's last entries failed ({exc!r}); the run's end is not recorded"
            self._appender.turn_off(why)
            self._attach_facts(usage)  # the run's facts say that, and why, recording went off
            return
        try:
            self._appender.drop_record()
        except Exception as exc:
            log.warning("durable: could not drop the record of a completed run: %r", exc)

    def detach(self) -> None:
        """The run ended any other way (an ordinary failure): keep the record (its last append
        stored), forget the resume."""
        self._steps.stop_flush()
        self._appender.settle()
        self._reset_resume()

    def _ended(self, run_usage: Any) -> TryUsage:
        """The run ended with ``run_usage``: no flush is due any more, this try's usage goes into
        the run's facts, the resume is forgotten. Returns this try's usage."""
        self._steps.stop_flush()
        usage = self._this_try(run_usage)
        self._attach_facts(usage)
        self._reset_resume()
        return usage

    def _this_try(self, usage: Any) -> TryUsage:
        this_try = TryUsage.of_run(self.try_number, usage)
        if self.usage_spans_tries and self.earlier:  # the run started from the earlier tries' usage
            this_try = minus_usage(this_try, self.earlier)
        if self._paused is not None:  # the part of this try before its approval pause
            this_try = TryUsage(self.try_number, **total_usage([this_try, self._paused]))
        return this_try

    def _reset_resume(self) -> None:
        if self._journaled_token is not None:
            with contextlib.suppress(ValueError):  # reset from another context: leave it
                journaled_run.reset(self._journaled_token)
            self._journaled_token = None
        if self._resume_token is not None:
            with contextlib.suppress(ValueError):  # reset from another context: leave it
                active_resume.reset(self._resume_token)
            self._resume_token = None

    def _facts(self, this_try: TryUsage | None = None) -> dict[str, Any]:
        tries = [*self.earlier, *([this_try] if this_try else [])]
        off_reason = self._appender.off_reason
        return {
            "try": self.try_number,
            "resumed_from_try": self.resume.from_try if self.resume else None,
            "messages_restored": self.resume.messages if self.resume else 0,
            "tool_calls_rerun": sorted(self.resume.rerun_tool_calls) if self.resume else [],
            "steps_reused": sum(self._reused.values()),
            "reused_from_tries": sorted(self._reused),
            "usage_earlier_tries": [t.as_dict() for t in self.earlier],
            "usage_this_try": this_try.as_dict() if this_try else None,
            "usage_total": total_usage(tries),
            "recording": self._appender.off is None,
            "fresh_start": self._fresh.value if self._fresh is not None else None,
            "recording_off": off_reason.value if off_reason is not None else None,
        }

    def _attach_facts(self, this_try: TryUsage | None = None) -> None:
        if self.scope is not None:
            self.scope.attach(durable=self._facts(this_try))


def _responses_by_try(record: LoadedRecord, try_number: int) -> dict[int, int]:
    """The model responses ``record`` restores that earlier tries than ``try_number`` recorded,
    counted by try: the model requests the run does not repeat."""
    counts: dict[int, int] = {}
    for recorded_by, message in zip(record.message_tries, record.messages, strict=True):
        if recorded_by != try_number and isinstance(message, ModelResponse):
            counts[recorded_by] = counts.get(recorded_by, 0) + 1
    return counts


def _waiting_for(request: ApprovalRequest) -> str:
    """What a paused run waits for, for its log lines."""
    return "waiting for the outside work of" if request.is_deferral else "awaiting approval of"
