"""A durable run's arguments: what ``Journal.attach`` hands to ``agent.run_sync`` instead of what
the caller passed.

Each function takes the run's keyword arguments and returns new ones; none touches the journal
or a store. Apart from the journal because they are pydantic-ai's vocabulary (``output_type``,
``message_history``, ``deferred_tool_results``, ``instructions``, ``usage``), not the record's.
"""

from __future__ import annotations

from typing import Any

from cancellable_agents.durable._fingerprint import run_toolsets, workspace_lost_on_retry
from cancellable_agents.durable._pauses import Decision, deferred_results, with_deferred_output
from cancellable_agents.durable._resume_plan import Resume
from cancellable_agents.durable._try_usage import TryUsage, add_usage

#: Told to a resumed run whose toolsets' workspace did not survive the try (a sandbox's).
SANDBOX_NOTE = (
    "This run was resumed after the task's previous try was stopped (try {previous} -> try {current}). "
    "The sandbox workspace of the previous try is gone: files written there no longer exist; "
    "recreate what you still need."
)


def with_pauses(agent: Any, run_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Let a durable run end at a pause (``DeferredToolRequests`` among its output types): where
    a tool requires approval, and where any tool may defer to outside work, which a run cannot
    know before the tool runs. Where pydantic-ai allows a run's own ``output_type``: not for an
    agent with output validators (its own error then names the fix, should a tool pause)."""
    if getattr(agent, "_output_validators", None):
        return run_kwargs
    return {
        **run_kwargs,
        "output_type": with_deferred_output(run_kwargs.get("output_type") or agent.output_type),
    }


def with_capability(run_kwargs: dict[str, Any], capability: Any) -> dict[str, Any]:
    """``capability`` added to the run's own."""
    return {**run_kwargs, "capabilities": [*(run_kwargs.get("capabilities") or ()), capability]}


def resumed(
    agent: Any, run_kwargs: dict[str, Any], plan: Resume, decisions: dict[str, Decision] | None
) -> dict[str, Any]:
    """The run continues ``plan``'s record: its messages as history (the prompt is among them),
    a reviewer's ``decisions`` as the deferred calls' results, and a note for the model when its
    workspace did not survive the try."""
    run_kwargs = {**run_kwargs, "message_history": plan.record.messages}
    if decisions is not None:
        run_kwargs["deferred_tool_results"] = deferred_results(decisions)
    if workspace_lost_on_retry(run_toolsets(agent, run_kwargs)):
        note = SANDBOX_NOTE.format(previous=plan.info.from_try, current=plan.info.try_number)
        run_kwargs["instructions"] = _with_note(run_kwargs.get("instructions"), note)
    return run_kwargs


def with_earlier_usage(run_kwargs: dict[str, Any], earlier: list[TryUsage]) -> dict[str, Any]:
    """The run starts counting from what ``earlier`` tries spent (its limits span tries)."""
    if not earlier:
        return run_kwargs
    return {**run_kwargs, "usage": add_usage(run_kwargs.get("usage"), earlier)}


def _with_note(instructions: Any, note: str) -> Any:
    if instructions is None:
        return note
    if isinstance(instructions, str):
        return f"{instructions}\n\n{note}"
    if isinstance(instructions, (list, tuple)):
        return [*instructions, note]
    return [instructions, note]
