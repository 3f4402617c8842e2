"""Tool approval in a durable run: the run stops at the step whose tool calls need a person's
consent, the pending calls are in the record, and a later execution continues with the answers.

pydantic-ai ends a run whose model called a ``requires_approval`` tool with a
``DeferredToolRequests`` output; here that output becomes an :class:`ApprovalRequest` (what a
reviewer needs: tool, arguments, the model's own words), and the reviewer's :class:`Decision`
per call becomes the ``DeferredToolResults`` the next run gets. Airflow-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cancellable_agents.core.exceptions import CancellableAgentsError

if TYPE_CHECKING:  # pydantic-ai loads when a run needs it, not when a DAG file is parsed
    from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolApproved, ToolDenied
    from pydantic_ai.messages import ModelMessage, ToolCallPart

#: What a rejected call's model is told when the reviewer gave no message.
DEFAULT_REJECTION = "A reviewer rejected this tool call."


@dataclass(frozen=True)
class PendingCall:
    """One tool call waiting for consent."""

    tool_call_id: str
    tool_name: str
    args: dict[str, Any]

    @classmethod
    def of(cls, part: ToolCallPart) -> PendingCall:
        return cls(part.tool_call_id, part.tool_name, part.args_as_dict())

    def args_text(self) -> str:
        """The arguments as indented JSON: what a reviewer reads."""
        return json.dumps(self.args, indent=2, sort_keys=True, default=str)

    def as_dict(self) -> dict[str, Any]:
        return {"tool_call_id": self.tool_call_id, "tool": self.tool_name, "args": self.args}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingCall:
        return cls(str(data["tool_call_id"]), str(data["tool"]), dict(data.get("args") or {}))


@dataclass(frozen=True)
class ApprovalRequest:
    """A durable run stopped at a step boundary until its pending calls are answered.

    ``reason``: the text the model wrote in the response that made the calls (why it wants
    them), empty if it wrote none. ``run_key``: which run of the task (its order in ``execute``).
    """

    calls: tuple[PendingCall, ...]
    reason: str
    try_number: int
    run_key: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": [c.as_dict() for c in self.calls],
            "reason": self.reason,
            "try": self.try_number,
            "run_key": self.run_key,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ApprovalRequest:
        return cls(
            tuple(PendingCall.from_dict(c) for c in data.get("calls", ())),
            str(data.get("reason") or ""),
            int(data.get("try", 0)),
            str(data.get("run_key", "0")),
        )

    def describe(self) -> str:
        """Markdown for a reviewer: the model's reason, then each call with its arguments."""
        lines = [f"> {line}" for line in self.reason.splitlines()] if self.reason else []
        for call in self.calls:
            lines += ["", f"**{call.tool_name}** (`{call.tool_call_id}`)", "```json", call.args_text(), "```"]
        return "\n".join(lines).strip()


@dataclass(frozen=True)
class Decision:
    """A reviewer's answer to one call: run it (with ``override_args`` instead of the model's, if
    given), or not, the model then being told ``message``.

    ``args``: the call's arguments as the reviewer saw them. An answer is bound to them: a run
    whose pending call (same tool call id) has other arguments is asked again
    (:meth:`answers`), never handed a consent given for another call. ``None``: not bound (a
    decision made in code, which knows what it answers).
    """

    approved: bool
    message: str | None = None
    override_args: dict[str, Any] | None = None
    args: dict[str, Any] | None = None

    def answers(self, call: PendingCall) -> bool:
        """Whether this decision was made for ``call`` as it stands (its arguments unchanged)."""
        return self.args is None or self.args == call.args

    def as_dict(self) -> dict[str, Any]:
        return {
            "approved": self.approved,
            "message": self.message,
            "override_args": self.override_args,
            "args": self.args,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        override, args = data.get("override_args"), data.get("args")
        return cls(
            bool(data["approved"]),
            data.get("message"),
            dict(override) if override else None,
            dict(args) if args is not None else None,
        )

    def as_result(self) -> ToolApproved | ToolDenied:
        from pydantic_ai import ToolApproved, ToolDenied

        if self.approved:
            return ToolApproved(override_args=self.override_args)
        return ToolDenied(self.message or DEFAULT_REJECTION)


class AwaitingApproval(BaseException):
    """The durable run stopped until ``request`` is answered; the record holds everything to go on.

    A ``BaseException`` (like ``TaskAwaitingInput``) so that an ``except Exception`` in user
    code around the run cannot swallow the pause.
    """

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(f"awaiting approval of {', '.join(c.tool_name for c in request.calls)}")
        self.request = request


class ApprovalNotPossible(CancellableAgentsError):
    """The run asked for an approval that cannot be waited for (no record, or an external call)."""


def request_of(
    output: DeferredToolRequests, messages: Sequence[ModelMessage], try_number: int, run_key: str
) -> ApprovalRequest:
    """The :class:`ApprovalRequest` for a run that ended with ``output``.

    Raises :class:`ApprovalNotPossible` for calls deferred for external execution, which a
    reviewer cannot answer.
    """
    if output.calls:
        names = ", ".join(c.tool_name for c in output.calls)
        raise ApprovalNotPossible(f"tool calls deferred for external execution are not supported ({names})")
    ids = {c.tool_call_id for c in output.approvals}
    return ApprovalRequest(
        tuple(PendingCall.of(c) for c in output.approvals), _reason(messages, ids), try_number, run_key
    )


def _reason(messages: Sequence[ModelMessage], ids: set[str]) -> str:
    """The text of the model response that made the calls ``ids``."""
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    for message in reversed(messages):
        if isinstance(message, ModelResponse) and any(
            isinstance(p, ToolCallPart) and p.tool_call_id in ids for p in message.parts
        ):
            return "\n".join(p.content for p in message.parts if isinstance(p, TextPart)).strip()
    return ""


def deferred_results(decisions: Mapping[str, Decision]) -> DeferredToolResults:
    """What the continuing run gets for the answered calls."""
    from pydantic_ai import DeferredToolResults

    return DeferredToolResults(approvals={call_id: d.as_result() for call_id, d in decisions.items()})


def with_deferred_output(output_type: Any) -> Any:
    """``output_type`` that also lets the run end with ``DeferredToolRequests`` (a run whose tools
    need no approval never does, so its output is unchanged)."""
    from pydantic_ai import DeferredToolRequests

    if output_type is DeferredToolRequests:
        return output_type
    if isinstance(output_type, (list, tuple)):
        return output_type if DeferredToolRequests in output_type else [*output_type, DeferredToolRequests]
    return [output_type, DeferredToolRequests]
