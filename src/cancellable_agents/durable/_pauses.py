"""Pauses of a durable run: the run stops at the step whose tool calls wait for something outside
it, the pending calls are in the record, and a later execution continues with the answers.

Two things make a call wait, and both take this one path: a ``requires_approval`` tool (a
person's consent) and a tool that deferred its result to outside work
([`cancellable_agents.durable._deferred_calls`][]: pydantic-ai's ``CallDeferred`` carrying a trigger).
pydantic-ai ends such a run with a ``DeferredToolRequests`` output; here that output becomes an
[`ApprovalRequest`][] (the pending calls; for a reviewer: tool, arguments, the model's own
words; for a deferral: what to wait on), and each call's [`Decision`][] (a reviewer's answer,
or the outside work's result) becomes the ``DeferredToolResults`` the next run gets. Airflow-free.
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

#: The key of a deferred call's metadata (``DeferredToolRequests.metadata[tool_call_id]``) that
#: holds what it waits on (`Wait`).
WAIT_KEY = "cancellable_agents.wait"

#: What a rejected call's model is told when the reviewer gave no message.
DEFAULT_REJECTION = "A reviewer rejected this tool call."


@dataclass(frozen=True)
class PendingCall:
    """One tool call waiting: for consent, or (``wait`` set) for the outside work its tool
    started, ``wait`` being the JSON spec of what to wait on
    ([`Wait`][cancellable_agents.durable._deferred_calls.Wait])."""

    tool_call_id: str
    tool_name: str
    args: dict[str, Any]
    wait: dict[str, Any] | None = None

    @classmethod
    def of(cls, part: ToolCallPart, wait: dict[str, Any] | None = None) -> PendingCall:
        return cls(part.tool_call_id, part.tool_name, part.args_as_dict(), wait)

    def args_text(self) -> str:
        """The arguments as indented JSON: what a reviewer reads."""
        return json.dumps(self.args, indent=2, sort_keys=True, default=str)

    def as_dict(self) -> dict[str, Any]:
        data = {"tool_call_id": self.tool_call_id, "tool": self.tool_name, "args": self.args}
        return data if self.wait is None else {**data, "wait": self.wait}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingCall:
        wait = data.get("wait")
        return cls(
            str(data["tool_call_id"]),
            str(data["tool"]),
            dict(data.get("args") or {}),
            dict(wait) if isinstance(wait, Mapping) else None,
        )


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

    @property
    def is_deferral(self) -> bool:
        """The calls wait for outside work (the task defers to a trigger), not for a person."""
        return any(c.wait is not None for c in self.calls)

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
    ([`answers`][]), never handed a consent given for another call. ``None``: not bound (a
    decision made in code, which knows what it answers).

    ``external``: the call's outside work finished and ``result`` is what the tool returns to
    the model (a deferred call's answer; ``approved`` is then ``True``, the rest unused).
    """

    approved: bool
    message: str | None = None
    override_args: dict[str, Any] | None = None
    args: dict[str, Any] | None = None
    external: bool = False
    result: Any = None

    @classmethod
    def returned(cls, result: Any) -> Decision:
        """A deferred call's outside work finished with ``result`` (JSON)."""
        return cls(True, external=True, result=result)

    def answers(self, call: PendingCall) -> bool:
        """Whether this decision was made for ``call`` as it stands (its arguments unchanged)."""
        return self.args is None or self.args == call.args

    def as_dict(self) -> dict[str, Any]:
        if self.external:
            return {"approved": True, "external": True, "result": self.result}
        return {
            "approved": self.approved,
            "message": self.message,
            "override_args": self.override_args,
            "args": self.args,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        if data.get("external"):
            return cls.returned(data.get("result"))
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
    """The run asked for a pause that cannot be waited for (no record, an external call that
    names nothing to wait on, approvals and deferrals in one step)."""


def request_of(
    output: DeferredToolRequests, messages: Sequence[ModelMessage], try_number: int, run_key: str
) -> ApprovalRequest:
    """The [`ApprovalRequest`][] for a run that ended with ``output``.

    Raises [`ApprovalNotPossible`][] for calls deferred for external execution without a
    [`Wait`][cancellable_agents.durable._deferred_calls.Wait] (nothing could answer them), and for a
    step that both asks a person and waits for outside work (not supported yet).
    """
    unnamed = [c.tool_name for c in output.calls if WAIT_KEY not in output.metadata.get(c.tool_call_id, {})]
    if unnamed:
        raise ApprovalNotPossible(
            f"tool calls deferred for external execution without a trigger to wait on are not supported "
            f"({', '.join(unnamed)}); defer with cancellable_agents.defer_to(trigger)"
        )
    if output.calls and output.approvals:
        raise ApprovalNotPossible(
            f"one step both asks for approval ({', '.join(c.tool_name for c in output.approvals)}) and "
            f"waits for outside work ({', '.join(c.tool_name for c in output.calls)}); not supported yet"
        )
    calls = tuple(
        PendingCall.of(c, output.metadata[c.tool_call_id][WAIT_KEY]) for c in output.calls
    ) or tuple(PendingCall.of(c) for c in output.approvals)
    ids = {c.tool_call_id for c in calls}
    return ApprovalRequest(calls, _reason(messages, ids), try_number, run_key)


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

    return DeferredToolResults(
        approvals={call_id: d.as_result() for call_id, d in decisions.items() if not d.external},
        calls={call_id: d.result for call_id, d in decisions.items() if d.external},
    )


def with_deferred_output(output_type: Any) -> Any:
    """``output_type`` that also lets the run end with ``DeferredToolRequests`` (a run whose tools
    need no approval never does, so its output is unchanged)."""
    from pydantic_ai import DeferredToolRequests

    if output_type is DeferredToolRequests:
        return output_type
    if isinstance(output_type, (list, tuple)):
        return output_type if DeferredToolRequests in output_type else [*output_type, DeferredToolRequests]
    return [output_type, DeferredToolRequests]
