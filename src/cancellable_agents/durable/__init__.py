"""The continuity record (``durable=True``): a killed try's next try resumes where it stopped.

See ``docs/content/durable.md``. ``current_resume()`` tells a tool whether its run resumed an
earlier try, and ``current_resume().is_rerun(ctx.tool_call_id)`` whether this very call already
ran there (at-least-once for the step that was in flight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cancellable_agents.durable.capability import JournalCapability as JournalCapability
    from cancellable_agents.durable.journal import Journal as Journal
    from cancellable_agents.durable.pauses import ApprovalRequest as ApprovalRequest
    from cancellable_agents.durable.pauses import AwaitingApproval as AwaitingApproval
    from cancellable_agents.durable.pauses import Decision as Decision
    from cancellable_agents.durable.pauses import PendingCall as PendingCall
    from cancellable_agents.durable.reasons import FreshStart as FreshStart
    from cancellable_agents.durable.reasons import RecordingOff as RecordingOff
    from cancellable_agents.durable.record_format import RecordProblem as RecordProblem
    from cancellable_agents.durable.resume import ResumeInfo as ResumeInfo
    from cancellable_agents.durable.resume import current_resume as current_resume
    from cancellable_agents.durable.stores import MemoryStore as MemoryStore
    from cancellable_agents.durable.stores import PathStore as PathStore
    from cancellable_agents.durable.stores import Store as Store
    from cancellable_agents.durable.stores import TaskStateStore as TaskStateStore
    from cancellable_agents.durable.try_usage import TryUsage as TryUsage

# Eager, and light: a lazy ``fingerprint`` would lose to the submodule of the same name, which
# Python binds on this package once anything imports it.
from cancellable_agents.core.lazy import lazy_exports
from cancellable_agents.durable.fingerprint import fingerprint

#: The names below load on first use: the operators import this package's light parts (the
#: approval types) while a DAG file is parsed, and pydantic-ai must not load with them.
_EXPORTS = {
    "ApprovalRequest": "cancellable_agents.durable.pauses",
    "AwaitingApproval": "cancellable_agents.durable.pauses",
    "Decision": "cancellable_agents.durable.pauses",
    "PendingCall": "cancellable_agents.durable.pauses",
    "JournalCapability": "cancellable_agents.durable.capability",
    "Journal": "cancellable_agents.durable.journal",
    "FreshStart": "cancellable_agents.durable.reasons",
    "RecordingOff": "cancellable_agents.durable.reasons",
    "RecordProblem": "cancellable_agents.durable.record_format",
    "ResumeInfo": "cancellable_agents.durable.resume",
    "current_resume": "cancellable_agents.durable.resume",
    "MemoryStore": "cancellable_agents.durable.stores",
    "PathStore": "cancellable_agents.durable.stores",
    "Store": "cancellable_agents.durable.stores",
    "TaskStateStore": "cancellable_agents.durable.stores",
    "TryUsage": "cancellable_agents.durable.try_usage",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
