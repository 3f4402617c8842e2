"""Helpers the unit tests share."""

from __future__ import annotations

import threading

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation


def cancel_when(
    event: threading.Event, scope: TaskCancellation, cause: CancelCause = CancelCause.USER
) -> None:
    """Cancel ``scope`` from another thread once ``event`` is set (as ``on_kill``'s helper does)."""

    def fire() -> None:
        if event.wait(10):
            scope.cancel(cause)

    threading.Thread(target=fire, daemon=True).start()
