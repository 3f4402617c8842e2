"""The journal's store calls, off the run's loop and batched: a step's entry is written while its
tools run, and the entries that queued while a call was in flight go out together in the next.

Through Airflow's task state store a write is a round trip task -> supervisor -> API server ->
metadata DB, and at 32 durable agents on one API server it took p50 116 ms, p95 3.0 s
(``benchmarks/fleet.py``): a step that waited for the previous write whenever it outlasted the
step was paced by the store. Now the run waits only when more than ``max_unconfirmed`` entries
are not yet stored (a SIGKILL then costs at most that many completed steps, repeated by the next
try), and however many entries queued during one call, the next call stores them all: the
store's latency no longer multiplies with the number of steps, and the API server sees fewer
calls. Fewer still with a batch window: an entry waits up to ``batch_window_s`` for later ones
to share its call (the fleet's heartbeats share the API server), unless the run waits for it,
it came slower than half a window after the one before (then none would come to share it), or
its batch holds half of ``max_unconfirmed`` (the other half rides out the call without the run
waiting). Entries land in order (one call at a time), and a store error reaches the appender at
its next append. Airflow's comms channel may be called from any thread (its own lock orders the
calls).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")

#: How long the writer's thread waits for the next item once the queue is empty before it ends.
#: Starting a thread waits until the OS first runs it: at 32 agents on two cores that wait fell
#: on the run's thread at every batch. Steps that come sooner reuse the thread.
LINGER_S = 10.0
#: The first window of a writer, and the first after a pause (an item that waited for no
#: company), is a fraction of ``batch_window_s`` drawn from [this, 1]. Tasks that start together
#: (a mapped task's instances, a fleet's retries after an eviction storm) or resume together
#: (after a stall they all waited out) step alike, so with equal windows they stored together,
#: window after window: bursts of a dozen store calls within half a second at 32 agents, which
#: Airflow's heartbeats queued behind. Drawn over half a window (0.5), and only at the start,
#: the calls still came in waves. A short draw costs one call at most.
FIRST_WINDOW_MIN = 0.0


class StoreWriter(Generic[Item]):
    """Stores queued items in batches, one ``store(batch)`` call at a time, on a daemon thread.

    A batch goes out once its first item has waited ``batch_window_s`` (``0``: as soon as no call
    is in flight), once it holds half of ``max_unconfirmed`` items (so that the run, still
    stepping while that call is in flight, does not reach ``max_unconfirmed`` and wait), or at
    once when the run waits for it ([`wait`][], or [`wait_for_room`][] with ``max_unconfirmed``
    items unconfirmed). An item that came at least half a window after the one before it (or
    after the writer was made) waits for no company: at that pace hardly any would come, and
    waiting would only lengthen what a SIGKILL repeats. So the window batches
    fast steps, and a run whose steps take seconds has each stored as it completes. The first
    window, and the first after such a pause, is shorter by a random share (``first_window``: the
    first one's fraction of ``batch_window_s``; ``None``: drawn between ``FIRST_WINDOW_MIN`` and
    1, as the others are), so that writers started or resumed together stay apart.

    Used from one thread (the run's): [`add`][], [`wait`][] and [`wait_for_room`][] are not for
    concurrent callers. The thread lives while there is something to store, and ``linger_s``
    longer for the next item (then the next [`add`][] starts another): nothing needs stopping
    when the try ends, and a daemon thread left waiting or in a store call never holds up the
    process's exit.

    After a ``store`` call raised, nothing more is stored (a later batch would leave a gap in the
    record); the error is raised once, by the next [`add`][] or [`wait`][].
    """

    def __init__(
        self,
        store: Callable[[list[Item]], None],
        max_unconfirmed: int,
        batch_window_s: float = 0.0,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
        first_window: float | None = None,
    ) -> None:
        if max_unconfirmed < 1:
            raise ValueError(f"max_unconfirmed must be at least 1, not {max_unconfirmed}")
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0 seconds, not {batch_window_s}")
        self._store = store
        self._max_unconfirmed = max_unconfirmed
        self._full_batch = max(1, max_unconfirmed // 2)
        self._window_s = batch_window_s
        self._linger_s = linger_s
        self._clock = clock
        # The run's thread only: what the next window lasts (drawn after a pause, see FIRST_WINDOW_MIN).
        self._next_window_s = self._drawn_window() if first_window is None else batch_window_s * first_window
        self._cond = threading.Condition()
        # Under the condition's lock (both threads):
        self._queue: list[Item] = []
        self._due = 0.0  # when the queue's head goes out at the latest (``clock``)
        self._last_added = clock()  # when the latest item was added (or the writer made)
        self._urgent = False  # the run waits for the queue: store it now, not at the window's end
        self._added = 0  # items ever added
        self._done = 0  # items stored, or dropped after an error
        self._running = False  # a writer thread is alive (it owns the queue's head)
        self._error: BaseException | None = None
        self._raised = False

    @property
    def unconfirmed(self) -> int:
        """Items added but not yet stored (queued or in the call in flight)."""
        with self._cond:
            return self._added - self._done

    def add(self, item: Item) -> int:
        """Queue ``item``; returns its ticket for [`wait`][]. Raises a previous call's error."""
        with self._cond:
            self._raise_once()
            now = self._clock()
            first = not self._queue
            if first:
                paced = now - self._last_added < self._window_s / 2
                self._due = now + self._next_window_s if paced else now
                self._next_window_s = self._window_s if paced else self._drawn_window()
            self._last_added = now
            self._queue.append(item)
            self._added += 1
            ticket = self._added
            if self._running:
                # Only a thread waiting for an item, or for a window that this item fills, needs
                # waking: one waiting for the window waits for the head's due time, which a later
                # item does not change (waking it at every step would hand it the GIL for nothing).
                if first or len(self._queue) == self._full_batch:
                    self._cond.notify_all()
            else:
                self._running = True
                name = "cancellable-agents-journal-write"
                threading.Thread(target=self._run, name=name, daemon=True).start()
            return ticket

    def _drawn_window(self) -> float:
        """A window shorter by a random share, to start a rhythm apart from other writers'."""
        return self._window_s * random.uniform(FIRST_WINDOW_MIN, 1.0)

    def wait(self, ticket: int | None = None) -> None:
        """Until every item up to ``ticket`` (default: all added) is stored; raises what a store
        call raised (once)."""
        with self._cond:
            upto = self._added if ticket is None else ticket
            self._hurry()
            self._cond.wait_for(lambda: self._done >= upto or self._error is not None)
            self._raise_once()

    def wait_for_room(self) -> None:
        """Until one more item may be added without more than ``max_unconfirmed`` not yet stored
        (at once if so). With ``max_unconfirmed=1`` every item is stored alone, after the one
        before it."""
        with self._cond:
            if self._added - self._done >= self._max_unconfirmed:
                self._hurry()
            self._cond.wait_for(
                lambda: self._added - self._done < self._max_unconfirmed or self._error is not None
            )

    def _hurry(self) -> None:
        """(Under the lock.) The run waits: what is queued goes out without waiting for the window."""
        if self._added > self._done:  # else nothing to hurry: the next item keeps its window
            self._urgent = True
            self._cond.notify_all()

    def _window_left(self) -> float:
        """(Under the lock.) Seconds until the queue's head is due (its window closes)."""
        return max(0.0, self._due - self._clock())

    def _window_closed(self) -> bool:
        """(Under the lock.) Store the queue now: the run waits for it, it is a full batch, or its
        head waited long enough."""
        return (
            self._urgent
            or self._error is not None
            or len(self._queue) >= self._full_batch
            or self._window_left() <= 0
        )

    def _raise_once(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def _run(self) -> None:
        """(The writer's thread.) Store what is queued, in batches, until nothing is for
        ``linger_s``."""
        while True:
            with self._cond:
                if not self._queue and self._error is None:
                    self._urgent = False  # a wait met nothing queued: the next item has its window
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: bool(self._queue) or self._error is not None, self._linger_s)
                if not self._queue or self._error is not None:
                    self._done += len(self._queue)  # after an error: dropped, nobody waits for them
                    self._queue = []
                    self._running = False
                    self._urgent = False
                    self._cond.notify_all()
                    return
                self._cond.wait_for(self._window_closed, timeout=self._window_left())
                batch, self._queue, self._urgent = self._queue, [], False
            try:
                self._store(batch)
            except BaseException as exc:
                with self._cond:
                    self._error = exc
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()
