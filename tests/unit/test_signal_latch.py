"""The harness's signal latch (``tests/taskproc.py``) wakes for a signal that the kernel
delivered to another thread: such a signal interrupts no ``select`` on the main thread, and
Python runs its handler only once the main thread is back in bytecode."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.taskproc import SignalLatch

#: The latch's timeout in the test: a latch that slept through the signal wakes only then.
LONG_WAIT = 60.0


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
        assert latch.wait(LONG_WAIT)
        # Sleeping through the signal means waking at the timeout: far from any scheduling delay.
        assert time.monotonic() - begun < LONG_WAIT / 2, "the latch slept through the signal"
    finally:
        done.set()
        thread.join(5)
