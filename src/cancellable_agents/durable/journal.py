"""The continuity record of one agent run across the tries of its task (``durable=True``).

The record lives in a key-value store that survives the task's retries (Airflow 3.3's task state
store, or files under an ``ObjectStoragePath``). It is written while the run goes, never at kill
time (a SIGKILL leaves no time): after every graph step the messages that step completed (the
model's response; the tool returns) are appended as one entry each, before the next step starts.
An entry holds one message, so the cost of a step does not grow with the history. Of a model
response with several tool calls (parallel calls), each call's result is also appended as it
arrives, while its siblings still run: a kill then reruns only the calls that had not returned.

Layout (``<p>`` = ``cancellable_agents.durable.<run>``, one per ``run_agent_sync`` call of a task):

- ``<p>``: the header, written once per try: format, fingerprint of the run's inputs (prompt,
  system prompt, instructions, model, tool names), a generation id, the owning try (number and a
  token that fences older tries off), and the usage of every earlier try.
- ``<p>.<generation>.<i>``: entry ``i``: a message (``kind: message``), one parallel call's result
  (``kind: tool_result``), or how a try ended (``kind: end``: cause, what the user did, usage), its
  try number, and a hash chained over the previous entry, so an edited, missing or reordered
  entry is detected.

The next try resumes from the record when the previous one was evicted, timed out, ended for an
unknown reason, or died without a word; a user's stop (Clear) starts fresh unless
``resume_after_clear``. Any doubt about the record (another task's, incomplete, unparsable,
edited) starts fresh with one warning: a partial transcript is never fed to the model silently.

Airflow-free: the store is anything with ``get``/``set``/``delete`` of JSON values.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic_ai.agent import ModelRequestNode
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturn,
)
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation

log = logging.getLogger(__name__)

#: Bumped when the layout changes; a record of another format is not used (fresh start).
FORMAT = 1
KEY_PREFIX = "cancellable_agents.durable"
#: An older try whose last entry is younger than this and that wrote no end may still be alive.
LIVE_WINDOW_S = 30.0
#: Told to a resumed run whose toolsets include a sandbox: the workspace did not survive the try.
SANDBOX_NOTE = (
    "This run was resumed after the task's previous try was stopped (try {previous} -> try {current}). "
    "The sandbox workspace of the previous try is gone: files written there no longer exist; "
    "recreate what you still need."
)


class Store(Protocol):
    """A key-value store of JSON values that survives the task's retries."""

    def get(self, key: str) -> Any:
        """The value, or ``None`` if the key does not exist."""

    def set(self, key: str, value: Any) -> None: ...

    def delete(self, key: str) -> None:
        """Remove the key; no error if it does not exist."""


class RecordProblem(Exception):
    """Why a record cannot be used (the one warning names it)."""


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


_resume: contextvars.ContextVar[ResumeInfo | None] = contextvars.ContextVar(
    "cancellable_agents_resume", default=None
)


def current_resume() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the durable run this code belongs to, or ``None`` (a fresh run,
    a run without ``durable=True``, or outside any run). Usable from async and sync tools."""
    return _resume.get()


@dataclass
class TryUsage:
    """What one try spent, as recorded (model responses received; tokens as the model reported)."""

    try_number: int
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "try": self.try_number,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "tool_calls": self.tool_calls,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TryUsage:
        return cls(
            int(data["try"]),
            int(data.get("requests", 0)),
            int(data.get("input_tokens", 0)),
            int(data.get("output_tokens", 0)),
            int(data.get("tool_calls", 0)),
        )

    @classmethod
    def of_run(cls, try_number: int, usage: Any) -> TryUsage:
        if callable(usage) and not isinstance(usage, RunUsage):  # older pydantic-ai: ``result.usage()``
            usage = usage()
        return cls(
            try_number,
            int(getattr(usage, "requests", 0) or 0),
            int(getattr(usage, "input_tokens", 0) or 0),
            int(getattr(usage, "output_tokens", 0) or 0),
            int(getattr(usage, "tool_calls", 0) or 0),
        )


def total_usage(tries: Iterable[TryUsage]) -> dict[str, int]:
    """The sum of ``tries`` (``try`` dropped)."""
    total = {"requests": 0, "input_tokens": 0, "output_tokens": 0, "tool_calls": 0}
    for item in tries:
        for name in total:
            total[name] += getattr(item, name)
    return total


# -- fingerprint -----------------------------------------------------------------------------


def fingerprint(agent: Any, user_prompt: Any, run_kwargs: dict[str, Any]) -> str:
    """A hash of what makes a run this run: prompt, history given, system prompt, instructions,
    model and tool names. Dynamic (function) system prompts count by name, not by what they say."""
    facts = {
        "prompt": _jsonable(user_prompt),
        "history": len(run_kwargs.get("message_history") or ()),
        "system_prompt": [str(p) for p in getattr(agent, "_system_prompts", ())],
        "dynamic_system_prompt": [_name(f) for f in getattr(agent, "_system_prompt_functions", ())],
        "instructions": [_jsonable(getattr(i, "instruction", i)) for i in getattr(agent, "_instructions", ())]
        + [_jsonable(run_kwargs.get("instructions"))],
        "model": model_name(run_kwargs.get("model") or getattr(agent, "model", None)),
        "tools": sorted(tool_names([*getattr(agent, "toolsets", ()), *(run_kwargs.get("toolsets") or ())])),
    }
    return hashlib.sha256(_canonical(facts).encode()).hexdigest()[:32]


def model_name(model: Any) -> str:
    if model is None or isinstance(model, str):
        return str(model)
    return f"{getattr(model, 'system', '')}:{getattr(model, 'model_name', type(model).__name__)}"


def tool_names(toolsets: Iterable[Any]) -> list[str]:
    """Names of the tools of ``toolsets`` (function toolsets by tool, others by label), walking
    wrapper and combined toolsets."""
    names: list[str] = []
    for toolset in toolsets:
        names.extend(_toolset_names(toolset))
    return names


def has_sandbox(toolsets: Iterable[Any]) -> bool:
    from cancellable_agents.toolsets.sandbox import SandboxToolset

    return any(isinstance(t, SandboxToolset) for t in _walk(toolsets))


def _toolset_names(toolset: Any) -> list[str]:
    names: list[str] = []
    for item in _walk([toolset]):
        tools = getattr(item, "tools", None)
        if isinstance(tools, dict):
            names.extend(str(name) for name in tools)
        elif not hasattr(item, "wrapped") and not hasattr(item, "toolsets"):
            names.append(f"toolset:{getattr(item, 'label', type(item).__name__)}")
    return names


def _walk(toolsets: Iterable[Any]) -> Iterable[Any]:
    for toolset in toolsets:
        yield toolset
        wrapped = getattr(toolset, "wrapped", None)
        if wrapped is not None:
            yield from _walk([wrapped])
        inner = getattr(toolset, "toolsets", None)
        if isinstance(inner, (list, tuple)):
            yield from _walk(inner)


def _name(fn: Any) -> str:
    fn = getattr(fn, "function", fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _chain(prev: str, body: dict[str, Any]) -> str:
    return hashlib.sha256((prev + _canonical(body)).encode()).hexdigest()[:32]


def _dump(message: ModelMessage) -> Any:
    return ModelMessagesTypeAdapter.dump_python([message], mode="json")[0]


# -- reading a record ------------------------------------------------------------------------


@dataclass
class _Loaded:
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


def _load(store: Store, key: str, fp: str) -> _Loaded | None:
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
            "it belongs to a different run (the prompt, system prompt, model or tools changed)"
        )
    entries = _read_entries(store, f"{key}.{gen}")
    last = entries[-1]["h"] if entries else ""
    messages = _parse_messages([e for e in entries if e["kind"] == "message"])
    return _Loaded(header, entries, messages, last)


def _read_entries(store: Store, base: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    prev = ""
    while (entry := store.get(f"{base}.{len(entries)}")) is not None:
        i = len(entries)
        if not isinstance(entry, dict) or "h" not in entry:
            raise RecordProblem(f"step {i} does not parse")
        body = {k: v for k, v in entry.items() if k != "h"}
        if body.get("i") != i or body.get("prev") != prev or _chain(prev, body) != entry["h"]:
            raise RecordProblem(f"step {i} does not match its checksum (edited, reordered or corrupted)")
        if body.get("kind") not in ("message", "tool_result", "end") or not isinstance(body.get("try"), int):
            raise RecordProblem(f"step {i} does not parse")
        entries.append(entry)
        prev = entry["h"]
    if store.get(f"{base}.{len(entries) + 1}") is not None:
        raise RecordProblem(f"step {len(entries)} is missing")
    return entries


def _parse_messages(entries: Sequence[dict[str, Any]]) -> list[ModelMessage]:
    try:
        messages = ModelMessagesTypeAdapter.validate_python([e["message"] for e in entries])
    except Exception as exc:
        raise RecordProblem(f"its messages do not parse ({type(exc).__name__})") from exc
    for i, message in enumerate(messages):
        expected = ModelRequest if i % 2 == 0 else ModelResponse
        if not isinstance(message, expected):
            raise RecordProblem(f"message {i} is a {type(message).__name__}, expected a {expected.__name__}")
    return messages


# -- the journal -----------------------------------------------------------------------------


@dataclass
class Journal:
    """One run's continuity record in one try: resume from it, append to it, end it.

    Used from the run's main thread only (the store may not be called from a signal handler):
    :meth:`attach` before the run, :meth:`step` after each graph step (by the capability it
    adds), :meth:`cancelled` then :meth:`write_end`, or :meth:`completed`, after the run. A
    store error disables the journal for the rest of the run with one warning; the run itself
    goes on.

    :param try_number: this try (Airflow's ``ti.try_number``); written into every entry.
    :param resume_after_clear: resume also after a user's stop (Clear); default: fresh start.
    :param usage_spans_tries: the run's ``usage_limits`` also count earlier tries' usage.
    :param clear_count: how often the task's run was cleared by a user so far (Airflow's
        ``dag_run.clear_number``); a try cleared away cannot write its end, so a count that grew
        since the previous try began means that try was cleared.
    """

    store: Store
    try_number: int
    run_key: str = "0"
    resume_after_clear: bool = False
    usage_spans_tries: bool = False
    scope: TaskCancellation | None = None
    clear_count: int | None = None
    clock: Any = time.time
    resume: ResumeInfo | None = None
    earlier: list[TryUsage] = field(default_factory=list)
    # Run state (main thread only).
    _token: str = field(default_factory=lambda: uuid.uuid4().hex)
    _generation: str = ""
    _seq: int = 0
    _prev: str = ""
    _written: int = 0
    _off: str | None = None
    _resume_token: contextvars.Token[ResumeInfo | None] | None = None
    _end: dict[str, Any] | None = None
    #: Results of the resumed response's calls that had returned, by tool call id; each is
    #: handed back once, instead of running the call (the run's loop only).
    _replay: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}.{self.run_key}"

    # -- before the run ----------------------------------------------------------------------

    def attach(self, agent: Any, user_prompt: Any, run_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Take over the record; return the prompt and run kwargs that resume it (or start fresh).

        Adds the capability that appends each step. Raises nothing for a bad record (fresh
        start, one warning); a store that fails here disables the journal (one warning).
        """
        run_kwargs = dict(run_kwargs)
        given_history = list(run_kwargs.get("message_history") or ())
        fp = fingerprint(agent, user_prompt, run_kwargs)
        try:
            loaded = self._usable(_load_or_problem(self.store, self.key, fp))
            self._take_over(fp, loaded)
            if loaded is None:
                for message in given_history:
                    self._append({"kind": "message", "message": _dump(message)})
                self._written = len(given_history)
        except Exception as exc:
            self._disable(f"the record could not be read or written ({exc!r})")
            return user_prompt, run_kwargs
        run_kwargs["capabilities"] = [*(run_kwargs.get("capabilities") or ()), JournalCapability(self)]
        if loaded is not None and self.resume is not None:
            user_prompt = None
            run_kwargs["message_history"] = loaded.messages
            self._written = len(loaded.messages)
            if has_sandbox([*getattr(agent, "toolsets", ()), *(run_kwargs.get("toolsets") or ())]):
                note = SANDBOX_NOTE.format(previous=self.resume.from_try, current=self.try_number)
                run_kwargs["instructions"] = _with_note(run_kwargs.get("instructions"), note)
        if self.usage_spans_tries and self.earlier:
            run_kwargs["usage"] = _add_usage(run_kwargs.get("usage"), self.earlier)
        self._resume_token = _resume.set(self.resume)
        self._attach_facts()
        return user_prompt, run_kwargs

    def _usable(self, loaded: _Loaded | None) -> _Loaded | None:
        """Decide whether this try continues ``loaded``; log why not (``None``: fresh start)."""
        if loaded is None:
            return None
        previous = loaded.owner_try
        end = loaded.end_of(previous)
        stopped_by_user = self._stopped_by_user(loaded, end)
        if stopped_by_user and not self.resume_after_clear:
            log.info(
                "durable: try %s was stopped by a user (%s); starting fresh (resume_after_clear=True "
                "would resume)",
                previous,
                stopped_by_user,
            )
            return None
        if not loaded.messages:
            return None
        if end is None and previous != self.try_number:
            self._warn_if_alive(loaded, previous)
        calls: frozenset[str] = frozenset()
        last = loaded.messages[-1]
        if isinstance(last, ModelResponse):
            calls = frozenset(p.tool_call_id for p in last.parts if isinstance(p, ToolCallPart))
        self._replay = loaded.returned_in_flight()
        replayed = frozenset(self._replay)
        self.resume = ResumeInfo(self.try_number, previous, len(loaded.messages), calls - replayed, replayed)
        log.warning(
            "durable: resuming from try %s (%s): %d messages restored, %d tool call(s) in flight run again%s",
            previous,
            f"ended {end.get('cause')}" if end else "died without a word",
            len(loaded.messages),
            len(calls - replayed),
            f", {len(replayed)} that had returned get their recorded result" if replayed else "",
        )
        return loaded

    def _stopped_by_user(self, loaded: _Loaded, end: dict[str, Any] | None) -> str:
        """What the user did to the previous try, if anything: its end entry says so, or (a cleared
        try can no longer write: its task instance is gone) the clear count grew since it began."""
        if end is not None and end.get("cause") == CancelCause.USER.value:
            return str(end.get("action") or "user")
        before = loaded.header["owner"].get("clears")
        if self.clear_count is not None and isinstance(before, int) and self.clear_count > before:
            return f"cleared: the DAG run's clear count went from {before} to {self.clear_count}"
        return ""

    def _warn_if_alive(self, loaded: _Loaded, previous: int) -> None:
        age = self.clock() - float(loaded.entries[-1].get("at", 0.0)) if loaded.entries else None
        if age is not None and age < LIVE_WINDOW_S:
            log.warning(
                "durable: try %s wrote no end and its last step is %.0f s old: it may still be running. "
                "It is fenced off: its further appends are refused, and it cancels itself when it tries.",
                previous,
                age,
            )

    def _take_over(self, fp: str, loaded: _Loaded | None) -> None:
        """Write this try's header: from now on older tries' appends are refused."""
        if loaded is None:
            old = self.store.get(self.key)
            self._generation = uuid.uuid4().hex[:12]
            self._write_header(fp)
            if isinstance(old, dict) and "generation" in old:
                self._drop_entries(f"{self.key}.{old['generation']}")
            return
        self.earlier = [t for t in loaded.tries() if t.try_number != self.try_number]
        self._generation = str(loaded.header["generation"])
        self._seq = len(loaded.entries)
        self._prev = loaded.last_hash
        self._write_header(fp)

    def _write_header(self, fp: str) -> None:
        header = {
            "format": FORMAT,
            "fingerprint": fp,
            "generation": self._generation,
            "owner": {
                "try": self.try_number,
                "token": self._token,
                "at": self.clock(),
                "clears": self.clear_count,
            },
            "tries": [t.as_dict() for t in self.earlier],
        }
        self.store.set(self.key, header)

    # -- while the run goes ------------------------------------------------------------------

    def step(self, messages: Sequence[ModelMessage], result: Any) -> None:
        """After a graph step: append the messages it completed (called on the run's loop).

        A step that leads to a model request has its request (the tool returns) in the next
        node, not yet in ``messages``: it is appended now, before that request goes out.
        """
        if self._off is not None:
            return
        new = list(messages[self._written :])
        pending = isinstance(result, ModelRequestNode) and (
            not messages or isinstance(messages[-1], ModelResponse)
        )
        if pending:
            new.append(result.request)
        if not new:
            return
        try:
            if not self._still_owner():
                return
            for message in new:
                self._append({"kind": "message", "message": _dump(message)})
        except Exception as exc:
            self._disable(f"appending a step failed ({exc!r}); later steps are not recorded")
            return
        self._written = len(messages) + (1 if pending else 0)

    def replayed_result(self, call: ToolCallPart) -> tuple[bool, Any]:
        """``(True, result)`` if ``call`` returned in an earlier try (its result is handed back
        once, the call does not run again); ``(False, None)`` otherwise."""
        if call.tool_call_id not in self._replay:
            return False, None
        return True, self._replay.pop(call.tool_call_id)

    def tool_returned(self, messages: Sequence[ModelMessage], call: ToolCallPart, result: Any) -> None:
        """A tool call returned: if siblings of its model response may still be running, append
        its result now (called on the run's loop). A lone call's result is appended with its step.

        A result that is a ``ToolReturn`` or does not convert to JSON is not appended: the call
        runs again if the try stops before its step completes.
        """
        if self._off is not None or _calls_beside(messages, call) == 0 or isinstance(result, ToolReturn):
            return
        try:
            value = to_jsonable_python(result)
        except Exception:
            return
        try:
            if self._still_owner():
                self._append(
                    {
                        "kind": "tool_result",
                        "tool_call_id": call.tool_call_id,
                        "tool": call.tool_name,
                        "result": value,
                    }
                )
        except Exception as exc:
            self._disable(f"appending a tool result failed ({exc!r}); later steps are not recorded")

    def _still_owner(self) -> bool:
        """Fencing: the header must still name this try's token, checked before every append."""
        header = self.store.get(self.key)
        owner = header.get("owner", {}) if isinstance(header, dict) else {}
        if owner.get("token") == self._token:
            return True
        if header is None:
            self._disable("the record was deleted while the run went on; later steps are not recorded")
            return False
        newer = owner.get("try")
        self._off = "superseded"
        log.error(
            "durable: try %s is not the newest: try %s owns the record now, so this try's appends are "
            "refused and it cancels itself (two copies of one task were running)",
            self.try_number,
            newer,
        )
        if self.scope is not None:
            self.scope.cancel(CancelCause.EVICTION, detail=f"superseded by try {newer} of the same task")
        return False

    def _append(self, body: dict[str, Any]) -> None:
        body = {
            **body,
            "i": self._seq,
            "try": self.try_number,
            "at": round(self.clock(), 3),
            "prev": self._prev,
        }
        digest = _chain(self._prev, body)
        self.store.set(f"{self.key}.{self._generation}.{self._seq}", {**body, "h": digest})
        self._seq += 1
        self._prev = digest

    # -- after the run -----------------------------------------------------------------------

    def cancelled(self, exc: Any) -> None:
        """The run unwound cancelled (main thread, after the unwind): its usage into the kill
        record's facts, its cause and usage kept for :meth:`write_end`. Touches no store: the
        kill record is logged right after this and must not wait for one."""
        usage = self._this_try(getattr(exc, "usage", None))
        self._attach_facts(usage)
        self._reset_resume()
        cause = getattr(exc, "cause", None)
        action = getattr(exc, "action", None)
        self._end = {
            "kind": "end",
            "state": "cancelled",
            "cause": cause.value if cause is not None else None,
            "action": action.value if action is not None else None,
            "usage": usage.as_dict(),
        }

    def write_end(self) -> None:
        """Append the end :meth:`cancelled` noted, once the kill record is in the task log: a
        fencing read and a write, which through Airflow's task state store are API calls that a
        busy API server answers seconds later (measured 3.7 s under load, 5 s when it stalls on
        SQLite), and the task is SIGKILLed 5 s after the SIGTERM."""
        end, self._end = self._end, None
        if end is None or self._off is not None:
            return
        try:
            if self._still_owner():
                self._append(end)
        except Exception as exc_:
            self._disable(f"appending the end failed ({exc_!r})")

    def completed(self, result: Any) -> None:
        """The run completed: the record is deleted (a later try of the task starts fresh)."""
        usage = self._this_try(getattr(result, "usage", None))
        self._attach_facts(usage)
        self._reset_resume()
        facts = self._facts(usage)
        log.info(
            "durable: run completed; usage this try %s, all tries %s",
            facts["usage_this_try"],
            facts["usage_total"],
        )
        if self._off is not None:
            return
        try:
            if self._still_owner():
                self.store.delete(self.key)
                self._drop_entries(f"{self.key}.{self._generation}", self._seq)
        except Exception as exc:
            log.warning("durable: could not delete the record of a completed run: %r", exc)

    def _this_try(self, usage: Any) -> TryUsage:
        this_try = TryUsage.of_run(self.try_number, usage)
        if self.usage_spans_tries and self.earlier:  # the run started from the earlier tries' usage
            this_try = _minus(this_try, self.earlier)
        return this_try

    def detach(self) -> None:
        """The run ended any other way (an ordinary failure): keep the record, forget the resume."""
        self._reset_resume()

    def _drop_entries(self, base: str, count: int | None = None) -> None:
        i = 0
        while (count is None and self.store.get(f"{base}.{i}") is not None) or (
            count is not None and i < count
        ):
            self.store.delete(f"{base}.{i}")
            i += 1

    def _reset_resume(self) -> None:
        if self._resume_token is not None:
            with contextlib.suppress(ValueError):  # reset from another context: leave it
                _resume.reset(self._resume_token)
            self._resume_token = None

    def _disable(self, why: str) -> None:
        if self._off is None:
            self._off = why
            log.warning("durable: %s; the run goes on without its continuity record", why)

    def _facts(self, this_try: TryUsage | None = None) -> dict[str, Any]:
        tries = [*self.earlier, *([this_try] if this_try else [])]
        return {
            "try": self.try_number,
            "resumed_from_try": self.resume.from_try if self.resume else None,
            "messages_restored": self.resume.messages if self.resume else 0,
            "tool_calls_rerun": sorted(self.resume.rerun_tool_calls) if self.resume else [],
            "usage_earlier_tries": [t.as_dict() for t in self.earlier],
            "usage_this_try": this_try.as_dict() if this_try else None,
            "usage_total": total_usage(tries),
            "recording": self._off is None,
        }

    def _attach_facts(self, this_try: TryUsage | None = None) -> None:
        if self.scope is not None:
            self.scope.attach(durable=self._facts(this_try))


def _calls_beside(messages: Sequence[ModelMessage], call: ToolCallPart) -> int:
    """How many other tool calls the model response that made ``call`` holds."""
    for message in reversed(messages):
        if isinstance(message, ModelResponse):
            ids = [p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)]
            if call.tool_call_id in ids:
                return len(ids) - 1
    return 0


def _load_or_problem(store: Store, key: str, fp: str) -> _Loaded | None:
    """:func:`_load`, failing closed: a bad record is a fresh start with one warning naming why."""
    try:
        return _load(store, key, fp)
    except RecordProblem as problem:
        log.warning("durable: not resuming from the stored record: %s; starting fresh", problem)
        return None


def _with_note(instructions: Any, note: str) -> Any:
    if instructions is None:
        return note
    if isinstance(instructions, str):
        return f"{instructions}\n\n{note}"
    if isinstance(instructions, (list, tuple)):
        return [*instructions, note]
    return [instructions, note]


def _add_usage(usage: RunUsage | None, tries: Iterable[TryUsage]) -> RunUsage:
    total = total_usage(tries)
    base = usage or RunUsage()
    return RunUsage(
        requests=base.requests + total["requests"],
        input_tokens=base.input_tokens + total["input_tokens"],
        output_tokens=base.output_tokens + total["output_tokens"],
        tool_calls=base.tool_calls + total["tool_calls"],
    )


def _minus(usage: TryUsage, tries: Iterable[TryUsage]) -> TryUsage:
    total = total_usage(tries)
    return TryUsage(
        usage.try_number,
        max(0, usage.requests - total["requests"]),
        max(0, usage.input_tokens - total["input_tokens"]),
        max(0, usage.output_tokens - total["output_tokens"]),
        max(0, usage.tool_calls - total["tool_calls"]),
    )


class JournalCapability(AbstractCapability[Any]):
    """Appends each completed step to the journal (added to a run only when it is durable).

    ``after_node_run`` fires after every graph node however the run is driven (``run_sync``,
    with or without ``event_stream_handler``), and never for a node a cancel interrupted: a
    step is recorded only once it completed.
    """

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    async def after_node_run(self, ctx: Any, *, node: Any, result: Any) -> Any:
        self._journal.step(ctx.messages, result)
        return result

    async def wrap_tool_execute(
        self, ctx: Any, *, call: ToolCallPart, tool_def: Any, args: Any, handler: Any
    ) -> Any:
        """A call that returned in an earlier try gets its recorded result; any other runs, and a
        parallel call's result is appended as soon as it returns."""
        replayed, result = self._journal.replayed_result(call)
        if replayed:
            return result
        result = await handler(args)
        self._journal.tool_returned(ctx.messages, call, result)
        return result
