"""The cancellation scope on its own: ordering, idempotency, budget, children, outcome."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

import pytest
import time_machine

from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.scope import Outcome, TaskCancellation, current_cancellation
from cancellable_agents.core.timeline import TimelineEvent
from cancellable_agents.core.unwind import Phase


class FakeClock:
    """A monotonic clock the test advances by hand (budget arithmetic without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _events(scope: TaskCancellation) -> list[str]:
    return [e.event for e in scope.timeline]


def test_cancel_returns_at_once_and_is_idempotent() -> None:
    scope = TaskCancellation(budget=4.0)
    returned = threading.Event()
    seen: list[bool] = []
    # The release waits for cancel() to return; it sees that only if cancel handed it to a helper
    # thread (a cancel running it itself would be waiting for it). Not a time bound on cancel:
    # starting that thread takes 50 ms on a busy 2-core machine.
    scope.register(lambda: seen.append(returned.wait(3)), name="waits-for-cancel")
    assert scope.cancel(CancelCause.USER) is True
    returned.set()
    for _ in range(20):
        assert scope.cancel(CancelCause.EVICTION) is False
    assert scope.wait_released(5)
    assert seen == [True], "cancel must hand the work to a helper thread"
    assert scope.cause is CancelCause.USER, "the first decision wins"
    assert _events(scope).count("kill_received") == 1
    assert _events(scope).count("cancel_repeated") == 20


def test_a_cancel_nested_in_a_cancel_on_the_same_thread_starts_no_second_unwind() -> None:
    """A burst of SIGTERMs runs the handler again inside the first one's cancel() (same thread,
    so the RLock lets it in). The nested call comes at the first clock read inside cancel(),
    where a signal can land before the outer call marks the scope cancelled."""
    nested: list[bool] = []
    armed = [False]

    def clock() -> float:
        if armed[0]:
            armed[0] = False
            nested.append(scope.cancel(CancelCause.EVICTION))  # as a signal handler would
        return time.monotonic()

    scope = TaskCancellation(clock=clock)
    armed[0] = True
    assert scope.cancel(CancelCause.EVICTION) is True
    assert scope.wait_released(5)
    assert nested == [False], "the nested cancel started an unwind of its own"
    assert _events(scope).count("kill_received") == 1
    assert _events(scope).count("resources_released") == 1


def test_concurrent_cancels_start_one_unwind() -> None:
    scope = TaskCancellation()
    barrier = threading.Barrier(16)
    results: list[bool] = []

    def hammer() -> None:
        barrier.wait(2)
        results.append(scope.cancel(CancelCause.USER))

    threads = [threading.Thread(target=hammer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results.count(True) == 1
    assert scope.wait_released(5)
    assert _events(scope).count("token_cancelled") == 1


def test_token_then_in_flight_then_teardown() -> None:
    scope = TaskCancellation()
    order: list[str] = []
    scope.register(lambda: order.append("teardown"), name="toolset", phase=Phase.TEARDOWN)
    scope.register(lambda: order.append(f"in-flight token={scope.token.cancelled}"), name="command")
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert order == ["in-flight token=True", "teardown"]
    events = _events(scope)
    assert events.index("token_cancelled") < events.index("resources_released")


def test_in_flight_resources_are_released_concurrently() -> None:
    scope = TaskCancellation()
    gate = threading.Barrier(3, timeout=2)
    for n in range(3):
        # Each release waits for the other two: this only finishes if they run at the same time.
        scope.register(gate.wait, name=f"cmd{n}")
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert not [e for e in scope.timeline if e.event == "release_failed"]


def test_an_inline_resource_is_released_on_the_unwinding_thread_beside_the_others() -> None:
    scope = TaskCancellation("task")
    gate = threading.Barrier(2, timeout=2)
    released_on: dict[str, str] = {}

    def cleanup(name: str) -> Callable[[], None]:
        def release() -> None:
            released_on[name] = threading.current_thread().name
            gate.wait()  # returns only while the other one is being released too

        return release

    scope.register(cleanup("own"), name="own")
    scope.register(cleanup("inline"), name="inline", inline=True)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert released_on == {"own": "release-own", "inline": "cancellable-agents-unwind-task"}
    assert not [e for e in scope.timeline if e.event == "release_failed"]


def test_budget_bounds_the_wait_for_a_stuck_resource() -> None:
    scope = TaskCancellation(budget=0.3)
    never, torn_down = threading.Event(), threading.Event()
    scope.register(never.wait, name="stuck")
    scope.register(torn_down.set, name="after", phase=Phase.TEARDOWN)
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(3), "released although the stuck resource never returns"
    assert torn_down.wait(2), "the teardown still runs once the in-flight phase spent the budget"
    # With no budget left the teardown is not waited for: on a busy machine it may still be
    # running when looked at, and is named too.
    assert scope.stragglers[0] == "resource 'stuck'"
    assert set(scope.stragglers) <= {"resource 'stuck'", "resource 'after'"}
    never.set()


def test_remaining_budget_with_a_manual_clock() -> None:
    clock = FakeClock()
    scope = TaskCancellation(budget=4.0, clock=clock)
    clock.now += 100  # time before the kill does not count
    assert scope.remaining() == 4.0
    scope.cancel(CancelCause.USER)
    clock.now += 1.5
    assert scope.remaining() == pytest.approx(2.5)
    clock.now += 10
    assert scope.remaining() == 0.0


def test_negative_budget_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="budget must be positive"):
        TaskCancellation(budget=-1)


def test_failing_cleanup_is_recorded_and_does_not_stop_the_others() -> None:
    scope = TaskCancellation()
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("disk on fire")

    scope.register(boom, name="bad")
    scope.register(done.set, name="good")
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert done.is_set()
    failed = [e for e in scope.timeline if e.event == "release_failed"]
    assert failed and "disk on fire" in failed[0].detail["error"]


def test_async_cleanup_runs_on_the_loop_it_was_registered_from() -> None:
    scope = TaskCancellation()
    seen: list[asyncio.AbstractEventLoop] = []

    async def close() -> None:
        seen.append(asyncio.get_running_loop())

    async def main() -> asyncio.AbstractEventLoop:
        scope.register(close, name="client")
        scope.cancel(CancelCause.USER)
        while not scope.wait_released(0):
            await asyncio.sleep(0.01)  # keep the loop running so the cleanup can be scheduled on it
        return asyncio.get_running_loop()

    loop = asyncio.run(asyncio.wait_for(main(), 5))
    assert seen == [loop]


def test_registering_after_cancel_releases_at_once() -> None:
    scope = TaskCancellation()
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    late = threading.Event()
    scope.register(late.set, name="late")
    assert late.wait(2)


def test_unregistered_resource_is_not_released() -> None:
    scope = TaskCancellation()
    called = threading.Event()
    scope.register(called.set, name="done-normally").unregister()
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    assert not called.is_set()


def test_cancel_after_completion_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    scope = TaskCancellation()
    assert scope.settle(Outcome.COMPLETED) is Outcome.COMPLETED
    with caplog.at_level("INFO"):
        assert scope.cancel(CancelCause.USER) is False
    assert not scope.cancelled
    assert "cancel_ignored" in _events(scope)
    assert "nothing to do" in caplog.text


def test_result_after_cancel_does_not_become_success() -> None:
    scope = TaskCancellation()
    scope.cancel(CancelCause.EVICTION)
    assert scope.settle(Outcome.COMPLETED) is Outcome.CANCELLED
    assert scope.settle(Outcome.FAILED) is Outcome.CANCELLED, "exactly one terminal outcome"


def test_cancel_after_failure_still_unwinds() -> None:
    # The execution_timeout path: execute already raised, on_kill must still release everything.
    scope = TaskCancellation()
    released = threading.Event()
    scope.register(released.set, name="sandbox")
    scope.settle(Outcome.FAILED)
    assert scope.cancel(CancelCause.TIMEOUT) is True
    assert released.wait(2)


def test_classifier_decides_the_cause_off_thread() -> None:
    scope = TaskCancellation()
    caller = threading.get_ident()
    seen: list[int] = []

    def classify() -> CauseVerdict:
        seen.append(threading.get_ident())
        return CauseVerdict(CancelCause.USER, "marked failed")

    scope.cancel(CancelCause.UNKNOWN, classify=classify)
    assert scope.wait_cause(2) is CancelCause.USER
    assert scope.cause_detail == "marked failed"
    assert seen and seen[0] != caller


def test_classifier_that_hangs_yields_unknown_in_time() -> None:
    scope = TaskCancellation()
    hang = threading.Event()
    scope.cancel(
        CancelCause.UNKNOWN,
        classify=lambda: (hang.wait(30), CauseVerdict(CancelCause.USER))[1],
        classify_timeout=0.2,
    )
    assert scope.wait_cause(2) is CancelCause.UNKNOWN, "decided long before the hung classifier returns"
    assert "not known within" in scope.cause_detail
    hang.set()


def test_child_is_cancelled_with_parent_cause_and_keeps_the_root() -> None:
    parent = TaskCancellation("task")
    kid = parent.child("researcher")
    grandkid = kid.child("searcher")
    parent.cancel(CancelCause.EVICTION)
    assert grandkid.wait(2)
    assert kid.wait_cause(2) is CancelCause.PARENT
    assert grandkid.wait_cause(2) is CancelCause.PARENT
    assert grandkid.root_cause is CancelCause.EVICTION
    assert [c["scope"] for c in parent.summary()["children"]] == ["researcher"]


def test_child_created_after_cancel_is_born_cancelled() -> None:
    parent = TaskCancellation()
    parent.cancel(CancelCause.USER)
    kid = parent.child("late")
    assert kid.cancelled
    assert kid.token.cancelled or kid.wait(2)


def test_child_budget_is_what_the_parent_has_left() -> None:
    clock = FakeClock()
    parent = TaskCancellation(budget=4.0, clock=clock)
    parent.cancel(CancelCause.USER)
    clock.now += 3.0
    assert parent.child("late").budget == pytest.approx(1.0)


def test_current_cancellation_in_context_and_in_plain_threads() -> None:
    assert current_cancellation() is None
    scope = TaskCancellation()
    seen: list[object] = []
    with scope.activate():
        assert current_cancellation() is scope
        thread = threading.Thread(target=lambda: seen.append(current_cancellation()))
        thread.start()
        thread.join(2)
    assert seen == [scope], "a thread started by a tool finds the only active task scope"
    assert current_cancellation() is None


def test_cooperative_wait_wakes_only_after_the_run_was_told() -> None:
    scope = TaskCancellation()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(scope.token.cancelled if scope.wait(5) else False))
    waiter.start()
    scope.cancel(CancelCause.USER)
    waiter.join(5)
    assert woke == [True], "a tool that returns on wake-up must not trigger another model request"


def test_raise_if_cancelled() -> None:
    from cancellable_agents.core.exceptions import TaskCancelled

    scope = TaskCancellation()
    scope.raise_if_cancelled()
    scope.cancel(CancelCause.USER)
    with pytest.raises(TaskCancelled):
        scope.raise_if_cancelled()


def test_timeline_records_wall_clock_time() -> None:
    moment = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
    with time_machine.travel(moment, tick=False):
        event = TaskCancellation().record("kill_received")
    assert isinstance(event, TimelineEvent)
    assert event.wall == moment.timestamp()


def test_summary_is_relative_to_the_kill() -> None:
    clock = FakeClock()
    scope = TaskCancellation(clock=clock)
    clock.now += 5
    scope.cancel(CancelCause.USER, detail="marked failed")
    assert scope.wait_released(5)
    summary = scope.summary()
    kill = next(e for e in summary["timeline"] if e["event"] == "kill_received")
    assert kill["ms"] == 0.0
    assert summary["timeline"][0]["ms"] == -5000.0
    assert summary["cause"] == "user" and summary["detail"] == "marked failed"


def test_resource_registered_during_the_unwind_is_released_once() -> None:
    scope = TaskCancellation()
    calls: list[str] = []
    gate = threading.Event()
    scope.register(lambda: gate.wait(2), name="slow")
    scope.cancel(CancelCause.USER)
    for n in range(5):
        scope.register(lambda n=n: calls.append(f"late{n}"), name=f"late{n}")
    gate.set()
    assert scope.wait_released(5)
    assert sorted(calls) == [f"late{n}" for n in range(5)]


def test_wait_released_covers_late_releases() -> None:
    scope = TaskCancellation()
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(5)
    finished = threading.Event()
    scope.register(lambda: (time.sleep(0.2), finished.set()), name="late")
    assert scope.wait_released(5)
    assert finished.is_set(), "wait_released must not return while a late release still runs"
