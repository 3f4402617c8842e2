"""The continuity record (``durable=True``): a killed try's next try resumes where it stopped.

See ``docs/content/durable.md``. ``current_resume()`` tells a tool whether its run resumed an
earlier try, and ``current_resume().is_rerun(ctx.tool_call_id)`` whether this very call already
ran there (at-least-once for the step that was in flight).
"""

from __future__ import annotations

from cancellable_agents.durable.journal import (
    Journal,
    JournalCapability,
    RecordProblem,
    ResumeInfo,
    Store,
    TryUsage,
    current_resume,
    fingerprint,
)
from cancellable_agents.durable.stores import MemoryStore, PathStore, TaskStateStore

__all__ = [
    "Journal",
    "JournalCapability",
    "MemoryStore",
    "PathStore",
    "RecordProblem",
    "ResumeInfo",
    "Store",
    "TaskStateStore",
    "TryUsage",
    "current_resume",
    "fingerprint",
]
