"""One daemon thread that runs the calls handed to it, one at a time, in order.

Used where a thread's identity matters more than a pool's convenience: sync tools reuse the
run's threads (starting one per call blocks the event loop in ``Thread.start``), and sandbox
commands are spawned from one long-lived thread (``PR_SET_PDEATHSIG`` fires when the *thread*
that forked the child exits). Daemon threads: work that ignores cancellation can never keep the
task process alive at exit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class JobThread:
    """A daemon thread serving a queue of calls until [`stop`][].

    ``after_call`` (optional) runs on the thread after each call and *before* its future is
    resolved, so a caller woken by the result finds the thread already free for its next call;
    returning ``False`` ends the thread.
    """

    def __init__(self, name: str, *, after_call: Callable[[JobThread], bool] | None = None) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._after_call = after_call
        self.current: concurrent.futures.Future[Any] | None = None
        """The last call handed over (read by the owner to tell a busy thread from an idle one)."""
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.current = future
        self._jobs.put((future, fn))
        return future

    def stop(self) -> None:
        """End the thread once the calls already handed over have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            del job
            result: Any = None
            error: BaseException | None = None
            started = future.set_running_or_notify_cancel()
            if started:
                try:
                    result = fn()
                except BaseException as exc:
                    error = exc
            keep = self._after_call(self) if self._after_call is not None else True
            if started and error is None:
                future.set_result(result)
            elif started:
                future.set_exception(error)
            del future, fn, result, error  # not held while idle
            if not keep:
                return
