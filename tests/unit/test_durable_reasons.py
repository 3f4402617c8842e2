"""Why a durable try started fresh and why it stopped recording: the journal names each case with
one :mod:`cancellable_agents.durable._reasons` value (its properties and the run's facts, which
the metrics tag), and hands each recorded step's write time to its ``on_step_written`` hook."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from cancellable_agents.core.causes import CancelCause, CauseVerdict, UserAction
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable import FreshStart, Journal, MemoryStore, RecordingOff
from cancellable_agents.durable._appender import Appender
from cancellable_agents.run.runner import run_agent_in_scope
from tests.unit.durable_runs import (
    RECORD,
    STEPS,
    Counting,
    Task,
    cancel_on,
    cancelled_try,
    entries,
    killed_at,
)

EVICTED = CauseVerdict(CancelCause.EVICTION, "worker shutdown")


def _facts(scope: TaskCancellation) -> dict[str, Any]:
    facts: dict[str, Any] = scope.attached["durable"]
    return facts


def test_a_try_with_no_record_starts_fresh_for_that_reason() -> None:
    result, journal, scope = Task().run(MemoryStore(), 1)
    assert result.output == "all done"
    assert journal.fresh_start is FreshStart.NO_RECORD
    assert _facts(scope)["fresh_start"] == "no_record" and _facts(scope)["recording_off"] is None


def test_a_resumed_try_has_no_fresh_start_reason() -> None:
    store = MemoryStore()
    cancelled_try(EVICTED, store)
    _, journal, scope = Task().run(store, 2)
    assert journal.resume is not None
    assert journal.fresh_start is None and _facts(scope)["fresh_start"] is None


def test_a_user_stop_is_the_reason_a_try_starts_fresh() -> None:
    store = MemoryStore()
    cancelled_try(CauseVerdict.of_user(UserAction.CLEARED), store)
    _, journal, scope = Task().run(store, 2)
    assert journal.resume is None and journal.fresh_start is FreshStart.USER_STOP
    assert _facts(scope)["fresh_start"] == "user_stop"


def test_a_record_that_fails_its_checks_is_tampered() -> None:
    data = killed_at(3)
    entry = next(k for k in data if k.count(".") >= 4 and "step 2 ok" in data[k])
    data[entry] = data[entry].replace("step 2 ok", "step 2 FAILED")
    _, journal, _ = Task().run(MemoryStore(data), 2)
    assert journal.resume is None and journal.fresh_start is FreshStart.TAMPERED


def test_another_runs_record_is_a_changed_fingerprint_not_tampering() -> None:
    task = Task(prompt="do six other steps")
    _, journal, scope = task.run(MemoryStore(killed_at(3)), 2)
    assert journal.resume is None and task.script.requests == STEPS + 1
    assert journal.fresh_start is FreshStart.FINGERPRINT_CHANGED
    assert _facts(scope)["fresh_start"] == "fingerprint_changed"


def test_a_record_with_no_step_yet_has_nothing_recorded() -> None:
    """Try 1 was stopped before its first tool step: its only entry is its end."""
    store = MemoryStore()
    journal = Journal(store, try_number=1)
    journal.attach(Task().agent(), Task().prompt, {})
    journal.cancelled(TaskCancelled("worker shutdown", cause=CancelCause.EVICTION))
    journal.write_end()
    assert entries(store.data) == 1
    _, journal, _ = Task().run(store, 2)
    assert journal.fresh_start is FreshStart.NOTHING_RECORDED


@dataclass
class Unreadable(MemoryStore):
    """A store that fails every read: the journal cannot take over the record."""

    def get(self, key: str) -> Any:
        raise OSError("store unreachable")


def test_a_store_that_fails_at_the_start_is_named_and_still_reported() -> None:
    result, journal, scope = Task().run(Unreadable(), 2)  # try 1 reads nothing
    assert result.output == "all done", "the run goes on without its record"
    assert journal.fresh_start is FreshStart.STORE_ERROR
    assert journal.recording_off is RecordingOff.STORE_ERROR
    facts = _facts(scope)
    assert (facts["fresh_start"], facts["recording_off"], facts["recording"]) == (
        "store_error",
        "store_error",
        False,
    )


def test_a_try_fenced_off_by_a_newer_try_says_so() -> None:
    store = MemoryStore()
    task = Task()

    def newer_try_takes_over(n: int) -> None:
        if n == 2:  # in a thread: its own context, so no resume leaks into this run's
            newer = Task(on_call=cancel_on(3, EVICTED))  # it records step 3, then is evicted
            thread = threading.Thread(target=lambda: newer.run(store, 2))
            thread.start()
            thread.join(30)

    task.on_call = newer_try_takes_over
    outcome, journal, scope = task.run(store, 1, owner_check_s=0)
    assert isinstance(outcome, TaskCancelled), "the fenced try cancels itself"
    assert journal.recording_off is RecordingOff.FENCED
    assert _facts(scope)["recording_off"] == "fenced"


def test_a_record_deleted_while_the_run_goes_on_stops_recording() -> None:
    store = MemoryStore()
    task = Task(on_call=lambda n: store.data.clear() if n == 2 else None)
    result, journal, scope = task.run(store, 1, owner_check_s=0)
    assert result.output == "all done"
    assert journal.recording_off is RecordingOff.DELETED and journal.fresh_start is FreshStart.NO_RECORD
    assert _facts(scope)["recording_off"] == "deleted"


def test_the_ownership_check_reads_once_and_looks_for_a_deletion_every_third_time() -> None:
    """Due every ``owner_check_s``, the check reads the newer try's first key only; whether the
    record is still there costs a second read every third check, from the third on: what a long
    run adds to the store between its steps (a run of under three checks adds one read each)."""
    store = Counting()
    now = [0.0]
    appender = Appender(store, RECORD, 1, clock=lambda: now[0], owner_check_s=10)
    appender.take_over("fp", None, [], None)
    reads = []
    for _ in range(7):
        now[0] += 10
        before = store.calls["get"]
        appender.append({"kind": "step"}, owned=True)
        reads.append(store.calls["get"] - before)
    assert reads == [1, 1, 2, 1, 1, 2, 1], reads
    store.store.data.clear()
    for _ in range(3):
        now[0] += 10
        appender.append({"kind": "step"}, owned=True)
    assert appender.off_reason is RecordingOff.DELETED, "a deleted record went unnoticed"


def test_the_batch_that_ends_the_run_is_stored_without_an_ownership_look() -> None:
    """The look only stops a stale try's remaining work: due as the run ends, it would stop
    nothing, and a fleet's runs paid two reads for it just before their end."""
    store = Counting()
    now = [0.0]
    appender = Appender(store, RECORD, 1, clock=lambda: now[0], owner_check_s=10, batch_window_s=60)
    appender.take_over("fp", None, [], None)
    now[0] += 10  # the look is due
    appender.append({"kind": "step"}, land=False, owned=True)  # waits for the window's company
    appender.append({"kind": "end", "state": "completed"})  # lands: one call for both
    assert store.calls == {"get": 0, "set": 1, "delete": 0}
    appender.append({"kind": "step"}, owned=True)  # a run that goes on still looks
    assert store.calls["get"] == 1  # whether the record is still there: from the third look on


@dataclass
class SlowWrites(MemoryStore):
    """Each entry write takes ``latency`` seconds (a store across a network), and is counted."""

    latency: float = 0.01
    entry_writes: int = 0

    def set(self, key: str, value: Any) -> None:
        if key.count(".") >= 4:
            time.sleep(self.latency)
            self.entry_writes += 1
        super().set(key, value)


def test_each_recorded_step_hands_over_its_write_time() -> None:
    store = SlowWrites()
    samples: list[tuple[float, int]] = []

    def step_written(ms: float) -> None:
        samples.append((ms, store.entry_writes - sum(writes for _, writes in samples)))

    scope = TaskCancellation("try1")
    # One entry per store call (max_unconfirmed=1); entries stored together share their call's time.
    journal = Journal(store, try_number=1, scope=scope, on_step_written=step_written, max_unconfirmed=1)
    with scope.activate():
        result = run_agent_in_scope(scope, Task().agent(), Task().prompt, journal=journal)
    assert result.output == "all done"
    # One sample per step, each covering that step's one write; then the completed run's end.
    assert sum(writes for _, writes in samples) == STEPS and store.entry_writes == STEPS + 1
    for ms, writes in samples:
        assert writes >= 1 and ms >= writes * store.latency * 1000, samples


def test_a_failing_step_hook_costs_the_run_nothing() -> None:
    calls: list[float] = []

    def broken(ms: float) -> None:
        calls.append(ms)
        raise RuntimeError("metrics backend exploded")

    store = MemoryStore()
    scope = TaskCancellation("try1")
    journal = Journal(store, try_number=1, scope=scope, on_step_written=broken)
    with scope.activate():
        result = run_agent_in_scope(scope, Task().agent(), Task().prompt, journal=journal)
    assert result.output == "all done" and calls
    assert journal.recording_off is None and store.data == {}, "recorded to the end, then deleted"


@pytest.mark.parametrize("reason", list(FreshStart) + list(RecordingOff))
def test_every_reason_is_a_short_tag_value(reason: FreshStart | RecordingOff) -> None:
    assert reason.value.isidentifier() and reason.value == reason.value.lower()
