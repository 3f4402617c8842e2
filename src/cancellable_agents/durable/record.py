"""The record's format and its checks: how entries are chained, and how a stored record is read
back, refusing anything that is not exactly what a try wrote.

Layout (``<p>`` = ``cancellable_agents.durable.<run>``, one per ``run_agent_sync`` call of a task):

- ``<p>``: the header, written once per try: format, fingerprint of the run's inputs (prompt,
  system prompt, instructions, model, tool names), a generation id, the owning try (number and a
  token that fences older tries off), and the usage of every earlier try.
- ``<p>.<generation>.<i>``: entry ``i``: a message (``kind: message``), one parallel call's result
  (``kind: tool_result``), or how a try ended (``kind: end``: cause, what the user did, usage), its
  try number, and a hash chained over the previous entry, so an edited, missing or reordered
  entry is detected.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
)

from cancellable_agents.durable.reasons import FreshStart
from cancellable_agents.durable.stores import Store
from cancellable_agents.durable.usage import TryUsage

#: Bumped when the layout changes; a record of another format is not used (fresh start).
FORMAT = 1
KEY_PREFIX = "cancellable_agents.durable"
#: The kinds of entry; any other does not parse.
ENTRY_KINDS = ("message", "tool_result", "end")


class RecordProblem(Exception):
    """Why a record cannot be used (the one warning names it; ``reason`` classifies it)."""

    def __init__(self, message: str, reason: FreshStart = FreshStart.TAMPERED) -> None:
        super().__init__(message)
        self.reason = reason


def canonical(value: Any) -> str:
    """``value`` as JSON in one spelling (sorted keys, no spaces): what gets hashed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def chain(prev: str, body: dict[str, Any]) -> str:
    """The hash of an entry ``body`` chained over the previous entry's hash ``prev``."""
    return hashlib.sha256((prev + canonical(body)).encode()).hexdigest()[:32]


def dump_message(message: ModelMessage) -> Any:
    """One message as the JSON value an entry holds."""
    return ModelMessagesTypeAdapter.dump_python([message], mode="json")[0]


@dataclass
class LoadedRecord:
    """A record that passed every check."""

    header: dict[str, Any]
    entries: list[dict[str, Any]]
    messages: list[ModelMessage]
    last_hash: str

    @property
    def owner_try(self) -> int:
        return int(self.header["owner"]["try"])

    def end_of(self, try_number: int) -> dict[str, Any] | None:
        ends = [e for e in self.entries if e["kind"] == "end" and e["try"] == try_number]
        return ends[-1] if ends else None

    def tries(self) -> list[TryUsage]:
        """Usage of every try so far: earlier tries from the header, the owner's from its entries."""
        earlier = [TryUsage.from_dict(t) for t in self.header.get("tries", ())]
        owner = self.owner_try
        end = self.end_of(owner)
        if end is not None and isinstance(end.get("usage"), dict):
            return [*earlier, TryUsage.from_dict({**end["usage"], "try": owner})]
        usage = TryUsage(owner)
        for entry, message in zip(self._message_entries(), self.messages, strict=True):
            if entry["try"] == owner and isinstance(message, ModelResponse):
                usage.requests += 1
                usage.input_tokens += message.usage.input_tokens or 0
                usage.output_tokens += message.usage.output_tokens or 0
                usage.tool_calls += sum(isinstance(p, ToolCallPart) for p in message.parts)
        return [*earlier, usage]

    def _message_entries(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["kind"] == "message"]

    def returned_in_flight(self) -> dict[str, Any]:
        """Results recorded for tool calls of the last message (a model response whose step did
        not complete), by tool call id: the siblings that returned before the try stopped."""
        last = self.messages[-1] if self.messages else None
        if not isinstance(last, ModelResponse):
            return {}
        calls = {p.tool_call_id for p in last.parts if isinstance(p, ToolCallPart)}
        after = self.entries[max(i for i, e in enumerate(self.entries) if e["kind"] == "message") :]
        return {
            e["tool_call_id"]: e["result"]
            for e in after
            if e["kind"] == "tool_result" and e.get("tool_call_id") in calls
        }


def load_record(store: Store, key: str, fp: str) -> LoadedRecord | None:
    """The record under ``key``, checked; ``None`` if there is none. Raises :class:`RecordProblem`."""
    header = store.get(key)
    if header is None:
        return None
    try:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise RecordProblem(f"its header is not a format-{FORMAT} record header")
        gen = str(header["generation"])
        int(header["owner"]["try"])
        str(header["owner"]["token"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordProblem(f"its header does not parse ({exc!r})") from exc
    if header.get("fingerprint") != fp:
        raise RecordProblem(
            "it belongs to a different run (the prompt, system prompt, model or tools changed)",
            FreshStart.FINGERPRINT_CHANGED,
        )
    entries = _read_entries(store, f"{key}.{gen}")
    last = entries[-1]["h"] if entries else ""
    messages = _parse_messages([e for e in entries if e["kind"] == "message"])
    return LoadedRecord(header, entries, messages, last)


def _read_entries(store: Store, base: str) -> list[dict[str, Any]]:
    """The entries under ``base``, in order, each checked against the chain; an entry found past
    a gap means one is missing (a store that lost a write), not the end of the record."""
    entries: list[dict[str, Any]] = []
    prev = ""
    while (entry := store.get(f"{base}.{len(entries)}")) is not None:
        i = len(entries)
        if not isinstance(entry, dict) or "h" not in entry:
            raise RecordProblem(f"step {i} does not parse")
        body = {k: v for k, v in entry.items() if k != "h"}
        if body.get("i") != i or body.get("prev") != prev or chain(prev, body) != entry["h"]:
            raise RecordProblem(f"step {i} does not match its checksum (edited, reordered or corrupted)")
        if body.get("kind") not in ENTRY_KINDS or not isinstance(body.get("try"), int):
            raise RecordProblem(f"step {i} does not parse")
        entries.append(entry)
        prev = entry["h"]
    if store.get(f"{base}.{len(entries) + 1}") is not None:
        raise RecordProblem(f"step {len(entries)} is missing")
    return entries


def _parse_messages(entries: Sequence[dict[str, Any]]) -> list[ModelMessage]:
    """The messages of the message entries, which must alternate request, response, ... as a
    run writes them: anything else is not a transcript to feed the model."""
    try:
        messages = ModelMessagesTypeAdapter.validate_python([e["message"] for e in entries])
    except Exception as exc:
        raise RecordProblem(f"its messages do not parse ({type(exc).__name__})") from exc
    for i, message in enumerate(messages):
        expected = ModelRequest if i % 2 == 0 else ModelResponse
        if not isinstance(message, expected):
            raise RecordProblem(f"message {i} is a {type(message).__name__}, expected a {expected.__name__}")
    return messages
