"""The journal's store calls, one at a time, off the run's loop: a step's entry is written while
its tools run instead of before.

Through Airflow's task state store a write is a round trip task -> supervisor -> API server ->
metadata DB (p50 23 ms with 16 durable agents on one API server, measured in
``benchmarks/fleet.py``), and a step waited for it before its tools started. Now the write
overlaps the tools: the next write, or [`StoreWriter.wait`][], waits for it, so entries land
in order, at most one is unconfirmed, and a store error reaches the appender at its next append.
Airflow's comms channel may be called from any thread (its own lock orders the calls).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class StoreWriter:
    """Runs each submitted store call on a daemon thread of its own, one call at a time.

    Used from one thread (the run's): [`submit`][] and [`wait`][] are not for concurrent
    callers. A thread per call, not a pool: a call is tens of milliseconds apart from the next,
    a thread costs ~0.1 ms, and nothing needs stopping when the try ends (a daemon thread left
    in a store call never holds up the process's exit).
    """

    def __init__(self) -> None:
        self._last: Future[None] | None = None  # the call in flight or not yet waited for (caller's thread)

    def submit(self, call: Callable[[], None]) -> None:
        """Wait for the previous call (raising what it raised), then start ``call``."""
        self.wait()
        done: Future[None] = Future()

        def run() -> None:
            try:
                call()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name="cancellable-agents-journal-write", daemon=True).start()
        self._last = done

    def wait(self) -> None:
        """Until the last call is stored; raises what it raised (once)."""
        last, self._last = self._last, None
        if last is not None:
            last.result()
