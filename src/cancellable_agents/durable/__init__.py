"""The continuity record (``durable=True``): a killed try's next try resumes where it stopped.

See ``docs/content/durable.md``. ``current_resume()`` tells a tool whether its run resumed an
earlier try, and ``current_resume().is_rerun(ctx.tool_call_id)`` whether this very call already
ran there (at-least-once for the step that was in flight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cancellable_agents.durable._capability import JournalCapability as JournalCapability
    from cancellable_agents.durable._fingerprint import fingerprint as fingerprint
    from cancellable_agents.durable._journal import Journal as Journal
    from cancellable_agents.durable._pauses import ApprovalRequest as ApprovalRequest
    from cancellable_agents.durable._pauses import AwaitingApproval as AwaitingApproval
    from cancellable_agents.durable._pauses import Decision as Decision
    from cancellable_agents.durable._pauses import PendingCall as PendingCall
    from cancellable_agents.durable._reasons import FreshStart as FreshStart
    from cancellable_agents.durable._reasons import RecordingOff as RecordingOff
    from cancellable_agents.durable._record_format import RecordProblem as RecordProblem
    from cancellable_agents.durable._resume import ResumeInfo as ResumeInfo
    from cancellable_agents.durable._resume import current_resume as current_resume
    from cancellable_agents.durable._stores import MemoryStore as MemoryStore
    from cancellable_agents.durable._stores import PathStore as PathStore
    from cancellable_agents.durable._stores import Store as Store
    from cancellable_agents.durable._stores import TaskStateStore as TaskStateStore
    from cancellable_agents.durable._try_usage import TryUsage as TryUsage

from cancellable_agents.core._lazy import lazy_exports

#: The names below load on first use: the operators import this package's light parts (the
#: approval types) while a DAG file is parsed, and pydantic-ai must not load with them.
_EXPORTS = {
    "fingerprint": "cancellable_agents.durable._fingerprint",
    "ApprovalRequest": "cancellable_agents.durable._pauses",
    "AwaitingApproval": "cancellable_agents.durable._pauses",
    "Decision": "cancellable_agents.durable._pauses",
    "PendingCall": "cancellable_agents.durable._pauses",
    "JournalCapability": "cancellable_agents.durable._capability",
    "Journal": "cancellable_agents.durable._journal",
    "FreshStart": "cancellable_agents.durable._reasons",
    "RecordingOff": "cancellable_agents.durable._reasons",
    "RecordProblem": "cancellable_agents.durable._record_format",
    "ResumeInfo": "cancellable_agents.durable._resume",
    "current_resume": "cancellable_agents.durable._resume",
    "MemoryStore": "cancellable_agents.durable._stores",
    "PathStore": "cancellable_agents.durable._stores",
    "Store": "cancellable_agents.durable._stores",
    "TaskStateStore": "cancellable_agents.durable._stores",
    "TryUsage": "cancellable_agents.durable._try_usage",
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
