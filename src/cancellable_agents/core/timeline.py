"""What a scope remembers: its timeline events and the processes its unwind stopped.

A leaf module (it imports nothing of the package), so the scope, the exceptions and every
backend can share these types without an import cycle.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KillRecord", "TimelineEvent"]


@dataclass(frozen=True)
class TimelineEvent:
    """One step of a scope's life. ``at`` is ``time.monotonic()``, ``wall`` is ``time.time()``."""

    event: str
    at: float
    wall: float
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, origin: float) -> dict[str, Any]:
        """The event with its time as milliseconds since ``origin`` (a monotonic reading)."""
        return {"event": self.event, "ms": round((self.at - origin) * 1000, 1), **self.detail}


@dataclass(frozen=True)
class KillRecord:
    """One process or remote command an unwind stopped.

    ``pid`` is optional: a remote sandbox's command has an id but no local process.
    ``exit_code`` is the command's own exit code (negative: killed by that signal) where known.
    """

    source: str
    """Who stopped it: ``sandbox``, ``descendant_reaper``, or a backend's name."""
    command: str = ""
    pid: int | None = None
    command_id: str | None = None
    signal: int | None = None
    exit_code: int | None = None
    reason: str = ""
    mode: str | None = None
    sandbox: str | None = None
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly, without the fields that do not apply."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}
