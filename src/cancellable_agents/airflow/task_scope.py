"""Where an operator keeps its task instance's scope, and how others find it.

One home for the attribute, so the mixin (which creates the scope) and the retry policy and
callbacks (which only look) agree without importing each other.
"""

from __future__ import annotations

import threading
from typing import Any

from cancellable_agents.core.scope import TaskCancellation

#: The operator's ``__dict__`` key holding its scope (operators are deep-copied per try, so the
#: scope lives on the instance, never on the class).
_ATTRIBUTE = "_task_cancellation"

#: The scope is created lazily and operators are deep-copied, so its lock cannot live on them.
#: Re-entrant: ``on_kill`` runs as a signal handler on the main thread and needs the scope, also
#: when the signal lands while the main thread is creating it (a plain Lock deadlocks there).
_creation = threading.RLock()


def cancellation_of(task: Any) -> TaskCancellation | None:
    """The scope of ``task`` (an operator with the mixin) if it has one yet, else ``None``.

    Never creates one: a retry policy or a callback asking after the fact must not invent a
    scope that no kill could have reached.
    """
    return getattr(task, "__dict__", {}).get(_ATTRIBUTE)


def scope_for(task: Any, budget: float) -> TaskCancellation:
    """``task``'s scope, created on first use and never replaced."""
    scope = cancellation_of(task)
    if scope is not None:
        return scope
    with _creation:
        scope = cancellation_of(task)
        if scope is None:
            fresh = TaskCancellation(getattr(task, "task_id", type(task).__name__), budget=budget)
            # A kill handled while ``fresh`` was being built created (and cancelled) the
            # scope already: keep that one, or the kill would be lost.
            scope = task.__dict__.setdefault(_ATTRIBUTE, fresh)
    return scope
