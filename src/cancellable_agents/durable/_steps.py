"""Step recording: which of the run's messages are not in the record yet, and when they go in.

When a model response calls tools, the messages not yet written (the tool returns the request
carried, and the response) are appended as one entry, stored while the tools run. The tool
returns wait for the next response to ride along, unless that request is still unanswered after
``returns_flush_s`` (then they are appended alone, while the model works); a cancelled try writes
them with its end. Of a response with several tool calls, each call's result is also appended as
it arrives, and a resumed run gets back the results its earlier try recorded instead of running
those calls again. All on the run's thread: the capability calls in from the run's loop, and the
flush is a callback of that loop, so every append is submitted from the thread that runs the
steps (the appender's writer stores it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic_ai.agent import CallToolsNode, ModelRequestNode
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart, ToolReturn
from pydantic_core import to_jsonable_python

from cancellable_agents.durable._appender import Appender
from cancellable_agents.durable._record_format import dump_messages


class StepRecorder:
    """Appends each completed step of one run, and replays the calls an earlier try returned.

    Driven by [`JournalCapability`][cancellable_agents.durable._capability.JournalCapability]; the journal
    reads what is still unwritten when the run ends. A failed append turns the record off.
    """

    def __init__(self, appender: Appender, *, returns_flush_s: float, write_ahead: bool) -> None:
        self._appender = appender
        self._returns_flush_s, self._write_ahead = returns_flush_s, write_ahead
        # The run's thread only.
        self._written = 0  # messages of the run in the record, stored or in flight
        self._pending: list[ModelMessage] = []  # tool returns not yet appended
        self._flush_timer: asyncio.TimerHandle | None = None
        self._replay: dict[str, Any] = {}  # results to hand back once each, by tool call id

    @property
    def pending(self) -> list[ModelMessage]:
        """The tool returns that wait for the next response's entry (a cancelled end takes them)."""
        return self._pending

    def resumed(self, messages: int, replay: dict[str, Any]) -> None:
        """The run resumes a record of ``messages`` messages; ``replay``: results of its last
        response's calls that had returned, by tool call id."""
        self._written, self._replay = messages, dict(replay)

    def unwritten(self, messages: Sequence[ModelMessage]) -> list[ModelMessage]:
        """The run's ``messages`` that are not in the record yet."""
        return [*messages[self._written :]]

    def all_written(self, messages: int) -> None:
        """The run's first ``messages`` messages, pending returns included, are in the record."""
        self._written, self._pending = messages, []

    def step(self, messages: Sequence[ModelMessage], result: Any) -> None:
        """After a graph step (on the run's loop): when tools are about to run, append the
        messages not yet written, the response that calls them last, as one entry.

        A step that leads to a model request has its request (the tool returns) in the next
        node, not yet in ``messages``: it waits for that request's response (one entry for
        both), or ``returns_flush_s``, whichever comes first. Any other step writes nothing: the
        prompt before the first response, and the answer that ends the run, cost a kill nothing.
        """
        if self._appender.off is not None:
            return
        self.stop_flush()
        calls_tools = bool(messages) and _calls_tools(messages[-1])
        if calls_tools and isinstance(result, CallToolsNode):
            self._write(self.unwritten(messages), len(messages))
        elif calls_tools and isinstance(result, ModelRequestNode):
            self._pending = [*self.unwritten(messages), result.request]
            self._flush_later()

    def replayed_result(self, call: ToolCallPart) -> tuple[bool, Any]:
        """``(True, result)`` if ``call`` returned in an earlier try (its result is handed back
        once, the call does not run again); ``(False, None)`` otherwise."""
        if call.tool_call_id not in self._replay:
            return False, None
        return True, self._replay.pop(call.tool_call_id)

    def tool_returned(self, messages: Sequence[ModelMessage], call: ToolCallPart, result: Any) -> None:
        """A tool call returned: if siblings of its model response may still be running, append
        its result now (on the run's loop). A lone call's result is appended with its step.

        A result that is a ``ToolReturn`` or does not convert to JSON is not appended: the call
        runs again if the try stops before its step completes.
        """
        if (
            self._appender.off is not None
            or _calls_beside(messages, call) == 0
            or isinstance(result, ToolReturn)
        ):
            return
        try:
            value = to_jsonable_python(result)
        except Exception:
            return
        entry = {
            "kind": "tool_result",
            "tool_call_id": call.tool_call_id,
            "tool": call.tool_name,
            "result": value,
        }
        try:
            self._appender.append(entry, land=False, owned=True)
        except Exception as exc:
            self._appender.turn_off(f"appending a tool result failed ({exc!r}); later steps are not recorded")

    def stop_flush(self) -> None:
        """No flush of the pending returns is due (a step came, or the run ended)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _write(self, new: list[ModelMessage], written: int) -> None:
        if not new:  # a resumed response whose tools run again: already in the record
            return
        try:
            entry = {"kind": "step", "messages": dump_messages(new)}
            self._appender.append(entry, land=self._write_ahead, owned=True, timed=True)
        except Exception as exc:
            self._appender.turn_off(f"appending a step failed ({exc!r}); later steps are not recorded")
            return
        self.all_written(written)

    def _flush_later(self) -> None:
        """Append the pending tool returns ``returns_flush_s`` from now unless the response comes
        first (on the run's loop, so the store is called from the thread that runs the steps)."""
        if self._returns_flush_s <= 0:
            self._flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without a loop: nothing can wait
            self._flush()
            return
        self._flush_timer = loop.call_later(self._returns_flush_s, self._flush)

    def _flush(self) -> None:
        self._flush_timer = None
        if self._appender.off is None and self._pending:
            self._write(self._pending, self._written + len(self._pending))


def _calls_tools(message: ModelMessage) -> bool:
    """``message`` is a model response that calls tools (they run next)."""
    return isinstance(message, ModelResponse) and any(isinstance(p, ToolCallPart) for p in message.parts)


def _calls_beside(messages: Sequence[ModelMessage], call: ToolCallPart) -> int:
    """How many other tool calls the model response that made ``call`` holds."""
    for message in reversed(messages):
        if isinstance(message, ModelResponse):
            ids = [p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)]
            if call.tool_call_id in ids:
                return len(ids) - 1
    return 0
