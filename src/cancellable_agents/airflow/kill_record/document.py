"""What a killed task writes at the end of its log, so the Airflow UI reads it at a glance.

Three things, in this order: one short human line ([`summary_line`][]), the structured record
([`render_record`][]: cause and outcome first, then the timeline one event per line, so it wraps
in the UI and stays one JSON document after `RECORD_PREFIX`), and the ``TaskCancelled``
whose shown traceback is short ([`hide_unwind_chain`][]). Airflow-free: the Airflow side passes
in what it knows (the retry outlook, the lines Airflow itself will log next) as typed values.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cancellable_agents.core.causes import CancelCause, UserAction

__all__ = [
    "RECORD_PREFIX",
    "SUMMARY_PREFIX",
    "ExpectedLine",
    "KillReport",
    "RetryOutlook",
    "hide_unwind_chain",
    "parse_record",
    "parse_records",
    "render_record",
    "summary_line",
    "unwound_ms",
]

log = logging.getLogger(__name__)

#: Prefix of the structured record in the log; what follows it is one JSON object (parsers:
#: ``tests/e2e/driver.py``, ``cancellable_agents.demo``, ``tests/unit/test_example_dags.py``).
RECORD_PREFIX = "cancellable_agents.record "
#: Prefix of the human line that precedes the record.
SUMMARY_PREFIX = "cancelled: "

#: Keys the record shows first, in this order; the rest follow as the scope wrote them.
_LEADING_KEYS = (
    "cause",
    "detail",
    "outcome",
    "retry",
    "airflow_logs_next",
    "root_cause",
    "cause_source",
    "scope",
)
#: Strings longer than this go last in a list item (see `_short_first`).
_LONG = 40
#: Keys whose list items are put one per line (the rest of the record stays compact).
_LISTED_KEYS = ("airflow_logs_next", "killed", "timeline", "children")


class RetryOutlook(str, enum.Enum):
    """What happens after this try, as far as the task can tell when it writes its record."""

    NOT_RETRYING = "not retrying"
    RETRYING = "retrying"
    NEXT_TRY_STARTS = "the next try starts"
    """Cleared: the server already made the next try, whatever the retry settings say."""
    NO_RETRIES_LEFT = "not retrying (no retries left)"
    UNDECIDED = "retry per the task's settings"


@dataclass(frozen=True)
class ExpectedLine:
    """A line Airflow itself logs after our record on this kill path, and why it is expected."""

    text: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"line": self.text, "why": self.why}


@dataclass(frozen=True)
class KillReport:
    """Everything the end of a killed task's log says: the record plus what Airflow adds."""

    record: Mapping[str, Any]
    """The scope's summary (``TaskCancellation.summary()``), with usage and message count."""
    action: UserAction | None = None
    processes_left: int = 0
    """Processes the unwind signalled that are still running when the record is written."""
    retry: RetryOutlook | None = None
    airflow_logs_next: Sequence[ExpectedLine] = ()

    def full_record(self) -> dict[str, Any]:
        """The record as logged: the leading keys first, then the scope's own."""
        extra: dict[str, Any] = {}
        if self.retry is not None:
            extra["retry"] = self.retry.value
        if self.airflow_logs_next:
            extra["airflow_logs_next"] = [line.as_dict() for line in self.airflow_logs_next]
        if self.processes_left:
            extra["processes_left"] = self.processes_left
        merged = {**self.record, **extra}
        leading = {k: merged[k] for k in _LEADING_KEYS if k in merged}
        return {**leading, **{k: v for k, v in merged.items() if k not in leading}}


def summary_line(report: KillReport) -> str:
    """The one short human line, e.g.
    ``cancelled: user marked it failed · unwound in 9 ms · 3 processes killed, 0 left · not retrying``.
    """
    record = report.record
    parts = [_cause_words(record, report.action)]
    unwound = unwound_ms(record)
    if unwound is not None:
        parts.append(f"unwound in {_ms(unwound)}")
    killed = len(record.get("killed") or ())
    if killed or report.processes_left:
        noun = "process" if killed == 1 else "processes"
        parts.append(f"{killed} {noun} killed, {report.processes_left} left")
    servers = _mcp_servers(record)
    if servers:
        parts.append(f"MCP {'server' if len(servers) == 1 else 'servers'} {', '.join(servers)}")
    stragglers = record.get("stragglers") or ()
    if stragglers:
        parts.append(f"{len(stragglers)} still running after the budget: {', '.join(stragglers)}")
    if report.retry is not None:
        parts.append(report.retry.value)
    if report.airflow_logs_next:
        names = ", ".join(f'"{line.text}"' for line in report.airflow_logs_next)
        parts.append(f"expected from Airflow next: {names} (why: in the record)")
    return SUMMARY_PREFIX + " · ".join(parts)


def _mcp_servers(record: Mapping[str, Any]) -> list[str]:
    """Each MCP stdio server the unwind closed (``mcp_server_closed``, sub-agents' too), as
    ``pid 12 exited in 755 ms`` (on its closed stdin) or ``pid 12 killed in 1.5 s``."""
    found = []
    for event in record.get("timeline") or ():
        if event.get("event") == "mcp_server_closed":
            took = _ms(event.get("took_ms") or 0.0)
            found.append(f"pid {event.get('pid')} {event.get('outcome')} in {took}")
    for child in record.get("children") or ():
        found.extend(_mcp_servers(child))
    return found


def render_record(record: Mapping[str, Any]) -> str:
    """``RECORD_PREFIX`` + the record as one JSON object: its scalars on the first line (cause
    and outcome first), then its lists (expected Airflow lines, kills, timeline) one item per line.

    Still one ``json.loads`` after the prefix; the line breaks only let the UI wrap it.
    """
    return RECORD_PREFIX + "".join(_render(record))


def parse_record(event: str) -> dict[str, Any] | None:
    """The record in a log event written by [`render_record`][] (or one line of a record file),
    or ``None`` if the event is not a record."""
    if not event.startswith(RECORD_PREFIX):
        return None
    records = parse_records(event)
    return records[0] if records else None


def parse_records(text: str) -> list[dict[str, Any]]:
    """Every record in ``text`` (a task log, a process's output), in order.

    The one parser of the record: each is the JSON object after a `RECORD_PREFIX`, on one
    line or rendered over several; a prefix without a whole object after it (a record still
    being written, the prefix quoted in prose) is skipped.
    """
    decoder = json.JSONDecoder()
    records: list[dict[str, Any]] = []
    start = text.find(RECORD_PREFIX)
    while start >= 0:
        body = start + len(RECORD_PREFIX)
        try:
            record, end = decoder.raw_decode(text, body)
        except json.JSONDecodeError:
            end = body
        else:
            if isinstance(record, dict):
                records.append(record)
        start = text.find(RECORD_PREFIX, end)
    return records


def _render(record: Mapping[str, Any]) -> Iterator[str]:
    compact = [(k, v) for k, v in record.items() if not _listed(k, v)]
    listed = [(k, v) for k, v in record.items() if _listed(k, v)]
    yield "{" + ", ".join(f"{_dumps(k)}: {_dumps(v)}" for k, v in compact)
    for i, (key, value) in enumerate(listed):
        yield ("," if compact or i else "") + f"\n  {_dumps(key)}: ["
        yield ",".join(f"\n    {_dumps(_short_first(item))}" for item in value)
        yield "\n  ]"
    yield "}"


def _short_first(item: Any) -> Any:
    """A list item with its long strings (a sandbox's whole command line) moved to the end, so
    what fits the log view's width is the event, its time, the pid and the signal."""
    if not isinstance(item, dict):
        return item
    long = {k: v for k, v in item.items() if isinstance(v, str) and len(v) > _LONG}
    return {**{k: v for k, v in item.items() if k not in long}, **long}


def _listed(key: str, value: Any) -> bool:
    return key in _LISTED_KEYS and isinstance(value, list) and bool(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _cause_words(record: Mapping[str, Any], action: UserAction | None) -> str:
    if action is not None:
        return action.words
    try:
        cause = CancelCause(record.get("cause"))
    except ValueError:
        return "cause not decided"
    words = cause.words
    detail = record.get("detail")
    if cause in (CancelCause.UNKNOWN, CancelCause.TIMEOUT) and detail:
        return f"{words} ({detail})"
    return words


def unwound_ms(record: Mapping[str, Any]) -> float | None:
    """Milliseconds from the kill to the last of the run's unwind and the resources' release,
    or ``None`` when the record has neither (the unwind did not finish). The one reading of
    "how long the unwind took" the summary line, the metrics, the span and the Cancellations
    view share; the view reads stored documents anyone with write access may have edited, so an
    event that is not an object or a time that is not a number counts as 0 ms, never an error."""
    ends = ("run_unwound", "resources_released")
    events = [e for e in record.get("timeline") or () if isinstance(e, Mapping) and e.get("event") in ends]
    times = [
        float(ms) if isinstance(ms := e.get("ms"), int | float) and not isinstance(ms, bool) else 0.0
        for e in events
    ]
    return max(times) if times else None


def _ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


# -- the shown traceback --------------------------------------------------------------------


@functools.cache
def _internal_types() -> tuple[type[BaseException], ...]:
    """Exceptions that only say "the run was cancelled": pydantic-ai's, asyncio's, anyio's
    (anyio cancels with asyncio's ``CancelledError`` on asyncio)."""
    import asyncio

    from cancellable_agents.core.exceptions import TaskCancelled

    found: list[type[BaseException]] = [asyncio.CancelledError, TaskCancelled, GeneratorExit]
    try:
        from pydantic_ai.exceptions import RunCancelled

        found.append(RunCancelled)
    except ImportError:  # pragma: no cover - pydantic-ai is a dependency
        pass
    try:
        import anyio

        found += [anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError]
    except ImportError:  # pragma: no cover - anyio comes with httpx
        pass
    return tuple(found)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """What a traceback printer shows below ``exc``: its causes and contexts, in order."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current is not exc:
            yield current
        nxt = current.__cause__
        if nxt is None and not current.__suppress_context__:
            nxt = current.__context__
        current = nxt


def hide_unwind_chain(exc: BaseException) -> bool:
    """Hide ``exc``'s chain from the shown traceback if it is only the cancellation's own
    machinery (``RunCancelled``, ``CancelledError``, anyio's ``WouldBlock``, ...); return whether.

    The chain is ~60 frames of pydantic-ai, asyncio and anyio that read like a crash. It stays
    available: on ``exc.unwind_chain`` (the exception that was the cause) and in this module's
    DEBUG log. A chain that holds any other error (a tool that failed during the unwind) is
    shown in full, as is.
    """
    chained = list(_chain(exc))
    if not chained or not all(isinstance(e, _internal_types()) for e in chained):
        return False
    first = chained[0]
    exc.unwind_chain = first  # type: ignore[attr-defined]
    if log.isEnabledFor(logging.DEBUG):
        shown = "".join(traceback.format_exception(first))
        log.debug("the unwind chain hidden from %s's traceback:\n%s", type(exc).__name__, shown)
    exc.__cause__ = None
    exc.__suppress_context__ = True
    return True
