"""The harness's signal latch (``benchmarks/taskproc.py``) wakes for a signal that the kernel
delivered to another thread: such a signal interrupts no ``select`` on the main thread, and
Python runs its handler only once the main thread is back in bytecode."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest
from benchmarks.taskproc import SignalLatch


@pytest.fixture
def latch() -> Iterator[SignalLatch]:
    latch = SignalLatch()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: latch.set())
    yield latch
    signal.signal(signal.SIGUSR1, previous)


def test_a_signal_delivered_to_another_thread_wakes_the_latch_at_once(latch: SignalLatch) -> None:
    started, done = threading.Event(), threading.Event()

    def bystander() -> None:
        started.set()
        done.wait(30)

    thread = threading.Thread(target=bystander, daemon=True)
    thread.start()
    assert started.wait(5)
    try:
        assert thread.ident is not None
        signal.pthread_kill(thread.ident, signal.SIGUSR1)
        begun = time.monotonic()
        assert latch.wait(20)
        assert time.monotonic() - begun < 5, "the latch slept through the signal until its timeout"
    finally:
        done.set()
        thread.join(5)
