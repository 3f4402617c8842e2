"""The pydantic-ai hook of a durable run: each completed step into the journal, a call that returned
in an earlier try answered from the record."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart

if TYPE_CHECKING:
    from cancellable_agents.durable._steps import StepRecorder


class JournalCapability(AbstractCapability[Any]):
    """Appends each completed step to the journal (added to a run only when it is durable).

    ``after_node_run`` fires after every graph node however the run is driven (``run_sync``,
    with or without ``event_stream_handler``), and never for a node a cancel interrupted: a
    step is recorded only once it completed.
    """

    def __init__(self, steps: StepRecorder) -> None:
        self._steps = steps

    @property
    def steps(self) -> StepRecorder:
        """The recorder the hooks drive (the run's own capability takes them over: see
        ``run_capabilities`` in ``cancellable_agents.run._tracker``)."""
        return self._steps

    async def after_node_run(self, ctx: Any, *, node: Any, result: Any) -> Any:
        self._steps.step(ctx.messages, result)
        return result

    async def wrap_tool_execute(
        self, ctx: Any, *, call: ToolCallPart, tool_def: Any, args: Any, handler: Any
    ) -> Any:
        """A call that returned in an earlier try gets its recorded result; any other runs, and a
        parallel call's result is appended as soon as it returns."""
        replayed, result = self._steps.replayed_result(call)
        if replayed:
            return result
        result = await handler(args)
        self._steps.tool_returned(ctx.messages, call, result)
        return result
