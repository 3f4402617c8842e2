"""Which isolation a :class:`~cancellable_agents.toolsets.sandbox.local.LocalSandbox` gets here.

``"namespace"`` when bubblewrap can give the chosen profile on this host, else (for
``isolation="auto"``) ``"process-group"``, which stops commands but is no boundary: that is
said once per task, loudly, since a DAG author may have counted on one. This module imports no
Airflow.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Literal

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox.bwrap import bwrap_support, unavailable_message
from cancellable_agents.toolsets.sandbox.command import Mode
from cancellable_agents.toolsets.sandbox.protocol import SandboxUnavailable

__all__ = ["Isolation", "Profile", "choose_mode", "warn_no_boundary"]

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespace", "process-group"]
Profile = Literal["boundary", "host"]


def choose_mode(isolation: str, profile: str) -> Mode:
    """The mode for ``isolation`` and ``profile``; :class:`SandboxUnavailable` (saying how to
    fix it) if ``"namespace"`` was required and cannot be had, ``ValueError`` for nonsense."""
    if isolation not in ("auto", "namespace", "process-group"):
        raise ValueError(f"isolation must be 'auto', 'namespace' or 'process-group', got {isolation!r}")
    if profile not in ("boundary", "host"):
        raise ValueError(f"profile must be 'boundary' or 'host', got {profile!r}")
    if isolation == "process-group":
        return "process-group"
    support = bwrap_support()
    if support.usable and (profile == "host" or support.boundary):
        return "namespace"
    if isolation == "namespace":
        raise SandboxUnavailable(unavailable_message(support, profile))
    log.info(
        "LocalSandbox: no %s namespace sandbox (%s); using process-group isolation",
        profile,
        support.reason or support.boundary_reason,
    )
    return "process-group"


_warned_lock = threading.Lock()
_warned: weakref.WeakSet[TaskCancellation] = weakref.WeakSet()  # guarded by _warned_lock
_warned_unscoped = False  # guarded by _warned_lock


def warn_no_boundary(scope: TaskCancellation | None) -> None:
    """Once per task (scope): process-group mode is cleanup, not a boundary."""
    global _warned_unscoped
    with _warned_lock:
        if scope is None:
            if _warned_unscoped:
                return
            _warned_unscoped = True
        else:
            if scope in _warned:
                return
            _warned.add(scope)
    log.warning(
        "LocalSandbox runs commands in process-group mode: this stops them on a kill but is NOT a "
        "security boundary (commands see the task's files and network and run as its user, with "
        "no limits). For a boundary install bubblewrap (`apt-get install bubblewrap`) and pass "
        "isolation='namespace' to fail instead of falling back."
    )
