"""The journal's batched store calls: entries that queue while a call is in flight go out
together in the next (one key, a list), the run waits for the store only when ``max_unconfirmed``
entries are not yet stored, and a record of either layout (format 3's lists, format 2's one entry
per key) resumes. Through a store that holds its calls until the test lets them go: the store's
round trip, stalled, without a clock."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.durable import MemoryStore
from cancellable_agents.durable._record_format import chain, segment_key
from cancellable_agents.durable._writer import FIRST_WINDOW_MIN, StoreWriter
from tests.unit.durable_runs import RECORD, STEPS, Task, cancel_on, entries, killed_at

#: Every wait for the run's thread or the writer's is bounded by this.
WAIT_S = 30.0


@dataclass
class Landings:
    """A writer's ``store``: keeps each batch and when it came, and signals each call."""

    stored: list[list[int]] = field(default_factory=list)
    stored_at: list[float] = field(default_factory=list)
    landed: threading.Event = field(default_factory=threading.Event)

    def __call__(self, batch: list[int]) -> None:
        self.stored_at.append(time.monotonic())
        self.stored.append(batch)
        self.landed.set()


@dataclass
class Stalled(MemoryStore):
    """A MemoryStore whose ``set`` waits until ``released`` (a store stalled at the API server),
    and that keeps each call's value (``calls``) and notes when one has started (``entered``)."""

    released: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    calls: list[Any] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        self.entered.set()
        assert self.released.wait(WAIT_S), "the test never released the store"
        self.calls.append(value)
        super().set(key, value)


def _run_beside(store: Any, try_number: int, task: Task, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(task.run(store, try_number, **kwargs)), daemon=True)
    thread.start()
    return thread, out


def test_the_run_waits_only_when_max_unconfirmed_entries_are_not_stored() -> None:
    """The store holds its first call: the run goes on for ``max_unconfirmed`` steps (their
    tools run) and stops before the next one's tool. Released, the queued entries go out in
    one call, and the record holds every step."""
    store = Stalled()
    steps_run: list[int] = []
    reached = threading.Event()
    limit = 3

    def on_call(n: int) -> None:
        steps_run.append(n)
        if n == limit:
            reached.set()

    task = Task(on_call=on_call)
    thread, out = _run_beside(store, 1, task, max_unconfirmed=limit)
    assert reached.wait(WAIT_S), f"the run stopped before step {limit}: {steps_run}"
    assert store.entered.wait(WAIT_S)
    thread.join(0.3)  # not a synchronisation: the run must still be waiting after it
    assert steps_run == list(range(1, limit + 1)), "the run went past max_unconfirmed entries"
    store.released.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and out[0][0].output == "all done"
    batch_sizes = [len(v) if isinstance(v, list) else 1 for v in store.calls]
    assert batch_sizes[:2] == [1, limit - 1], batch_sizes  # the stalled call, then the queue
    assert sum(batch_sizes) == STEPS + 1 and len(store.calls) < STEPS + 1
    assert store.data == {}  # completed: the record dropped


def test_a_batched_record_resumes_without_repeating_a_stored_step() -> None:
    """Try 1 is 'SIGKILLed' while its queued entries wait: the store holds what landed (two
    calls, the second a list of entries); try 2 resumes from exactly that, with no step of it
    run again."""
    store = Stalled()
    held = threading.Event()
    stop = threading.Event()

    def on_call(n: int) -> None:
        if n == 4:  # steps 1..4 appended: entry 1 stored, 2..4 in the second call
            held.set()
            assert stop.wait(WAIT_S)

    thread, _ = _run_beside(store, 1, Task(on_call=on_call))
    assert held.wait(WAIT_S)
    store.released.set()
    snapshot = _landed(store, 4)
    stop.set()
    thread.join(WAIT_S)
    keys = sorted(k for k in snapshot if k.startswith(f"{RECORD}.try1."))
    assert keys == [segment_key(RECORD, 1, 0), segment_key(RECORD, 1, 1)], keys
    assert len(json.loads(snapshot[keys[1]])) == 3, "entries 2..4 were not stored in one call"
    task = Task()
    result, journal, _ = task.run(MemoryStore(snapshot), 2)
    assert result.output == "all done"
    assert journal.resume is not None and journal.resume.messages == 4 * 2
    assert [n for n, _ in task.calls] == [4, 5, 6], "a stored step ran again"
    assert task.calls[0] == (4, True)


def _landed(store: Stalled, count: int) -> dict[str, str]:
    """``store``'s data once it holds ``count`` entries (the writer stores them soon)."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if entries(store.data) >= count:
            done.set()
            break
        done.wait(0.01)
    assert done.is_set(), f"the writer never stored {count} entries: {store.data.keys()}"
    return dict(store.data)


def test_entries_queued_behind_a_call_in_flight_share_one_key() -> None:
    """The writer's own contract: the first item alone, then everything queued meanwhile."""
    stored: list[list[int]] = []
    gate = threading.Event()

    def store(batch: list[int]) -> None:
        assert gate.wait(WAIT_S)
        stored.append(batch)

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=10)
    for item in range(5):
        writer.add(item)
    gate.set()
    writer.wait()
    assert [item for batch in stored for item in batch] == list(range(5)) and len(stored) <= 2, stored
    assert writer.unconfirmed == 0


def test_a_store_error_is_raised_once_and_nothing_after_it_is_stored() -> None:
    stored: list[list[int]] = []

    def store(batch: list[int]) -> None:
        if 1 in batch:
            raise OSError("the API server said 500")
        stored.append(batch)

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=1)
    writer.add(0)
    writer.wait_for_room()
    writer.add(1)
    with pytest.raises(OSError, match="500"):
        writer.wait()
    writer.add(2)  # raised once: the appender turned the record off after it
    writer.wait()
    assert stored == [[0]]


def test_max_unconfirmed_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StoreWriter(lambda batch: None, max_unconfirmed=0)
    with pytest.raises(ValueError, match=">= 0 seconds"):
        StoreWriter(lambda batch: None, max_unconfirmed=1, batch_window_s=-1)


def test_items_added_within_the_window_share_one_call_with_no_call_in_flight() -> None:
    """The window (far longer than the test) holds items that no call in flight would have held;
    waiting for them stores them at once, all in one call."""
    stored: list[list[int]] = []
    writer: StoreWriter[int] = StoreWriter(stored.append, max_unconfirmed=10, batch_window_s=WAIT_S * 10)
    for item in range(4):
        writer.add(item)
    assert stored == [] and writer.unconfirmed == 4
    writer.wait()  # must not wait out the window
    assert stored == [[0, 1, 2, 3]]


def test_a_wait_with_nothing_queued_leaves_the_next_item_its_window() -> None:
    stored: list[list[int]] = []
    writer: StoreWriter[int] = StoreWriter(stored.append, max_unconfirmed=10, batch_window_s=WAIT_S * 10)
    writer.add(0)
    writer.wait()
    writer.wait()  # nothing unconfirmed: nothing to hurry
    writer.add(1)
    writer.add(2)
    assert stored == [[0]] and writer.unconfirmed == 2, "item 1 went out without its window"
    writer.wait()
    assert stored == [[0], [1, 2]]


def test_batches_in_close_succession_share_one_writer_thread() -> None:
    """Once the queue is empty the writer's thread waits ``linger_s`` for the next item: a
    thread started per batch made the run wait, at every batch, until the OS first ran it."""
    threads: list[threading.Thread] = []
    writer: StoreWriter[int] = StoreWriter(
        lambda batch: threads.append(threading.current_thread()), max_unconfirmed=10, linger_s=WAIT_S
    )
    for item in range(3):
        writer.add(item)
        writer.wait()
        threads[-1].join(0.05)  # a thread that ends on an empty queue ends here; a lingering one waits
        assert threads[-1].is_alive(), "the writer's thread ended with the queue"
    assert len(threads) == 3 and all(t is threads[0] for t in threads), threads


def test_the_window_closes_on_its_own() -> None:
    """Nobody waits: the items go out once their head has waited the window."""
    store = Landings()
    landed, stored = store.landed, store.stored

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=10, batch_window_s=0.05)
    writer.add(0)
    writer.add(1)
    assert landed.wait(WAIT_S), "the window never closed"
    assert stored == [[0, 1]] and writer.unconfirmed == 0


def test_an_item_that_comes_slower_than_half_the_window_waits_for_none() -> None:
    """Steps that take seconds are stored as they complete: at that pace no later item would
    share the call, so waiting would only lengthen what a SIGKILL repeats. Items that then come
    fast wait for the window again."""
    now = [0.0]
    store = Landings()
    landed, stored = store.landed, store.stored

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=10, batch_window_s=60, clock=lambda: now[0])
    now[0] = 30.0  # half the window after the writer was made: the first step took that long
    writer.add(0)
    assert landed.wait(WAIT_S), "an item that came slowly waited for the window"
    writer.wait()
    now[0] = 31.0
    writer.add(1)
    writer.add(2)
    assert stored == [[0]], "an item that came fast went out without its window"
    writer.wait()
    assert stored == [[0], [1, 2]]


def test_the_first_window_is_shorter_by_a_random_share_and_later_ones_are_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tasks that start together step alike: with equal windows they would store together,
    window after window. A writer's first window is drawn from [FIRST_WINDOW_MIN, 1] of it, so
    that their calls stay apart; later windows are whole."""
    draws: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        draws.append((low, high))
        return 0.2

    monkeypatch.setattr(random, "uniform", uniform)
    store = Landings()
    landed, stored, stored_at = store.landed, store.stored, store.stored_at

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=10, batch_window_s=10)
    added = time.monotonic()
    writer.add(0)
    assert landed.wait(WAIT_S) and stored == [[0]]
    assert stored_at[0] - added < 9, "the first window was whole"  # 2 s drawn, 10 s whole
    assert draws == [(FIRST_WINDOW_MIN, 1.0)]
    writer.wait()
    writer.add(1)
    assert stored == [[0]], "a later window was cut short"
    writer.wait()
    assert stored == [[0], [1]]


def test_the_first_window_after_a_pause_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers that waited out the same stall (or the same slow step) resume together: with whole
    windows from there on they would store together again, so the window after a pause is drawn
    as the first one is (here: a share of 0, so the item goes out at once)."""
    monkeypatch.setattr(random, "uniform", lambda low, high: 0.0)
    now = [0.0]
    store = Landings()
    landed, stored = store.landed, store.stored

    writer: StoreWriter[int] = StoreWriter(
        store, max_unconfirmed=10, batch_window_s=60, clock=lambda: now[0], first_window=1.0
    )
    now[0] = 1.0
    writer.add(0)
    writer.wait()
    landed.clear()
    now[0] = 50.0  # a pause: stored as it comes, and the next window is drawn
    writer.add(1)
    assert landed.wait(WAIT_S)
    writer.wait()
    landed.clear()
    now[0] = 51.0
    writer.add(2)
    assert landed.wait(WAIT_S), "the window after a pause was whole"
    assert stored == [[0], [1], [2]]


def test_a_batch_that_holds_half_of_max_unconfirmed_goes_out_before_its_window_closes() -> None:
    """Steps of a few hundred milliseconds fill a long window with more entries than a SIGKILL may
    cost: the batch goes out once it holds half of ``max_unconfirmed``, not at the window's end,
    so the run, stepping on while that call is in flight, does not reach the bound and wait."""
    store = Landings()
    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=6, batch_window_s=WAIT_S * 10)
    writer.add(0)
    writer.add(1)
    assert store.stored == [] and writer.unconfirmed == 2
    writer.add(2)
    assert store.landed.wait(WAIT_S), "a batch of half max_unconfirmed waited for its window"
    assert store.stored == [[0, 1, 2]]


def test_a_run_at_max_unconfirmed_waits_for_the_call_in_flight_not_for_the_window() -> None:
    gate = threading.Event()
    stored: list[list[int]] = []

    def store(batch: list[int]) -> None:
        assert gate.wait(WAIT_S)
        stored.append(batch)

    writer: StoreWriter[int] = StoreWriter(store, max_unconfirmed=2, batch_window_s=WAIT_S * 10)
    writer.add(0)  # a full batch (half of 2): its call starts, and stalls at the gate
    writer.wait_for_room()
    writer.add(1)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (writer.wait_for_room(), done.set()), daemon=True)
    waiter.start()
    assert not done.wait(0.2), "the run went past max_unconfirmed"
    gate.set()
    assert done.wait(WAIT_S), "the run waited for the window, not for the store"
    assert [item for batch in stored for item in batch] == [0, 1]


def test_a_windowed_run_stores_its_steps_in_few_calls_and_resumes_as_any() -> None:
    """The whole run's steps wait in the window (longer than the run); its end stores them in one
    call. A try cancelled in step 4 stores the steps that waited as it unwinds, and the next try
    repeats none."""
    store = MemoryStore()
    task = Task()
    result, _, _ = task.run(store, 1, batch_window_s=WAIT_S * 10)
    assert result.output == "all done"
    assert store.writes == 1, f"{store.writes} store calls for one run and its end in one window"
    killed = MemoryStore()
    first = Task(on_call=cancel_on(4, CauseVerdict(CancelCause.EVICTION, "test")))
    exc, _, _ = first.run(killed, 1, batch_window_s=WAIT_S * 10)
    assert isinstance(exc, TaskCancelled)
    assert killed.writes == 1, f"{killed.writes} store calls for 4 steps and the end in one window"
    second = Task()
    result, journal, _ = second.run(MemoryStore(dict(killed.data)), 2)
    assert result.output == "all done" and journal.resume is not None
    assert [n for n, _ in second.calls] == [4, 5, 6] and second.calls[0] == (4, True)


def test_a_batch_goes_out_in_parts_under_the_stores_value_limit() -> None:
    """Airflow logs a warning at every task state store value over ``[state_store]
    max_value_storage_bytes``: a batch of many steps is stored in consecutive parts under the
    store's limit (an entry over it alone would still go alone), and the next try resumes from
    them as from one."""
    limit = 2500
    killed = MemoryStore(max_value_bytes=limit)
    first = Task(on_call=cancel_on(4, CauseVerdict(CancelCause.EVICTION, "test")))
    exc, _, _ = first.run(killed, 1, batch_window_s=WAIT_S * 10)
    assert isinstance(exc, TaskCancelled)
    values = [json.loads(raw) for raw in killed.data.values()]
    assert killed.writes > 1, "the batch went out in one call, over the limit"
    assert all(len(json.dumps(v)) <= limit for v in values if isinstance(v, list)), "a part over the limit"
    assert any(isinstance(v, list) for v in values), "no part held more than one entry"
    second = Task()
    result, journal, _ = second.run(MemoryStore(dict(killed.data)), 2)
    assert result.output == "all done" and journal.resume is not None
    assert [n for n, _ in second.calls] == [4, 5, 6] and second.calls[0] == (4, True)


def test_a_format_2_record_still_resumes() -> None:
    """A record an older version wrote (format 2: one entry per key, its head saying 2) resumes
    after an upgrade, exactly as one this version wrote."""
    data = killed_at(3)
    keys = [segment_key(RECORD, 1, j) for j in range(3)]
    prev = ""
    for key in keys:  # the same entries as format 2 wrote them: the head says 2, re-chained
        entry = json.loads(data[key])
        body = {k: v for k, v in entry.items() if k != "h"}
        if "head" in body:
            body["head"]["format"] = 2
        body["prev"] = prev
        prev = chain(prev, body)
        data[key] = json.dumps({**body, "h": prev})
    task = Task()
    result, journal, _ = task.run(MemoryStore(data), 2)
    assert result.output == "all done"
    assert journal.resume is not None and journal.resume.from_try == 1
    assert task.script.requests == STEPS + 1 - 3
