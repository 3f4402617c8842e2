"""A thread-safe "only the first time" flag, for the once-per-process notes a sandbox logs."""

from __future__ import annotations

import threading


class Once:
    """``first()`` is ``True`` for exactly one caller, whichever thread gets there first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False  # guarded by _lock

    def first(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True
