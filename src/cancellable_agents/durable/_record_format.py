"""The record's format and its checks: how entries are chained, and how a stored record is read
back, refusing anything that is not exactly what a try wrote.

Layout (``<p>`` = ``cancellable_agents.durable.<run>``, one per ``run_agent_sync`` call of a task):
each try writes only keys of its own, ``<p>.try<N>.<j>`` (its segment). A key holds the entries
one store call wrote: entry ``j`` of the segment alone (a JSON object, as format 2 wrote every
entry), or entries ``j, j+1, ...`` (a JSON list: those that queued while the previous call was in
flight), and the segment's next key is the index after them. The entries are:

- a graph step's messages (``kind: step``: the model response that calls tools, with the request
  before it that no earlier entry holds), one parallel call's result (``kind: tool_result``), or
  how a try ended (``kind: end``: cancelled, with cause, what the user did, usage and the tool
  returns not yet written; completed; or ``awaiting_approval``: the run stopped until a reviewer
  answers its ``request``, which a later ``kind: answer`` entry holds the decisions for — the
  same try continues its own segment after that pause);
- each with its try, its index ``i`` in the whole record and a hash chained over the previous
  entry (across segments), so an edited, missing or reordered entry is detected;
- the segment's first entry also holds the head: format, fingerprint of the run's inputs
  (prompt, system prompt, instructions, model, tool names), the DAG run's clear count, the usage
  of every earlier try, and ``base``: the earlier segments this try continues, each up to the
  entry count it read (``[[try, count], ...]``).

The next try reads back from the newest earlier try that wrote anything and follows its
``base``: a segment is read only up to the count frozen there, so what an older try still alive
writes later (under its own keys) is never part of what a newer try resumes from. That is the
fencing, and it needs no read before a write.
"""

from __future__ import annotations

import hashlib
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

from cancellable_agents.durable._fingerprint import canonical
from cancellable_agents.durable._pauses import ApprovalRequest, Decision
from cancellable_agents.durable._reasons import FreshStart
from cancellable_agents.durable._stores import Store
from cancellable_agents.durable._try_usage import TryUsage

#: Bumped when the layout changes; a record of another format is not used (fresh start, one
#: warning). Format 1 (one header key ``<p>``, one entry per message) is refused that way.
#: Format 3 may hold several entries under one key; format 2 (one entry per key) reads the same.
FORMAT = 3
#: The formats this version reads (a record an older version wrote resumes after an upgrade).
READABLE_FORMATS = (2, 3)
KEY_PREFIX = "cancellable_agents.durable"
#: The kinds of entry; any other does not parse.
ENTRY_KINDS = ("step", "tool_result", "end", "answer")
#: The state of an end entry that stops the run until a reviewer answers (not an end of the run).
AWAITING = "awaiting_approval"
#: The states of an end entry after which the run is over: it completed, or it answered at its
#: wind-down (``cancellable_agents.core.wind_down``); the next try starts fresh.
ENDED_STATES = ("completed", "wound_down")


class RecordProblem(Exception):
    """Why a record cannot be used (the one warning names it; ``reason`` classifies it)."""

    def __init__(self, message: str, reason: FreshStart = FreshStart.TAMPERED) -> None:
        super().__init__(message)
        self.reason = reason


def chain(prev: str, body: dict[str, Any]) -> str:
    """The hash of an entry ``body`` chained over the previous entry's hash ``prev``."""
    return hashlib.sha256((prev + canonical(body)).encode()).hexdigest()[:32]


def dump_messages(messages: Sequence[ModelMessage]) -> list[Any]:
    """Messages as the JSON values an entry holds."""
    return ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")


def segment_key(record_key: str, try_number: int, j: int) -> str:
    """The key of entry ``j`` of try ``try_number``'s segment of the record ``record_key``."""
    return f"{record_key}.try{try_number}.{j}"


def segment_try(record_key: str, key: str) -> int | None:
    """The try whose segment ``key`` belongs to (``None``: not a segment key of this record)."""
    rest = key.removeprefix(f"{record_key}.try")
    number = rest.split(".", 1)[0]
    return int(number) if rest != key and number.isdigit() else None


@dataclass
class LoadedRecord:
    """A record that passed every check."""

    #: The head of the owner's segment (format, fingerprint, clears, earlier tries, base).
    head: dict[str, Any]
    #: The newest try that wrote anything: the record is its segment on top of its base.
    owner_try: int
    entries: list[dict[str, Any]]
    #: ``[try, entry count]`` of each segment read, in order (the owner's last).
    segments: list[list[int]]
    messages: list[ModelMessage]
    #: The try that recorded each message (parallel to ``messages``).
    message_tries: list[int]
    last_hash: str

    def end_of(self, try_number: int) -> dict[str, Any] | None:
        ends = [e for e in self.entries if e["kind"] == "end" and e["try"] == try_number]
        return ends[-1] if ends else None

    def tries(self) -> list[TryUsage]:
        """Usage of every try so far: earlier tries from the head, the owner's from its entries."""
        earlier = [TryUsage.from_dict(t) for t in self.head.get("tries", ())]
        owner = self.owner_try
        end = self.end_of(owner)
        if end is not None and isinstance(end.get("usage"), dict):
            return [*earlier, TryUsage.from_dict({**end["usage"], "try": owner})]
        usage = TryUsage(owner)
        for recorded_by, message in zip(self.message_tries, self.messages, strict=True):
            if recorded_by == owner and isinstance(message, ModelResponse):
                usage.requests += 1
                usage.input_tokens += message.usage.input_tokens or 0
                usage.output_tokens += message.usage.output_tokens or 0
                usage.tool_calls += sum(isinstance(p, ToolCallPart) for p in message.parts)
        return [*earlier, usage]

    def approval(self) -> tuple[ApprovalRequest, dict[str, Decision] | None] | None:
        """The approval the run is stopped at: its request and, if an execution already took the
        answers in, the decisions; ``None`` if the record is not stopped at one (none, or the run
        went on after its answer: an entry after it holds messages). An execution killed while
        the approved calls ran leaves the answer without messages after it: the next try runs
        them again with the same decisions (at-least-once, as any call in flight)."""
        at = [i for i, e in enumerate(self.entries) if e["kind"] == "end" and e.get("state") == AWAITING]
        if not at:
            return None
        after = self.entries[at[-1] + 1 :]
        if any(e.get("messages") for e in after):  # the answered calls' returns are recorded
            return None
        request = ApprovalRequest.from_dict(self.entries[at[-1]].get("request") or {})
        answers = [e for e in after if e["kind"] == "answer"]
        if not answers:
            return request, None
        decisions = answers[-1].get("decisions") or {}
        return request, {call_id: Decision.from_dict(d) for call_id, d in decisions.items()}

    def returned_in_flight(self) -> dict[str, Any]:
        """Results recorded for tool calls of the last message (a model response whose step did
        not complete), by tool call id: the siblings that returned before the try stopped."""
        last = self.messages[-1] if self.messages else None
        if not isinstance(last, ModelResponse):
            return {}
        calls = {p.tool_call_id for p in last.parts if isinstance(p, ToolCallPart)}
        after = self.entries[max(i for i, e in enumerate(self.entries) if e.get("messages")) :]
        return {
            e["tool_call_id"]: e["result"]
            for e in after
            if e["kind"] == "tool_result" and e.get("tool_call_id") in calls
        }


def load_record(
    store: Store, key: str, try_number: int, fp: str, *, own: bool = False
) -> LoadedRecord | None:
    """The record under ``key`` as try ``try_number`` finds it, checked; ``None`` if there is none
    (or its run completed). Raises [`RecordProblem`][].

    Reads back from the try before this one to the first that wrote anything; a first try reads
    nothing (no earlier try can have written). ``own``: start at this try's own segment (an
    execution that continues its try after an approval pause). A format-1 record (an older
    version of this package wrote it) is looked for only when no segment was found.
    """
    for earlier in range(try_number if own else try_number - 1, 0, -1):
        first = store.get(segment_key(key, earlier, 0))
        if first is not None:
            return _load_from(store, key, earlier, first, fp)
    if try_number > 1 and store.get(key) is not None:
        raise RecordProblem(
            f"it was written by an older version of this package (not a format-{FORMAT} record)"
        )
    return None


def _load_from(store: Store, key: str, owner: int, first: Any, fp: str) -> LoadedRecord | None:
    head = _head_of(first)
    if head.get("fingerprint") != fp:
        raise RecordProblem(
            "it belongs to a different run (the prompt, system prompt, model or tools changed)",
            FreshStart.FINGERPRINT_CHANGED,
        )
    entries: list[dict[str, Any]] = []
    segments: list[list[int]] = []
    for try_number, count in head["base"]:
        j = 0
        while j < count:
            value = store.get(segment_key(key, try_number, j))
            if value is None:
                raise RecordProblem(f"entry {len(entries)} is missing")
            for entry in entries_of(value)[: count - j]:  # a key holds whole calls: never more
                entries.append(_checked(entry, len(entries), entries, try_number))
                j += 1
        segments.append([try_number, count])
    own = 0
    value = first
    while value is not None:
        for entry in entries_of(value):
            entries.append(_checked(entry, len(entries), entries, owner))
            own += 1
        value = store.get(segment_key(key, owner, own))
    if store.get(segment_key(key, owner, own + 1)) is not None:
        raise RecordProblem(f"entry {len(entries)} is missing")
    segments.append([owner, own])
    last = entries[-1]
    if last["kind"] == "end" and last.get("state") in ENDED_STATES:
        return None
    recorded = [(e["try"], m) for e in entries for m in e.get("messages", ())]
    messages = _parse_messages([m for _, m in recorded])
    return LoadedRecord(head, owner, entries, segments, messages, [t for t, _ in recorded], last["h"])


def entries_of(value: Any) -> list[Any]:
    """The entries one key holds: one (an object) or several (a non-empty list). Raises
    [`RecordProblem`][] for anything else."""
    if isinstance(value, list) and value:
        return value
    if isinstance(value, dict):
        return [value]
    raise RecordProblem("a key of the record does not parse (neither an entry nor a list of them)")


def _head_of(first: Any) -> dict[str, Any]:
    """The head a segment's first entry holds, its shape checked."""
    entry = entries_of(first)[0]
    head = entry.get("head") if isinstance(entry, dict) else None
    if not isinstance(head, dict) or head.get("format") not in READABLE_FORMATS:
        formats = " or ".join(map(str, READABLE_FORMATS))
        raise RecordProblem(f"its first entry holds no head of format {formats}")
    try:
        head["base"] = [[int(t), int(n)] for t, n in head.get("base", ())]
    except (TypeError, ValueError) as exc:
        raise RecordProblem(f"its head does not parse ({exc!r})") from exc
    return head


def _checked(entry: Any, i: int, before: Sequence[dict[str, Any]], try_number: int) -> dict[str, Any]:
    """``entry`` if it is entry ``i`` of the chain after ``before``, written by ``try_number``."""
    if not isinstance(entry, dict) or "h" not in entry:
        raise RecordProblem(f"entry {i} does not parse")
    prev = before[-1]["h"] if before else ""
    body = {k: v for k, v in entry.items() if k != "h"}
    if body.get("i") != i or body.get("prev") != prev or chain(prev, body) != entry["h"]:
        raise RecordProblem(f"entry {i} does not match its checksum (edited, reordered or corrupted)")
    if body.get("kind") not in ENTRY_KINDS or body.get("try") != try_number:
        raise RecordProblem(f"entry {i} does not parse")
    if not isinstance(body.get("messages", []), list):
        raise RecordProblem(f"entry {i} does not parse")
    return entry


def _parse_messages(dumped: Sequence[Any]) -> list[ModelMessage]:
    """The recorded messages, which must alternate request, response, ... as a run writes them
    (two requests in a row where a run continued after an approval: the returns of the calls
    that needed none, then those of the answered ones): anything else is not a transcript to
    feed the model."""
    try:
        messages = ModelMessagesTypeAdapter.validate_python(list(dumped))
    except Exception as exc:
        raise RecordProblem(f"its messages do not parse ({type(exc).__name__})") from exc
    for i, message in enumerate(messages):
        after_response = i > 0 and isinstance(messages[i - 1], ModelResponse)
        expected = ModelRequest if after_response or i == 0 else (ModelRequest, ModelResponse)
        if not isinstance(message, expected):
            raise RecordProblem(f"message {i} is a {type(message).__name__} where a run writes none")
    return messages
