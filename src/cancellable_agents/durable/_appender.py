"""The appender: one try's writes to its record, chained, in order, fenced.

It owns what makes an entry (its index ``i`` in the whole record, its place in this try's
segment, the hash chained over the previous entry, the head the segment's first entry carries),
the writer thread that stores it while the run goes on
([`StoreWriter`][cancellable_agents.durable._writer.StoreWriter]: the entries queued while a call is
in flight go out together in the next, under the key of the first; the run waits only when more
than `MAX_UNCONFIRMED` are not yet stored), and the ownership check that notices a newer try took
over. Apart from the journal because two threads meet here and nowhere else: the run's thread
(the one that drives the agent) calls every public method; `Appender._store` and
`Appender._still_owner` run on the writer's thread. Each field says which thread writes it.
The record's layout and its checks: [`cancellable_agents.durable._record_format`][].

Fencing needs no read before a write: each try writes only keys of its own, and a newer try
reads an older one only up to the count frozen in its head's ``base``. The ownership check only
stops a stale try's wasted work sooner than Airflow's heartbeat does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable._reasons import RecordingOff
from cancellable_agents.durable._record_format import FORMAT, LoadedRecord, chain, segment_key, segment_try
from cancellable_agents.durable._stores import ListableStore, Store
from cancellable_agents.durable._try_usage import TryUsage
from cancellable_agents.durable._writer import StoreWriter

log = logging.getLogger(__name__)

#: How often a try looks whether a newer try took over (its only reads while the run goes). A
#: backstop: Airflow itself ends a superseded try within a heartbeat (its heartbeat is refused
#: once the newer try runs), and fencing never depends on it. At 10 s these reads were a third
#: of a 20-second run's store calls at 32 durable agents, every one a round trip through the
#: API server the fleet's heartbeats share; at 30 s still a third of a 40-second run's.
OWNER_CHECK_S = 60.0
#: Every this many ownership checks (from the this-many-th on) also look whether the record was
#: deleted: a second read, which at every check doubled what a long run adds to the store
#: between its steps, and at the first one made it two reads in every run of over 30 s.
DELETION_CHECK_EVERY = 3
#: How many entries may be appended but not yet stored before the run waits for the store. A
#: SIGKILL loses at most these (each a completed step or a parallel call's result): the next try
#: repeats at most this many completed steps, and only those of the last batch window (steps
#: slower than half a window are stored as they complete). A batch goes out once it holds half
#: of them: steps of a few hundred milliseconds share one call per 32 steps or per window, and
#: the other half rides out a store stall of seconds without the run waiting. At 32 durable
#: agents the calls were most of what the journal added to the API server (with 16 and a 6 s
#: window 0.13 calls per step, now 0.06).
MAX_UNCONFIRMED = 64


@dataclass(frozen=True)
class _Queued:
    """One entry on its way to the store: its place in this try's segment, and how to store it.
    ``owned``: the run goes on after it (a step, a tool's result), so before it is stored the
    writer may look whether a newer try took over."""

    own: int
    entry: dict[str, Any]
    owned: bool
    timed: bool


def _parts_under(batch: list[_Queued], max_bytes: int) -> list[list[_Queued]]:
    """``batch`` cut into consecutive parts whose stored JSON stays within ``max_bytes`` (``0``:
    one part), each an entry alone or a list, as ``json.dumps`` (Airflow's size check) counts
    it. A batch of 32 quick steps of a few kB each would otherwise log Airflow's size warning
    at every call; an entry over the limit on its own still goes alone."""
    if max_bytes <= 0 or len(batch) == 1:
        return [batch]
    parts: list[list[_Queued]] = [[]]
    size = 2  # the list's brackets
    for queued in batch:
        entry_size = len(json.dumps(queued.entry)) + 2  # its separator
        if parts[-1] and size + entry_size > max_bytes:
            parts.append([])
            size = 2
        parts[-1].append(queued)
        size += entry_size
    return parts


class Appender:
    """This try's segment of the record: [`take_over`][], then [`append`][] each entry.

    A store error turns the record off ([`turn_off`][], one warning); so does a newer try's
    segment (fenced: the run is cancelled) or the record's deletion, seen by the ownership check.
    Building one touches no store. The parameters are
    [`Journal`][cancellable_agents.durable._journal.Journal]'s of the same names.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        try_number: int,
        *,
        scope: TaskCancellation | None = None,
        clock: Callable[[], float] = time.time,
        owner_check_s: float = OWNER_CHECK_S,
        write_ahead: bool = False,
        beside_is_safe: Callable[[], bool] | None = None,
        on_step_written: Callable[[float], None] | None = None,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        batch_window_s: float = 0.0,
    ) -> None:
        self.store, self.key, self.try_number = store, key, try_number
        self._scope, self._clock, self._owner_check_s = scope, clock, owner_check_s
        self._write_ahead, self._ask_beside_is_safe = write_ahead, beside_is_safe
        self._on_step_written = on_step_written
        # The run's thread only (the writer gets each entry whole, already chained).
        self._seq = 0  # the next entry's index in the whole record
        self._own = 0  # entries of this try's segment (its next index)
        self._prev = ""  # the hash of the last entry appended, stored or in flight
        self._head: dict[str, Any] = {}  # what this try's first entry carries
        self._writer: StoreWriter[_Queued] = StoreWriter(self._store, max_unconfirmed, batch_window_s)
        self._landing_noted = False
        # The writer's thread only, once take_over set them (no write is in flight before it).
        self._stored_any = False  # this try's segment has an entry in the store
        self._next_check = 0.0  # when the ownership check is next due (``clock``)
        self._checks = 0  # ownership checks made
        # Either thread: the run's on a store error it was told of, the writer's when fenced
        # or the record was deleted. Written under the lock (the first reason stays, but fencing
        # always wins); read without it: a run-thread read that misses a fence set a moment ago
        # costs one more append under this try's own keys, which no newer try reads.
        self._off_lock = threading.Lock()
        self._off: str | None = None
        self._off_reason: RecordingOff | None = None

    @property
    def off(self) -> str | None:
        """Why the record is no longer written (for messages); ``None`` while it is."""
        return self._off

    @property
    def off_reason(self) -> RecordingOff | None:
        """[`off`][], classified."""
        return self._off_reason

    @property
    def segment_length(self) -> int:
        """Entries in this try's segment, stored or in flight (a continued try's included)."""
        return self._own

    def take_over(
        self, fingerprint: str, clears: int | None, earlier: Sequence[TryUsage], after: LoadedRecord | None
    ) -> None:
        """Begin this try's segment, chained after ``after`` (the record it resumes; ``None``: a
        new chain). Its first entry carries the head: from then on later tries read this try's
        record, and what older tries append past the count frozen in ``base`` is never read."""
        base: list[list[int]] = []
        if after is not None:
            base = after.segments
            self._seq, self._prev = len(after.entries), after.last_hash
            if after.owner_try == self.try_number:  # continuing this try after an approval pause
                base, self._own = after.head["base"], after.segments[-1][1]
                self._stored_any = self._own > 0
        self._head = {
            "format": FORMAT,
            "fingerprint": fingerprint,
            "clears": clears,
            "tries": [t.as_dict() for t in earlier],
            "base": base,
        }
        self._next_check = self._clock() + self._owner_check_s

    def append(
        self, body: dict[str, Any], *, land: bool = True, owned: bool = False, timed: bool = False
    ) -> None:
        """One entry, chained, under this try's own key; the first carries the head.

        Stored by the writer, with whatever else is queued then: ``land`` waits until it is
        (raising what the store raised); otherwise the run goes on, having waited only if
        ``max_unconfirmed`` entries were not yet stored, and [`settle`][] waits for them all.
        ``owned``: the run goes on after it, stored only if no newer try took over (see
        ``_store``); ``timed``: its store call's time goes to ``on_step_written``.
        """
        body = {
            **body,
            "i": self._seq,
            "try": self.try_number,
            "at": round(self._clock(), 3),
            "prev": self._prev,
        }
        if self._own == 0:
            body["head"] = self._head
        digest = chain(self._prev, body)
        queued = _Queued(self._own, {**body, "h": digest}, owned, timed)
        self._seq += 1
        self._own += 1
        self._prev = digest
        self._writer.wait_for_room()
        ticket = self._writer.add(queued)
        if land or not self._beside_is_safe():
            self._writer.wait(ticket)

    def settle(self) -> None:
        """Wait for every append not yet stored; one that failed turns the record off (one warning)."""
        try:
            self._writer.wait()
        except Exception as exc:
            self.turn_off(f"appending to the record failed ({exc!r}); later steps are not recorded")

    def turn_off(self, why: str, reason: RecordingOff = RecordingOff.STORE_ERROR) -> None:
        """Write no more (the first ``why`` stays; one warning): the run itself goes on."""
        with self._off_lock:
            if self._off is not None:
                return
            self._off, self._off_reason = why, reason
        log.warning("durable: %s; the run goes on without its continuity record", why)

    def drop_record(self) -> None:
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

    def _beside_is_safe(self) -> bool:
        """Whether this entry may be stored beside the run (``beside_is_safe``; unsure: no)."""
        if self._ask_beside_is_safe is None:
            return True
        try:
            safe = self._ask_beside_is_safe()
        except Exception:
            safe = False  # unsure: the old order, which is always safe
        if not safe and not self._write_ahead and not self._landing_noted:
            self._landing_noted = True
            log.info(
                "durable: the task used Airflow's async API on its event loop, so each step is now "
                "stored before its tools run (a sync Airflow call on that loop may not meet the "
                "journal's write in progress)"
            )
        return safe

    def _store(self, batch: list[_Queued]) -> None:
        """(On the writer's thread.) One store call for ``batch`` (consecutive entries), under the
        key of its first: the entry itself if it is alone (as format 2 wrote every entry), else
        the list of them. Nothing if a newer try took over (a fenced try's entries, an end
        included, are never read). The ownership look only stops a stale try's remaining work,
        so a batch that ends with an entry not owned (the run's end) is stored without one: in
        a fleet of 32, four runs in ten made their only look (two reads) right before their end."""
        started = time.perf_counter()
        if batch[-1].owned and not self._still_owner():
            return
        for part in _parts_under(batch, getattr(self.store, "max_value_bytes", 0)):
            value: Any = part[0].entry if len(part) == 1 else [q.entry for q in part]
            self.store.set(segment_key(self.key, self.try_number, part[0].own), value)
            self._stored_any = True
        if self._on_step_written is None:
            return
        took_ms = (time.perf_counter() - started) * 1000
        for queued in batch:
            if queued.timed:
                with contextlib.suppress(Exception):  # timing a step never costs the run its record
                    self._on_step_written(took_ms)

    def _still_owner(self) -> bool:
        """(On the writer's thread.) No newer try took over, looked up at most every
        ``owner_check_s``: one read when due, none otherwise; every ``DELETION_CHECK_EVERY``-th
        check, one more for whether the record is still there."""
        now = self._clock()
        if now < self._next_check:
            return True
        self._next_check = now + self._owner_check_s
        self._checks += 1
        newer = self.try_number + 1
        if self.store.get(segment_key(self.key, newer, 0)) is None:
            deletion_due = self._checks % DELETION_CHECK_EVERY == 0
            own_first = segment_key(self.key, self.try_number, 0)
            if deletion_due and self._stored_any and self.store.get(own_first) is None:
                self.turn_off(
                    "the record was deleted while the run went on; later steps are not recorded",
                    RecordingOff.DELETED,
                )
                return False
            return True
        with self._off_lock:
            self._off, self._off_reason = "superseded", RecordingOff.FENCED
        log.error(
            "durable: try %s is not the newest: try %s wrote a record of its own, so this try's appends "
            "no longer count and it cancels itself (two copies of one task were running)",
            self.try_number,
            newer,
        )
        if self._scope is not None:
            self._scope.cancel(CancelCause.EVICTION, detail=f"superseded by try {newer} of the same task")
        return False
