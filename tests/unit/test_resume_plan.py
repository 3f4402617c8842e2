"""The resume decision on its own: what the store held in, a plan out, nothing read, written or
logged (the journal applies the plan; ``test_journal.py`` runs the whole try)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from cancellable_agents.durable import FreshStart, MemoryStore
from cancellable_agents.durable._record_format import LoadedRecord, RecordProblem, load_record, segment_key
from cancellable_agents.durable._resume_plan import LIVE_WINDOW_S, Resume, StartFresh, plan_resume
from tests.unit.durable_runs import RECORD, killed_at


def _killed_at_3() -> LoadedRecord:
    """Try 1's record, SIGKILLed while tool 3 ran, as try 2 reads it."""
    data = killed_at(3)
    fp = MemoryStore(data).get(segment_key(RECORD, 1, 0))["head"]["fingerprint"]
    loaded = load_record(MemoryStore(data), RECORD, 2, fp)
    assert loaded is not None
    return loaded


def _plan(found: Any, **facts: Any) -> StartFresh | Resume:
    given: dict[str, Any] = {
        "try_number": 2,
        "clear_count": None,
        "resume_after_clear": False,
        "answers": None,
        "now": 1e12,
    }
    return plan_resume(found, **{**given, **facts})


def test_no_record_or_a_refused_one_is_a_fresh_start_naming_why() -> None:
    assert _plan(None) == StartFresh(FreshStart.NO_RECORD)
    problem = RecordProblem("it belongs to a different run", FreshStart.FINGERPRINT_CHANGED)
    assert _plan(problem) == StartFresh(FreshStart.FINGERPRINT_CHANGED, "it belongs to a different run")


def test_a_killed_try_is_resumed_with_its_call_in_flight_run_again(caplog: pytest.LogCaptureFixture) -> None:
    loaded = _killed_at_3()
    with caplog.at_level(logging.DEBUG, logger="cancellable_agents.durable"):
        caplog.clear()  # what making the record logged
        plan = _plan(loaded)
    assert not caplog.records, "deciding logs nothing: announce() does"
    assert isinstance(plan, Resume) and plan.record is loaded
    assert (plan.info.try_number, plan.info.from_try, plan.info.messages) == (2, 1, len(loaded.messages))
    assert len(plan.info.rerun_tool_calls) == 1 and not plan.info.replayed_tool_calls
    assert [t.try_number for t in plan.earlier] == [1] and plan.paused is None and plan.approval is None
    assert plan.how_ended == "died without a word" and plan.alive_age is None


def test_a_previous_try_that_wrote_moments_ago_may_still_be_alive() -> None:
    loaded = _killed_at_3()
    last_at = float(loaded.entries[-1]["at"])
    young = _plan(loaded, now=last_at + 2)
    old = _plan(loaded, now=last_at + LIVE_WINDOW_S + 1)
    assert isinstance(young, Resume) and young.alive_age == pytest.approx(2)
    assert isinstance(old, Resume) and old.alive_age is None


def test_a_grown_clear_count_is_a_user_stop_unless_resume_after_clear() -> None:
    loaded = dataclasses.replace(_killed_at_3(), head={**_killed_at_3().head, "clears": 0})
    plan = _plan(loaded, clear_count=1)
    assert isinstance(plan, StartFresh) and plan.reason == FreshStart.USER_STOP and plan.stopped_try == 1
    assert "clear count went from 0 to 1" in plan.detail
    assert isinstance(_plan(loaded, clear_count=1, resume_after_clear=True), Resume)
    assert isinstance(_plan(loaded, clear_count=0), Resume)


def test_a_record_without_messages_is_nothing_to_resume() -> None:
    loaded = dataclasses.replace(_killed_at_3(), messages=[], message_tries=[])
    assert _plan(loaded) == StartFresh(FreshStart.NOTHING_RECORDED)
