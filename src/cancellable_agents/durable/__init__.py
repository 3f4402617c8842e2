"""The continuity record (``durable=True``): a killed try's next try resumes where it stopped.

See ``docs/content/durable.md``. ``current_resume()`` tells a tool whether its run resumed an
earlier try, and ``current_resume().is_rerun(ctx.tool_call_id)`` whether this very call already
ran there (at-least-once for the step that was in flight).
"""

from __future__ import annotations

from cancellable_agents.durable.approval import ApprovalRequest, AwaitingApproval, Decision, PendingCall
from cancellable_agents.durable.capability import JournalCapability
from cancellable_agents.durable.fingerprint import fingerprint
from cancellable_agents.durable.journal import Journal
from cancellable_agents.durable.reasons import FreshStart, RecordingOff
from cancellable_agents.durable.record import RecordProblem
from cancellable_agents.durable.resume import ResumeInfo, current_resume
from cancellable_agents.durable.stores import MemoryStore, PathStore, Store, TaskStateStore
from cancellable_agents.durable.usage import TryUsage

__all__ = [
    "ApprovalRequest",
    "AwaitingApproval",
    "Decision",
    "FreshStart",
    "Journal",
    "JournalCapability",
    "MemoryStore",
    "PathStore",
    "PendingCall",
    "RecordProblem",
    "RecordingOff",
    "ResumeInfo",
    "Store",
    "TaskStateStore",
    "TryUsage",
    "current_resume",
    "fingerprint",
]
