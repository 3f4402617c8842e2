"""A try's record kept where the API server can query it: one bounded write at the end of a try
that was killed, or that wound down, resumed an earlier try's journal or waited without a worker
slot (a plain successful try writes nothing).

A killed try's document (``kind: killed``) is the task log's record (``KillReport.full_record()``
of [`document`][cancellable_agents.airflow.kill_record.document]), not a second format; any other
try's (``kind: facts``) is its [`TryFacts`][cancellable_agents.airflow.kill_record._try_facts.TryFacts].
Either is wrapped with what a query needs (format, kind, try number, when it was written) and
bounded to ``MAX_BYTES``, under Airflow's
``[state_store] max_value_storage_bytes`` (64 KB by default). Kept under
``cancellable_agents.cancellation.try<N>`` in Airflow 3.3's task state store
(``context["task_state_store"]``), else in XCom (Airflow 3.1/3.2, where a try's XCom is cleared
when the next try starts, so only the latest try is there). Turned off by
``[cancellable_agents] store_cancellation_record = False`` (both kinds: the setting's name is
older than the facts).

Written once, on the main thread, after the record is logged (a killed try) or after ``execute``
returned (any other): never from a signal handler (the
comms channel's lock is not re-entrant), and a failed write is logged, never raised (the kill's
own path must end as it would without it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from cancellable_agents.airflow.task_try import TaskTry

__all__ = [
    "FORMAT",
    "KEY_PREFIX",
    "MAX_BYTES",
    "bounded",
    "key_for_try",
    "store_record",
    "store_try_facts",
    "stored_document",
]

log = logging.getLogger(__name__)

#: Every stored record's key starts with this; the view queries by it.
KEY_PREFIX = "cancellable_agents.cancellation."
#: The wrapper's format: 2 added ``kind`` (format 1 held only kill records).
FORMAT = 2

#: What a stored document holds: a killed try's kill record, or another try's facts.
Kind = Literal["killed", "facts"]
#: The bound on one stored document, in bytes of JSON (half Airflow's default value limit).
MAX_BYTES = 32_000
#: A string longer than this (a command line, a model's text) is cut when the bound is exceeded.
_LONG_STRING = 200
#: Lists cut to this many items when cutting strings was not enough.
_LIST_ITEMS = 40


def key_for_try(try_number: int) -> str:
    """The store key of one try's record."""
    return f"{KEY_PREFIX}try{int(try_number)}"


def stored_document(
    record: Mapping[str, Any], try_number: int, now: float | None = None, kind: Kind = "killed"
) -> dict[str, Any]:
    """What is stored for one try: the record (bounded) with its kind, try and write time."""
    return {
        "format": FORMAT,
        "kind": kind,
        "try": int(try_number),
        "written_at": time.time() if now is None else now,
        "record": bounded(record),
    }


def bounded(record: Mapping[str, Any], limit: int = MAX_BYTES) -> dict[str, Any]:
    """``record`` as it is if its JSON fits ``limit`` bytes; else with long strings cut, then
    long lists cut (``truncated`` names what was cut), then only its scalars. Never larger
    than ``limit``."""
    whole = dict(record)
    if _size(whole) <= limit:
        return whole
    cut: dict[str, Any] = {k: _cut_strings(v) for k, v in whole.items()}
    cut["truncated"] = ["long strings"]
    if _size(cut) <= limit:
        return cut
    for key, value in list(cut.items()):
        if isinstance(value, list) and len(value) > _LIST_ITEMS:
            cut[key] = value[:_LIST_ITEMS]
            cut[f"{key}_total"] = len(value)
            cut["truncated"].append(key)
    if _size(cut) <= limit:
        return cut
    scalars: dict[str, Any] = {
        k: v for k, v in cut.items() if isinstance(v, str | int | float | bool) or v is None
    }
    scalars["truncated"] = ["everything but the scalars"]
    return scalars if _size(scalars) <= limit else {"truncated": ["the whole record"]}


def store_record(
    context: Any, ti: Any, record: Mapping[str, Any], enabled: bool = True, kind: Kind = "killed"
) -> str | None:
    """Write ``record`` for the try of ``ti``, once; return where (``task_state_store`` or
    ``xcom``) or ``None`` when off or nowhere to write. Never raises."""
    if not enabled or ti is None:
        return None
    try_number = getattr(ti, "try_number", None) or 0
    document = stored_document(record, try_number, kind=kind)
    key = key_for_try(try_number)
    accessor = context.get("task_state_store") if hasattr(context, "get") else None
    try:
        if accessor is not None:
            accessor.set(key, document)
            return "task_state_store"
        if hasattr(ti, "xcom_push"):
            ti.xcom_push(key=key, value=document)
            return "xcom"
    except Exception as exc:  # the kill's path must not fail on a write for the UI
        # A cleared try is the usual case: Airflow already replaced its task instance (404).
        log.warning("the try's record was not stored for the UI (the task log has it): %s", exc)
    return None


def store_try_facts(task_try: TaskTry) -> str | None:
    """At the end of a try that ``execute`` ended without a kill: store its
    [`TryFacts`][cancellable_agents.airflow.kill_record._try_facts.TryFacts] (wind-downs, resume,
    waits) if it has any; a try with none writes nothing. Never raises."""
    try:
        from cancellable_agents.airflow.config import deployment_setting
        from cancellable_agents.airflow.kill_record._try_facts import TryFacts

        scope = task_try.scope
        started = [e for e in scope.timeline if e.event == "wind_down_started"]
        reports = [r.as_dict() for r in task_try.wound_down]
        wind_downs: list[tuple[float | None, dict[str, Any]]]
        if len(started) == len(reports):
            wind_downs = [(e.wall, r) for e, r in zip(started, reports, strict=True)]
        else:  # runs that started a wind-down but did not answer at it: the reports alone
            wind_downs = [(None, r) for r in reports]
        facts = TryFacts.of_scope(scope.attached, wind_downs)
        if not facts:
            return None
        enabled = bool(deployment_setting("store_cancellation_record"))
    except Exception as exc:  # a finished try must not fail on a record for the UI
        log.warning("the try's facts were not stored for the UI: %r", exc)
        return None
    return store_record(task_try.context, task_try.ti, facts.as_dict(), enabled=enabled, kind="facts")


def _cut_strings(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= _LONG_STRING else value[:_LONG_STRING] + "…"
    if isinstance(value, list):
        return [_cut_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut_strings(v) for k, v in value.items()}
    return value


def _size(value: Any) -> int:
    return len(json.dumps(value, default=str, ensure_ascii=False).encode())
