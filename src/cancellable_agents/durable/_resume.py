"""What a resumed durable run tells its tools: which try it continues, and which tool calls run
again (at-least-once for the step that was in flight). Leaf module of ``durable/``."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class ResumeInfo:
    """How this run continues an earlier try, for tools that must know they are a re-run.

    ``rerun_tool_calls``: ids of the tool calls that were in flight when the earlier try
    stopped; they run again (at-least-once). ``replayed_tool_calls``: calls of that same model
    response that had returned (parallel siblings); their recorded results are used, they do
    not run. Every other completed tool call is in the restored messages and is not redone.
    """

    try_number: int
    from_try: int
    messages: int
    rerun_tool_calls: frozenset[str] = frozenset()
    replayed_tool_calls: frozenset[str] = frozenset()

    def is_rerun(self, tool_call_id: str | None) -> bool:
        """Whether the tool call ``tool_call_id`` (``ctx.tool_call_id``) already ran in an earlier try."""
        return tool_call_id is not None and tool_call_id in self.rerun_tool_calls


#: The resume of the durable run this context belongs to (set by the journal for its run).
active_resume: contextvars.ContextVar[ResumeInfo | None] = contextvars.ContextVar(
    "cancellable_agents_resume", default=None
)


def current_resume() -> ResumeInfo | None:
    """The [`ResumeInfo`][] of the durable run this code belongs to, or ``None`` (a fresh run,
    a run without ``durable=True``, or outside any run). Usable from async and sync tools."""
    return active_resume.get()
