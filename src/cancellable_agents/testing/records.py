"""What the scripted test model server saw: one record per chat-completions request.

Kept in a [`RecordLog`][] that tests wait on (``wait_for``) and that the server serves as JSON
(``GET /_records``), so a parent process can assert on a server it spawned.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cancellable_agents.testing.scripts import step_key

_T = TypeVar("_T")

Outcome = Literal["completed", "disconnected", "error"]


@dataclass
class RequestRecord:
    """One chat-completions request as the server saw it.

    ``outcome`` is ``None`` while the request is in flight, then ``"completed"`` (the whole answer was
    written), ``"disconnected"`` (the client went away first; ``disconnected_at`` is when that was
    noticed) or ``"error"`` (bad request or server failure; see ``error``). ``tokens_sent`` counts text
    tokens (streamed chunks) or tool calls actually written to the client. Times are ``time.monotonic()``.
    """

    index: int
    model: str
    stream: bool
    messages: list[dict[str, Any]]
    started_at: float
    ended_at: float | None = None
    outcome: Outcome | None = None
    disconnected_at: float | None = None
    tokens_sent: int = 0
    error: str | None = None
    #: The names of the tools the request offered (function and output tools alike).
    tools: list[str] = dataclasses.field(default_factory=list)
    #: The wire protocol it came in (``openai-chat``, ``bedrock-converse``, ...: `wire_protocols`).
    protocol: str = "openai-chat"

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of all fields (what ``GET /_records`` returns per record)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """Rebuild a record from `to_json` output."""
        return cls(**data)


class RecordLog:
    """Thread-safe store of `RequestRecord` objects with condition-based waits.

    Records are only mutated under the lock; readers get copies, so they always see consistent values.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._records: list[RequestRecord] = []

    def open(
        self,
        model: str,
        stream: bool,
        messages: list[dict[str, Any]],
        tools: list[str] | None = None,
        protocol: str = "openai-chat",
    ) -> RequestRecord:
        with self._cond:
            record = RequestRecord(
                len(self._records),
                model,
                stream,
                messages,
                time.monotonic(),
                tools=tools or [],
                protocol=protocol,
            )
            self._records.append(record)
            self._cond.notify_all()
            return record

    def repeats(self, record: RequestRecord) -> bool:
        """Whether an earlier request was the same conversation at the same step (see ``stall_at``)."""
        key = step_key(record.model, record.messages)
        with self._cond:
            earlier = itertools.takewhile(lambda r: r is not record, self._records)
            return any(step_key(r.model, r.messages) == key for r in earlier)

    def add_tokens(self, record: RequestRecord, count: int) -> None:
        with self._cond:
            record.tokens_sent += count
            self._cond.notify_all()

    def close(
        self, record: RequestRecord, outcome: Outcome, *, at: float | None = None, error: str | None = None
    ) -> None:
        with self._cond:
            record.ended_at = at if at is not None else time.monotonic()
            record.outcome = outcome
            record.error = error
            if outcome == "disconnected":
                record.disconnected_at = record.ended_at
            self._cond.notify_all()

    def snapshot(self) -> list[RequestRecord]:
        with self._cond:
            return [dataclasses.replace(record) for record in self._records]

    def count(self) -> int:
        with self._cond:
            return len(self._records)

    def clear(self) -> int:
        with self._cond:
            cleared = len(self._records)
            self._records = []
            return cleared

    def wait_for(self, predicate: Callable[[list[RequestRecord]], _T | None], timeout: float) -> _T | None:
        """Block until ``predicate(records)`` is truthy or ``timeout`` passes; return its last value."""
        with self._cond:
            result = self._cond.wait_for(lambda: predicate(self._records), timeout)
            return dataclasses.replace(result) if isinstance(result, RequestRecord) else result


def first_record(records: list[RequestRecord], test: Callable[[RequestRecord], bool]) -> RequestRecord | None:
    return next((record for record in records if test(record)), None)
