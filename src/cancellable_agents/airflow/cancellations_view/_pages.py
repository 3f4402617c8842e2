"""The view's HTML and SVG, from stored records: pure functions, no Airflow, no I/O.

Every string from a record (a command line, a tool's name, a cause's detail: model and command
output are attacker-controlled) goes through ``_text`` before it reaches the page; numbers are
formatted, never interpolated raw. Pages carry no script, and the app serves them with a CSP that
forbids one.
"""

from __future__ import annotations

import html
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

__all__ = ["GRACE_MS", "FleetQuery", "StoredRow", "fleet_page", "task_instance_page"]

#: Airflow's grace from SIGTERM to SIGKILL, drawn as a line on every timeline.
GRACE_MS = 5000.0

_STYLE = """
body{font-family:system-ui,sans-serif;margin:16px;color:#1a202c}
h1{font-size:20px}h2{font-size:16px;margin-top:24px}
table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #cbd5e0;padding:4px 8px;text-align:left;font-size:13px}
code{white-space:pre-wrap;word-break:break-all}.muted{color:#718096}.ok{color:#276749}.bad{color:#c53030}
svg text{font-size:11px;font-family:system-ui,sans-serif}
"""


@dataclass(frozen=True)
class StoredRow:
    """One stored document and where it belongs (read by the app's queries)."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    document: Mapping[str, Any]

    @property
    def record(self) -> Mapping[str, Any]:
        record = self.document.get("record")
        return record if isinstance(record, Mapping) else {}

    @property
    def try_number(self) -> int:
        return _int(self.document.get("try"))

    @property
    def written_at(self) -> float:
        return _float(self.document.get("written_at"))


def _text(value: Any) -> str:
    """Any value as escaped text (quotes too: it may land in an attribute)."""
    return html.escape(str(value), quote=True)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _page(title: str, body: Iterable[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_text(title)}</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>"
    )


def _when(epoch: float) -> str:
    if not epoch:
        return "unknown"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _events(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [e for e in record.get("timeline") or () if isinstance(e, Mapping)]


def unwound_ms(record: Mapping[str, Any]) -> float | None:
    """The record's unwind time, read as the task log's summary reads it."""
    ends = [
        _float(e.get("ms"))
        for e in _events(record)
        if e.get("event") in ("run_unwound", "resources_released")
    ]
    return max(ends) if ends else None


# -- the task instance page -------------------------------------------------------------------


def task_instance_page(title: str, rows: Sequence[StoredRow], fleet_href: str) -> str:
    """One task instance: each stored try, newest first: summary, timeline picture, kills."""
    body = [
        f"<h1>Cancellations of {_text(title)}</h1>",
        f"<p><a href='{_text(fleet_href)}'>All cancellations</a></p>",
    ]
    if not rows:
        body.append("<p class='muted'>No cancellation recorded for this task instance.</p>")
    ordered = sorted(rows, key=lambda r: r.try_number, reverse=True)
    for index, row in enumerate(ordered):
        body.extend(_try_section(row, ordered[index - 1] if index else None))
    return _page(f"Cancellations: {title}", body)


def _try_section(row: StoredRow, next_row: StoredRow | None) -> list[str]:
    record = row.record
    killed = [k for k in record.get("killed") or () if isinstance(k, Mapping)]
    left = _int(record.get("processes_left"))
    stragglers = [s for s in record.get("stragglers") or ()]
    unwound = unwound_ms(record)
    parts = [
        f"<section class='try' data-try='{row.try_number}'><h2>Try {row.try_number}</h2>",
        "<table>",
        f"<tr><th>cause</th><td class='cause'>{_text(record.get('cause', 'unknown'))}</td></tr>",
        f"<tr><th>detail</th><td>{_text(record.get('detail') or '')}</td></tr>",
        f"<tr><th>outcome</th><td>{_text(record.get('outcome', ''))}</td></tr>",
        f"<tr><th>what happens next</th><td>{_text(record.get('retry', ''))}</td></tr>",
        f"<tr><th>unwound in</th><td>{'not finished' if unwound is None else f'{unwound:.0f} ms'}</td></tr>",
        f"<tr><th>budget</th><td>{_float(record.get('budget_s')):.1f} s</td></tr>",
        f"<tr><th>recorded</th><td>{_text(_when(row.written_at))}</td></tr>",
        "</table>",
        _timeline_svg(record),
        "<h3>Processes killed</h3>",
    ]
    if killed:
        parts.append("<table class='killed'><tr><th>pid</th><th>command</th><th>signal</th><th>by</th></tr>")
        for kill in killed:
            pid = kill.get("pid") if kill.get("pid") is not None else kill.get("command_id", "")
            parts.append(
                f"<tr><td>{_text(pid)}</td><td><code>{_text(kill.get('command', ''))}</code></td>"
                f"<td>{_text(kill.get('signal', ''))}</td><td>{_text(kill.get('source', ''))}</td></tr>"
            )
        parts.append("</table>")
    else:
        parts.append("<p class='muted'>none</p>")
    left_class = "ok" if left == 0 and not stragglers else "bad"
    left_words = f"{left} left" + (
        f"; still running after the budget: {', '.join(map(str, stragglers))}" if stragglers else ""
    )
    parts.append(f"<p class='left {left_class}'>{len(killed)} killed, {_text(left_words)}</p>")
    parts.append(_resume_point(row, next_row))
    parts.append("</section>")
    return parts


def _attached(record: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    attached = record.get("attached")
    facts = attached.get(name) if isinstance(attached, Mapping) else None
    return facts if isinstance(facts, Mapping) else {}


def _resume_point(row: StoredRow, next_row: StoredRow | None) -> str:
    """Where this try started from and where the next one resumes, from the durable journal's
    facts in the record (``attached.durable``)."""
    durable = _attached(row.record, "durable")
    if not durable:
        words = "not a durable run: the next try starts from the beginning"
    else:
        usage = durable.get("usage_this_try")
        done = usage.get("requests", 0) if isinstance(usage, Mapping) else 0
        words = f"the next try resumes after this try's {_int(done)} journaled model requests"
        if not durable.get("recording", True):
            words = f"recording was off ({durable.get('recording_off')}): the next try starts fresh"
        if durable.get("resumed_from_try"):
            rerun = ", ".join(map(str, durable.get("tool_calls_rerun") or ())) or "none"
            words += (
                f"; this try resumed from try {_int(durable.get('resumed_from_try'))} "
                f"({_int(durable.get('messages_restored'))} messages restored, tool calls rerun: {rerun})"
            )
    if next_row is not None:
        words += f"; try {next_row.try_number} was killed too"
    deferred = _attached(row.record, "deferred")
    if deferred:
        words += f"; waited {_float(deferred.get('waited_s')):.1f} s deferred without a worker slot"
    return f"<p class='resume'>Resume point: {_text(words)}</p>"


def _timeline_svg(record: Mapping[str, Any], width: int = 900) -> str:
    """The try as a picture: the kill at 0, the cause decided, one bar per released resource
    (its release from start to end), the budget and the 5 s grace as lines."""
    events = [e for e in _events(record) if _float(e.get("ms")) >= 0]
    bars = [e for e in events if e.get("event") == "released"]
    budget_ms = _float(record.get("budget_s")) * 1000
    end = max([GRACE_MS, budget_ms, *(_float(e.get("ms")) for e in events)]) * 1.05
    left, right, row_h = 270, width - 20, 18
    height = 60 + row_h * (len(bars) + 2)

    def x(ms: float) -> float:
        return left + (right - left) * ms / end

    out = [
        f"<svg class='timeline' width='{width}' height='{height}' role='img' "
        "aria-label='timeline of the try'>"
    ]
    out.append(
        f"<line x1='{x(0):.1f}' y1='20' x2='{x(0):.1f}' y2='{height - 10}' "
        "stroke='#c53030' stroke-width='2'/>"
    )
    out.append(f"<text x='{x(0) + 3:.1f}' y='14'>kill signal</text>")
    for ms, label, colour in ((budget_ms, "budget", "#dd6b20"), (GRACE_MS, "5 s grace (SIGKILL)", "#1a202c")):
        if ms:
            out.append(
                f"<line class='{'grace' if ms == GRACE_MS else 'budget'}' "
                f"x1='{x(ms):.1f}' y1='20' x2='{x(ms):.1f}' "
                f"y2='{height - 10}' stroke='{colour}' stroke-dasharray='4 3'/>"
            )
            out.append(f"<text x='{x(ms) - 4:.1f}' y='14' text-anchor='end'>{_text(label)}</text>")
    y = 30
    for event in events:
        if event.get("event") == "cause_decided":
            out.append(f"<circle cx='{x(_float(event.get('ms'))):.1f}' cy='{y + 6}' r='5' fill='#2b6cb0'/>")
            words = f"cause decided: {event.get('cause', '')} at {_float(event.get('ms')):.0f} ms"
            out.append(f"<text x='10' y='{y + 10}' class='cause-label'>{_text(words)}</text>")
            y += row_h
            break
    for bar in bars:
        ends = _float(bar.get("ms"))
        starts = max(0.0, ends - _float(bar.get("took_ms")))
        out.append(
            f"<rect class='bar' x='{x(starts):.1f}' y='{y}' width='{max(2.0, x(ends) - x(starts)):.1f}' "
            f"height='{row_h - 4}' fill='#38a169'><title>{_text(bar.get('resource', ''))}: "
            f"{_float(bar.get('took_ms')):.0f} ms</title></rect>"
        )
        label = f"{bar.get('resource', '')} ({_float(bar.get('took_ms')):.0f} ms)"
        out.append(f"<text x='10' y='{y + 11}'>{_text(label[:42])}</text>")
        y += row_h
    out.append(f"<text x='{left}' y='{height - 2}' class='muted'>0 ms</text>")
    out.append(f"<text x='{right}' y='{height - 2}' text-anchor='end'>{end:.0f} ms</text>")
    out.append("</svg>")
    return "".join(out)


# -- the fleet page ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetQuery:
    """The page's filter, as given (echoed into its form and links, escaped)."""

    dag_id: str = ""
    since: str = ""
    until: str = ""
    page: int = 1


def fleet_page(
    rows: Sequence[StoredRow],
    page_rows: Sequence[StoredRow],
    total: int,
    query: FleetQuery,
    page_size: int,
    ti_href: str,
    window: int,
) -> str:
    """Kills across the fleet: by cause over time, unwind p50/p99 by DAG, leftovers, resumes,
    wind-downs; then the records themselves, one page at a time. ``rows`` are the newest
    ``window`` records the filter matches (the summaries), ``page_rows`` the listed page."""
    body = ["<h1>Cancellations</h1>", _filter_form(query)]
    body.append(
        f"<p class='muted'>{total} records match; summaries over the newest {min(total, window)}.</p>"
    )
    body.extend(_by_cause_over_time(rows))
    body.extend(_unwind_by_dag(rows))
    leftovers = sum(_int(r.record.get("processes_left")) for r in rows)
    resumed = [_attached(r.record, "durable") for r in rows]
    resumes = sum(1 for d in resumed if d.get("resumed_from_try"))
    restored = sum(_int(d.get("messages_restored")) for d in resumed)
    wind_downs = sum(1 for r in rows for e in _events(r.record) if e.get("event") == "wind_down_started")
    waits = [
        _float(_attached(r.record, "deferred").get("waited_s"))
        for r in rows
        if _attached(r.record, "deferred")
    ]
    body.append("<h2>Totals</h2><table class='totals'>")
    body.append(f"<tr><th>leftover processes (should be 0)</th><td class='leftovers'>{leftovers}</td></tr>")
    body.append(f"<tr><th>killed tries that had resumed</th><td>{resumes}</td></tr>")
    body.append(f"<tr><th>messages restored instead of repeated</th><td>{restored}</td></tr>")
    body.append(f"<tr><th>wind-downs started</th><td>{wind_downs}</td></tr>")
    body.append(
        "<tr><th>deferred waits that held no slot</th>"
        f"<td>{len(waits)} ({sum(waits):.0f} s)</td></tr></table>"
    )
    body.extend(_listing(page_rows, ti_href))
    body.append(_pager(query, total, page_size))
    return _page("Cancellations", body)


def _filter_form(query: FleetQuery) -> str:
    return (
        "<form method='get'>"
        f"DAG <input name='dag_id' value='{_text(query.dag_id)}'> "
        f"since <input name='since' placeholder='2026-12-01' value='{_text(query.since)}'> "
        f"until <input name='until' placeholder='2026-12-06T12:00' value='{_text(query.until)}'> "
        "<button type='submit'>Filter</button></form>"
    )


def _by_cause_over_time(rows: Sequence[StoredRow]) -> list[str]:
    buckets: dict[str, Counter[str]] = defaultdict(Counter)
    for row in rows:
        day = _when(row.written_at)[:10]
        buckets[day][str(row.record.get("cause", "unknown"))] += 1
    causes = sorted({c for counts in buckets.values() for c in counts})
    out = ["<h2>Kills by cause over time</h2><table class='by-cause'><tr><th>day</th>"]
    out += [f"<th>{_text(c)}</th>" for c in causes] + ["</tr>"]
    peak = max((sum(c.values()) for c in buckets.values()), default=1)
    for day in sorted(buckets, reverse=True):
        counts = buckets[day]
        out.append(f"<tr><td>{_text(day)}</td>")
        out += [f"<td>{counts.get(c, 0)}</td>" for c in causes]
        out.append(
            f"<td><svg width='200' height='10'><rect x='0' y='0' height='10' fill='#2b6cb0' "
            f"width='{200 * sum(counts.values()) / peak:.1f}'/></svg></td></tr>"
        )
    out.append("</table>")
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _unwind_by_dag(rows: Sequence[StoredRow]) -> list[str]:
    by_dag: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        unwound = unwound_ms(row.record)
        if unwound is not None:
            by_dag[row.dag_id].append(unwound)
    out = [
        "<h2>Unwind time by DAG</h2><table class='unwind'>"
        "<tr><th>DAG</th><th>kills</th><th>p50</th><th>p99</th></tr>"
    ]
    for dag_id in sorted(by_dag):
        values = sorted(by_dag[dag_id])
        out.append(
            f"<tr><td>{_text(dag_id)}</td><td>{len(values)}</td><td>{_percentile(values, 50):.0f} ms</td>"
            f"<td>{_percentile(values, 99):.0f} ms</td></tr>"
        )
    out.append("</table>")
    return out


def _listing(rows: Sequence[StoredRow], ti_href: str) -> list[str]:
    out = [
        "<h2>Records</h2><table class='records'><tr><th>recorded</th><th>DAG</th><th>task</th><th>run</th>"
        "<th>try</th><th>cause</th><th>unwound</th><th>killed / left</th></tr>"
    ]
    for row in rows:
        link = (
            ti_href
            + "?"
            + urlencode(
                {
                    "dag_id": row.dag_id,
                    "run_id": row.run_id,
                    "task_id": row.task_id,
                    "map_index": row.map_index,
                }
            )
        )
        unwound = unwound_ms(row.record)
        killed = len(row.record.get("killed") or ())
        out.append(
            f"<tr><td>{_text(_when(row.written_at))}</td><td>{_text(row.dag_id)}</td>"
            f"<td><a href='{_text(link)}'>{_text(row.task_id)}</a></td><td>{_text(row.run_id)}</td>"
            f"<td>{row.try_number}</td><td>{_text(row.record.get('cause', 'unknown'))}</td>"
            f"<td>{'-' if unwound is None else f'{unwound:.0f} ms'}</td>"
            f"<td>{killed} / {_int(row.record.get('processes_left'))}</td></tr>"
        )
    out.append("</table>")
    return out


def _pager(query: FleetQuery, total: int, page_size: int) -> str:
    pages = max(1, -(-total // page_size))
    links = []
    for number, words in ((query.page - 1, "previous"), (query.page + 1, "next")):
        if 1 <= number <= pages:
            params = {"dag_id": query.dag_id, "since": query.since, "until": query.until, "page": number}
            links.append(f"<a href='?{_text(urlencode(params))}'>{words}</a>")
    return f"<p class='pager'>page {query.page} of {pages} {' '.join(links)}</p>"
