"""The journal: one durable run's continuity record in one try, and the policy of when a try
continues an earlier one (``durable=True``).

The record lives in a key-value store that survives the task's retries (Airflow 3.3's task state
store, or files under an ``ObjectStoragePath``). It is written while the run goes, never at kill
time (a SIGKILL leaves no time), one store call per step: when a model response calls tools, the
messages not yet written (the tool returns the request carried, and the response) are appended
as one entry, written while the tools run (:mod:`~cancellable_agents.durable.writer`: the next
append, and every end, waits for it). So a stop that lets the try unwind never costs a model
request that was answered; a SIGKILL within that write (tens of ms) asks the model again, and a
call started in it is not known to the next try as a rerun (``write_ahead=True`` writes before
the tools start, one round trip on each step's path). The cost of a step does not grow with the
history. The tool returns wait for the next response to ride along, unless that request is still
unanswered after ``returns_flush_s`` (then they are appended alone, while the model works); a
cancelled try writes them with its end. So only a SIGKILL in that window reruns a call that had
returned (and the call knows it is a rerun). Of a model response with several tool calls
(parallel calls), each call's result is also appended as it arrives, while its siblings still
run: a kill then reruns only the calls that had not returned. Each try writes only keys of its
own, so fencing needs no read before a write. The layout and its checks:
:mod:`cancellable_agents.durable.record`.

The next try resumes from the record when the previous one was evicted, timed out, ended for an
unknown reason, or died without a word; a user's stop (Clear) starts fresh unless
``resume_after_clear``. Any doubt about the record (another task's, incomplete, unparsable,
edited) starts fresh with one warning: a partial transcript is never fed to the model silently.

Airflow-free: the store is anything with ``get``/``set``/``delete`` of JSON values. One module
of ~650 lines because :class:`Journal` is one try's state (its keys, what it has written, the
pending returns and their flush, its resume, a pause for approval) that the resume decision and
the writer share; the record's format, fingerprint, usage, reasons, approvals and the pydantic-ai
hook live in modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.agent import CallToolsNode, ModelRequestNode
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, ToolReturn
from pydantic_core import to_jsonable_python

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable.approval import (
    ApprovalNotPossible,
    ApprovalRequest,
    AwaitingApproval,
    Decision,
    deferred_results,
    request_of,
    with_deferred_output,
)
from cancellable_agents.durable.capability import JournalCapability
from cancellable_agents.durable.fingerprint import (
    fingerprint,
    run_toolsets,
    tools_requiring_approval,
    workspace_lost_on_retry,
)
from cancellable_agents.durable.reasons import FreshStart, RecordingOff
from cancellable_agents.durable.record import (
    AWAITING,
    FORMAT,
    KEY_PREFIX,
    LoadedRecord,
    RecordProblem,
    chain,
    dump_message,
    load_record,
    segment_key,
    segment_try,
)
from cancellable_agents.durable.resume import ResumeInfo, active_resume
from cancellable_agents.durable.stores import ListableStore, Store
from cancellable_agents.durable.usage import TryUsage, add_usage, minus_usage, total_usage
from cancellable_agents.durable.writer import StoreWriter

log = logging.getLogger(__name__)

#: An older try whose last entry is younger than this and that wrote no end may still be alive.
LIVE_WINDOW_S = 30.0
#: How long the tool returns wait for the next model response before they are appended alone.
RETURNS_FLUSH_S = 1.0
#: How often a try looks whether a newer try took over (its only reads while the run goes).
OWNER_CHECK_S = 10.0
#: Told to a resumed run whose toolsets' workspace did not survive the try (a sandbox's).
SANDBOX_NOTE = (
    "This run was resumed after the task's previous try was stopped (try {previous} -> try {current}). "
    "The sandbox workspace of the previous try is gone: files written there no longer exist; "
    "recreate what you still need."
)


@dataclass
class Journal:
    """One run's continuity record in one try: resume from it, append to it, end it.

    Used from the run's main thread only (the store may not be called from a signal handler;
    appends are stored by a :class:`StoreWriter` thread, one at a time, in order):
    :meth:`attach` before the run, :meth:`step` after each graph step (by the capability it
    adds), :meth:`cancelled` then :meth:`write_end`, or :meth:`completed`, after the run. That
    order is kept in one place, ``run.runner._run_journaled``: pass the journal to
    ``run_agent_in_scope(..., journal=)``. Building one touches no store. A store error
    disables the journal for the rest of the run with one warning; the run itself goes on.

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
    :param owner_check_s: how often (seconds of ``clock``) the run looks whether a newer try of
        the task took over, and cancels itself if so (``0``: before every append). Fencing does
        not depend on it: a stale try's appends never reach what a newer try resumes from; this
        only stops its wasted work sooner than Airflow's heartbeat does.
    :param answers: a reviewer's decisions, by tool call id, for the approval the record is
        stopped at (see :mod:`cancellable_agents.durable.approval`): this execution continues
        the same try after its pause (its own segment is read too) and the answer is recorded
        before the run goes on. A record stopped at an approval with no answers, here or in
        the record, raises :class:`AwaitingApproval` again from :meth:`attach`, with no request.
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
    write_ahead: bool = False
    beside_is_safe: Callable[[], bool] | None = None
    answers: dict[str, Decision] | None = None
    resume: ResumeInfo | None = None
    earlier: list[TryUsage] = field(default_factory=list)
    # Run state (main thread only).
    _head: dict[str, Any] = field(default_factory=dict)
    _seq: int = 0  # the next entry's index in the whole record
    _own: int = 0  # entries this try appended (its segment's next index)
    _stored_any: bool = False  # this try's segment has an entry in the store (writer's thread)
    _prev: str = ""
    _written: int = 0
    _pending: list[ModelMessage] = field(default_factory=list)  # tool returns not yet appended
    _flush_timer: asyncio.TimerHandle | None = None
    _next_check: float = 0.0
    _off: str | None = None
    _off_reason: RecordingOff | None = None
    _fresh: FreshStart | None = None
    _resume_token: contextvars.Token[ResumeInfo | None] | None = None
    _end: dict[str, Any] | None = None
    #: Results of the resumed response's calls that had returned, by tool call id; each is
    #: handed back once, instead of running the call (the run's loop only).
    _replay: dict[str, Any] = field(default_factory=dict)
    #: This try's usage before an approval pause it continues (added to the run's own).
    _paused: TryUsage | None = None
    _writer: StoreWriter = field(default_factory=StoreWriter)
    _landing_noted: bool = False

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}.{self.run_key}"

    @property
    def fresh_start(self) -> FreshStart | None:
        """Why this try started fresh; ``None`` if it resumed (or :meth:`attach` has not run)."""
        return self._fresh

    @property
    def recording_off(self) -> RecordingOff | None:
        """Why this try stopped writing its record; ``None`` while it still writes."""
        return self._off_reason

    # -- before the run ----------------------------------------------------------------------

    def attach(self, agent: Any, user_prompt: Any, run_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Take over the record; return the prompt and run kwargs that resume it (or start fresh).

        Adds the capability that appends each step. Raises nothing for a bad record (fresh
        start, one warning); a store that fails here disables the journal (one warning). Writes
        nothing: this try's first entry carries its head (a given ``message_history`` rides
        along with it too).
        """
        run_kwargs = dict(run_kwargs)
        fp = fingerprint(agent, user_prompt, run_kwargs)
        self._allow_approvals(agent, run_kwargs)
        try:
            loaded = self._usable(self._load(fp))
            self._take_over(fp, loaded)
            decisions = self._answered(loaded)
        except ApprovalNotPossible:
            raise
        except Exception as exc:
            # Whatever was decided before the store failed is void: this try runs fresh.
            self.resume, self._replay, self._fresh = None, {}, FreshStart.STORE_ERROR
            self._disable(f"the record could not be read or written ({exc!r})")
            self._attach_facts()
            return user_prompt, run_kwargs
        run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), JournalCapability(self)]
        if loaded is not None and self.resume is not None:
            user_prompt = None
            run_kwargs["message_history"] = loaded.messages
            self._written = len(loaded.messages)
            if decisions is not None:
                run_kwargs["deferred_tool_results"] = deferred_results(decisions)
            if workspace_lost_on_retry(run_toolsets(agent, run_kwargs)):
                note = SANDBOX_NOTE.format(previous=self.resume.from_try, current=self.try_number)
                run_kwargs["instructions"] = _with_note(run_kwargs.get("instructions"), note)
        if self.usage_spans_tries and self.earlier:
            run_kwargs["usage"] = add_usage(run_kwargs.get("usage"), self.earlier)
        self._resume_token = active_resume.set(self.resume)
        self._attach_facts()
        return user_prompt, run_kwargs

    @staticmethod
    def _allow_approvals(agent: Any, run_kwargs: dict[str, Any]) -> None:
        """Let a run with tools that require approval end asking for it (``DeferredToolRequests``
        among its output types), where pydantic-ai allows a run's own ``output_type``: not for an
        agent with output validators (its own error then names the fix)."""
        toolsets = run_toolsets(agent, run_kwargs)
        if tools_requiring_approval(toolsets=toolsets) and not getattr(agent, "_output_validators", None):
            run_kwargs["output_type"] = with_deferred_output(
                run_kwargs.get("output_type") or agent.output_type
            )

    def _load(self, fp: str) -> LoadedRecord | None:
        """:func:`~cancellable_agents.durable.record.load_record`, failing closed: a bad record is
        a fresh start with one warning naming why. Notes why there is nothing to resume."""
        try:
            loaded = load_record(self.store, self.key, self.try_number, fp, own=self.answers is not None)
        except RecordProblem as problem:
            log.warning("durable: not resuming from the stored record: %s; starting fresh", problem)
            self._fresh = problem.reason
            return None
        if loaded is None:
            self._fresh = FreshStart.NO_RECORD
        return loaded

    def _usable(self, loaded: LoadedRecord | None) -> LoadedRecord | None:
        """Decide whether this try continues ``loaded``; log why not (``None``: fresh start)."""
        if loaded is None:
            return None
        previous = loaded.owner_try
        end = loaded.end_of(previous)
        stopped_by_user = self._stopped_by_user(loaded, end)
        if stopped_by_user and not self.resume_after_clear:
            log.info(
                "durable: try %s was stopped by a user (%s); starting fresh (resume_after_clear=True "
                "would resume)",
                previous,
                stopped_by_user,
            )
            self._fresh = FreshStart.USER_STOP
            return None
        if not loaded.messages:
            self._fresh = FreshStart.NOTHING_RECORDED
            return None
        if end is None and previous != self.try_number:
            self._warn_if_alive(loaded, previous)
        calls: frozenset[str] = frozenset()
        last = loaded.messages[-1]
        if isinstance(last, ModelResponse):
            calls = frozenset(p.tool_call_id for p in last.parts if isinstance(p, ToolCallPart))
        self._replay = loaded.returned_in_flight()
        replayed = frozenset(self._replay)
        approval = loaded.approval()
        if approval is not None:
            # Calls still waiting never ran; approved ones ran only if an execution took the
            # answer in (its decisions are in the record) and stopped before its next step.
            calls = frozenset(d for d, v in (approval[1] or {}).items() if v.approved)
        self.resume = ResumeInfo(self.try_number, previous, len(loaded.messages), calls - replayed, replayed)
        log.warning(
            "durable: resuming from try %s (%s): %d messages restored, %d tool call(s) in flight run again%s",
            previous,
            f"ended {end.get('cause') or end.get('state')}" if end else "died without a word",
            len(loaded.messages),
            len(calls - replayed),
            f", {len(replayed)} that had returned get their recorded result" if replayed else "",
        )
        return loaded

    def _stopped_by_user(self, loaded: LoadedRecord, end: dict[str, Any] | None) -> str:
        """What the user did to the previous try, if anything: its end entry says so, or (a cleared
        try can no longer write: its task instance is gone) the clear count grew since it began."""
        if end is not None and end.get("cause") == CancelCause.USER.value:
            return str(end.get("action") or "user")
        before = loaded.head.get("clears")
        if self.clear_count is not None and isinstance(before, int) and self.clear_count > before:
            return f"cleared: the DAG run's clear count went from {before} to {self.clear_count}"
        return ""

    def _warn_if_alive(self, loaded: LoadedRecord, previous: int) -> None:
        age = self.clock() - float(loaded.entries[-1].get("at", 0.0)) if loaded.entries else None
        if age is not None and age < LIVE_WINDOW_S:
            log.warning(
                "durable: try %s wrote no end and its last step is %.0f s old: it may still be running. "
                "It is fenced off: its further appends land under its own keys, which no newer try reads, "
                "and it cancels itself when it next looks.",
                previous,
                age,
            )

    def _take_over(self, fp: str, loaded: LoadedRecord | None) -> None:
        """This try's head, for its first entry: from then on later tries read this try's
        record, and what older tries append after the count frozen in ``base`` is never read."""
        base: list[list[int]] = []
        if loaded is not None:
            tries = loaded.tries()
            self.earlier = [t for t in tries if t.try_number != self.try_number]
            base = loaded.segments
            self._seq = len(loaded.entries)
            self._prev = loaded.last_hash
            if loaded.owner_try == self.try_number:  # continuing this try after an approval pause
                base, self._own = loaded.head["base"], loaded.segments[-1][1]
                self._stored_any = self._own > 0
                self._paused = next((t for t in tries if t.try_number == self.try_number), None)
        self._head = {
            "format": FORMAT,
            "fingerprint": fp,
            "clears": self.clear_count,
            "tries": [t.as_dict() for t in self.earlier],
            "base": base,
        }
        self._next_check = self.clock() + self.owner_check_s

    def _answered(self, loaded: LoadedRecord | None) -> dict[str, Decision] | None:
        """The decisions the resumed run continues with, if the record is stopped at an approval:
        from the record, else this execution's :attr:`answers` (recorded first, one store call).
        Raises :class:`AwaitingApproval` when there are none yet: nothing runs, nothing is written."""
        approval = loaded.approval() if loaded is not None and self.resume is not None else None
        if approval is None:
            return None
        request, recorded = approval
        if recorded is not None:
            return recorded
        if self.answers is None:
            log.info(
                "durable: the run is still awaiting approval of %s", [c.tool_name for c in request.calls]
            )
            raise AwaitingApproval(request)
        decisions = {
            c.tool_call_id: self.answers[c.tool_call_id]
            for c in request.calls
            if c.tool_call_id in self.answers
        }
        if missing := [c.tool_name for c in request.calls if c.tool_call_id not in decisions]:
            raise ApprovalNotPossible(f"no decision for the pending call(s) {missing}")
        self._append({"kind": "answer", "decisions": {k: d.as_dict() for k, d in decisions.items()}})
        return decisions

    # -- while the run goes ------------------------------------------------------------------

    def step(self, messages: Sequence[ModelMessage], result: Any) -> None:
        """After a graph step (called on the run's loop): when tools are about to run, append
        the messages not yet written, the response that calls them last, as one entry.

        A step that leads to a model request has its request (the tool returns) in the next
        node, not yet in ``messages``: it waits for that request's response (one entry for
        both), or ``returns_flush_s``, whichever comes first. Any other step writes nothing: the
        prompt before the first response, and the answer that ends the run, cost a kill nothing.
        """
        if self._off is not None:
            return
        self._stop_flush_timer()
        calls_tools = bool(messages) and _calls_tools(messages[-1])
        if calls_tools and isinstance(result, CallToolsNode):
            self._write_step([*messages[self._written :]], len(messages))
        elif calls_tools and isinstance(result, ModelRequestNode):
            self._pending = [*messages[self._written :], result.request]
            self._flush_returns_later()

    def _write_step(self, new: list[ModelMessage], written: int) -> None:
        if not new:  # a resumed response whose tools run again: already in the record
            return
        try:
            entry = {"kind": "step", "messages": [dump_message(m) for m in new]}
            self._append(entry, land=self.write_ahead, owned=True, timed=True)
        except Exception as exc:
            self._disable(f"appending a step failed ({exc!r}); later steps are not recorded")
            return
        self._written, self._pending = written, []

    def _flush_returns_later(self) -> None:
        """Append the pending tool returns ``returns_flush_s`` from now unless the response comes
        first (on the run's loop, so the store is called from the thread that runs the steps)."""
        if self.returns_flush_s <= 0:
            self._flush_returns()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without a loop: nothing can wait
            self._flush_returns()
            return
        self._flush_timer = loop.call_later(self.returns_flush_s, self._flush_returns)

    def _flush_returns(self) -> None:
        self._flush_timer = None
        if self._off is None and self._pending:
            self._write_step(self._pending, self._written + len(self._pending))

    def _stop_flush_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _step_written(self, ms: float) -> None:
        if self.on_step_written is not None:
            with contextlib.suppress(Exception):  # timing a step never costs the run its record
                self.on_step_written(ms)

    def replayed_result(self, call: ToolCallPart) -> tuple[bool, Any]:
        """``(True, result)`` if ``call`` returned in an earlier try (its result is handed back
        once, the call does not run again); ``(False, None)`` otherwise."""
        if call.tool_call_id not in self._replay:
            return False, None
        return True, self._replay.pop(call.tool_call_id)

    def tool_returned(self, messages: Sequence[ModelMessage], call: ToolCallPart, result: Any) -> None:
        """A tool call returned: if siblings of its model response may still be running, append
        its result now (called on the run's loop). A lone call's result is appended with its step.

        A result that is a ``ToolReturn`` or does not convert to JSON is not appended: the call
        runs again if the try stops before its step completes.
        """
        if self._off is not None or _calls_beside(messages, call) == 0 or isinstance(result, ToolReturn):
            return
        try:
            value = to_jsonable_python(result)
        except Exception:
            return
        entry = {
            "kind": "tool_result",
            "tool_call_id": call.tool_call_id,
            "tool": call.tool_name,
            "result": value,
        }
        try:
            self._append(entry, land=False, owned=True)
        except Exception as exc:
            self._disable(f"appending a tool result failed ({exc!r}); later steps are not recorded")

    def _still_owner(self) -> bool:
        """(On the writer's thread.) No newer try took over, looked up at most every
        ``owner_check_s``: fencing does not need this (a stale try's appends land under its own
        keys, past what any newer try reads), it only stops a stale try's wasted work. Two reads
        when due, none otherwise."""
        now = self.clock()
        if now < self._next_check:
            return True
        self._next_check = now + self.owner_check_s
        newer = self.try_number + 1
        if self.store.get(segment_key(self.key, newer, 0)) is None:
            if self._stored_any and self.store.get(segment_key(self.key, self.try_number, 0)) is None:
                self._disable(
                    "the record was deleted while the run went on; later steps are not recorded",
                    RecordingOff.DELETED,
                )
                return False
            return True
        self._off, self._off_reason = "superseded", RecordingOff.FENCED
        log.error(
            "durable: try %s is not the newest: try %s wrote a record of its own, so this try's appends "
            "no longer count and it cancels itself (two copies of one task were running)",
            self.try_number,
            newer,
        )
        if self.scope is not None:
            self.scope.cancel(CancelCause.EVICTION, detail=f"superseded by try {newer} of the same task")
        return False

    def _append(
        self, body: dict[str, Any], *, land: bool = True, owned: bool = False, timed: bool = False
    ) -> None:
        """One entry, chained, under this try's own key; the first carries the head.

        Stored by the writer: ``land`` waits until it is (raising what the store raised);
        otherwise the run goes on and the next append, or :meth:`_settle`, waits for it.
        ``owned``: stored only if no newer try took over; ``timed``: its time goes to
        ``on_step_written``.
        """
        body = {
            **body,
            "i": self._seq,
            "try": self.try_number,
            "at": round(self.clock(), 3),
            "prev": self._prev,
        }
        if self._own == 0:
            body["head"] = self._head
        digest = chain(self._prev, body)
        key, entry = segment_key(self.key, self.try_number, self._own), {**body, "h": digest}
        self._seq += 1
        self._own += 1
        self._prev = digest
        self._writer.submit(lambda: self._store(key, entry, owned=owned, timed=timed))
        if land or not self._beside_is_safe():
            self._writer.wait()

    def _beside_is_safe(self) -> bool:
        if self.beside_is_safe is None:
            return True
        try:
            safe = self.beside_is_safe()
        except Exception:
            safe = False  # unsure: the old order, which is always safe
        if not safe and not self.write_ahead and not self._landing_noted:
            self._landing_noted = True
            log.info(
                "durable: the task used Airflow's async API on its event loop, so each step is now "
                "stored before its tools run (a sync Airflow call on that loop may not meet the "
                "journal's write in progress)"
            )
        return safe

    def _store(self, key: str, entry: dict[str, Any], *, owned: bool, timed: bool) -> None:
        """(On the writer's thread.) One store call, unless a newer try took over."""
        started = time.perf_counter()
        if owned and not self._still_owner():
            return
        self.store.set(key, entry)
        self._stored_any = True
        if timed:
            self._step_written((time.perf_counter() - started) * 1000)

    def _settle(self) -> None:
        """Wait for the append in flight; one that failed turns the record off (one warning)."""
        try:
            self._writer.wait()
        except Exception as exc:
            self._disable(f"appending to the record failed ({exc!r}); later steps are not recorded")

    # -- after the run -----------------------------------------------------------------------

    def cancelled(self, exc: Any) -> None:
        """The run unwound cancelled (main thread, after the unwind): its usage into the kill
        record's facts, its cause and usage kept for :meth:`write_end`. Touches no store: the
        kill record is logged right after this and must not wait for one."""
        self._stop_flush_timer()
        usage = self._this_try(getattr(exc, "usage", None))
        self._attach_facts(usage)
        self._reset_resume()
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
        """Append the end :meth:`cancelled` noted, once the kill record is in the task log, with
        the tool returns still pending: one write, which through Airflow's task state store is an
        API call that a busy API server answers seconds later (measured 3.7 s under load, 5 s
        when it stalls on SQLite), and the task is SIGKILLed 5 s after the SIGTERM."""
        end, self._end = self._end, None
        self._settle()
        if end is None or self._off is not None:
            return
        if self._pending:
            end["messages"] = [dump_message(m) for m in self._pending]
        try:
            self._append(end)
        except Exception as exc_:
            self._disable(f"appending the end failed ({exc_!r})")

    def awaiting_approval(self, result: Any) -> ApprovalRequest:
        """The run ended asking for approval (its output is ``DeferredToolRequests``): append the
        end that stops it there, with the messages not yet written (the returns of its calls
        that needed no approval), and return what the reviewer is asked. Raises
        :class:`ApprovalNotPossible` if the record is not being written: a pause whose record is
        lost could never continue."""
        self._stop_flush_timer()
        messages = result.all_messages()
        request = request_of(result.output, messages, self.try_number, self.run_key)
        usage = self._this_try(getattr(result, "usage", None))
        self._attach_facts(usage)
        self._reset_resume()
        self._settle()
        if self._off is not None:
            raise ApprovalNotPossible(f"the run cannot wait for approval: its record is off ({self._off})")
        self._append(
            {
                "kind": "end",
                "state": AWAITING,
                "messages": [dump_message(m) for m in messages[self._written :]],
                "request": request.as_dict(),
                "usage": usage.as_dict(),
            }
        )
        self._written, self._pending = len(messages), []
        log.info("durable: run stopped awaiting approval of %s", [c.tool_name for c in request.calls])
        return request

    def completed(self, result: Any) -> None:
        """The run completed: one entry says so (a later try of the task starts fresh), then the
        record's keys are dropped where listing them is cheap (see :meth:`_drop_record`)."""
        self._stop_flush_timer()
        usage = self._this_try(getattr(result, "usage", None))
        self._attach_facts(usage)
        self._reset_resume()
        facts = self._facts(usage)
        log.info(
            "durable: run completed; usage this try %s, all tries %s",
            facts["usage_this_try"],
            facts["usage_total"],
        )
        if self._off is not None or (self._own == 0 and self.resume is None):
            return  # nothing of this run is where a later try looks
        try:
            self._append({"kind": "end", "state": "completed", "usage": usage.as_dict()})
            self._drop_record()
        except Exception as exc:
            log.warning("durable: could not end the record of a completed run: %r", exc)

    def _drop_record(self) -> None:
        """Delete a completed run's keys, if the store lists them cheaply and no newer try wrote
        a segment (its base may hold this try's entries: then they are the newer try's to keep).
        Elsewhere they stay, unreachable, until the store expires them."""
        if not isinstance(self.store, ListableStore):
            return
        keys = self.store.keys_under(self.key)
        if any((segment_try(self.key, k) or 0) > self.try_number for k in keys):
            return
        for key in keys:
            self.store.delete(key)

    def _this_try(self, usage: Any) -> TryUsage:
        this_try = TryUsage.of_run(self.try_number, usage)
        if self.usage_spans_tries and self.earlier:  # the run started from the earlier tries' usage
            this_try = minus_usage(this_try, self.earlier)
        if self._paused is not None:  # the part of this try before its approval pause
            this_try = TryUsage(self.try_number, **total_usage([this_try, self._paused]))
        return this_try

    def detach(self) -> None:
        """The run ended any other way (an ordinary failure): keep the record (its last append
        stored), forget the resume."""
        self._stop_flush_timer()
        self._settle()
        self._reset_resume()

    def _reset_resume(self) -> None:
        if self._resume_token is not None:
            with contextlib.suppress(ValueError):  # reset from another context: leave it
                active_resume.reset(self._resume_token)
            self._resume_token = None

    def _disable(self, why: str, reason: RecordingOff = RecordingOff.STORE_ERROR) -> None:
        if self._off is None:
            self._off, self._off_reason = why, reason
            log.warning("durable: %s; the run goes on without its continuity record", why)

    def _facts(self, this_try: TryUsage | None = None) -> dict[str, Any]:
        tries = [*self.earlier, *([this_try] if this_try else [])]
        return {
            "try": self.try_number,
            "resumed_from_try": self.resume.from_try if self.resume else None,
            "messages_restored": self.resume.messages if self.resume else 0,
            "tool_calls_rerun": sorted(self.resume.rerun_tool_calls) if self.resume else [],
            "usage_earlier_tries": [t.as_dict() for t in self.earlier],
            "usage_this_try": this_try.as_dict() if this_try else None,
            "usage_total": total_usage(tries),
            "recording": self._off is None,
            "fresh_start": self._fresh.value if self._fresh is not None else None,
            "recording_off": self._off_reason.value if self._off_reason is not None else None,
        }

    def _attach_facts(self, this_try: TryUsage | None = None) -> None:
        if self.scope is not None:
            self.scope.attach(durable=self._facts(this_try))


def _calls_tools(message: ModelMessage) -> bool:
    """``message`` is a model response that calls tools (they run next)."""
    return isinstance(message, ModelResponse) and any(isinstance(p, ToolCallPart) for p in message.parts)


def _calls_beside(messages: Sequence[ModelMessage], call: ToolCallPart) -> int:
    """How many other tool calls the model response that made ``call`` holds."""
    for message in reversed(messages):
        if isinstance(message, ModelResponse):
            ids = [p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)]
            if call.tool_call_id in ids:
                return len(ids) - 1
    return 0


def _with_note(instructions: Any, note: str) -> Any:
    if instructions is None:
        return note
    if isinstance(instructions, str):
        return f"{instructions}\n\n{note}"
    if isinstance(instructions, (list, tuple)):
        return [*instructions, note]
    return [instructions, note]
