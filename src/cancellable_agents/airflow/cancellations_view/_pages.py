"""The view's HTML and SVG, from stored records: pure functions, no Airflow, no I/O.

A stored document is a killed try's kill record (``kind: killed``; format 1 held only those) or
another try's facts (``kind: facts``: it wound down, resumed an earlier try's journal, waited
without a worker slot). Both are read as
[`TryFacts`][cancellable_agents.airflow.kill_record._try_facts.TryFacts] for those facts, so a
killed try's waits and a finished try's show the same way; only kill records count as kills.

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

from cancellable_agents.airflow.kill_record._try_facts import WAIT_KINDS, TryFacts, WaitFacts, WindDownFacts
from cancellable_agents.airflow.kill_record.document import unwound_ms

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

    @property
    def killed(self) -> bool:
        """A kill record (``kind: killed``, or format 1, which stored only those)."""
        return self.document.get("kind", "killed") == "killed"

    @property
    def facts(self) -> TryFacts:
        """The try's wind-down, resume and wait facts, from either kind of document."""
        if self.killed:
            return TryFacts.of_record(self.record)
        return TryFacts.from_dict(self.record)


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


# -- the task instance page -------------------------------------------------------------------


def task_instance_page(title: str, rows: Sequence[StoredRow], fleet_href: str) -> str:
    """One task instance: each stored try, newest first: a killed try's summary, timeline
    picture and kills; another try's wind-downs, resume and waits."""
    body = [
        f"<h1>Cancellations of {_text(title)}</h1>",
        f"<p><a href='{_text(fleet_href)}'>All cancellations</a></p>",
    ]
    if not rows:
        body.append(
            "<p class='muted'>No try of this task instance was recorded (a try is when it is killed, "
            "winds down, resumes an earlier try or waits without a worker slot).</p>"
        )
    ordered = sorted(rows, key=lambda r: r.try_number, reverse=True)
    for index, row in enumerate(ordered):
        later = ordered[index - 1] if index else None
        body.extend(_try_section(row, later) if row.killed else _facts_section(row))
    return _page(f"Cancellations: {title}", body)


def _facts_section(row: StoredRow) -> list[str]:
    """A try that was not killed: how it ended and its facts, one row each."""
    facts = row.facts
    words = {"wound_down": "wound down: answered at its wind-down"}.get(facts.outcome, facts.outcome)
    usage = facts.usage
    parts = [
        f"<section class='try facts' data-try='{row.try_number}'><h2>Try {row.try_number}: not killed</h2>",
        "<table class='facts'>",
        f"<tr><th>ended</th><td class='outcome'>{_text(words)}</td></tr>",
        *_fact_rows(facts, with_resume=True),
    ]
    if usage:
        spent = f"{_int(usage.get('requests'))} model requests, {_int(usage.get('tool_calls'))} tool calls"
        parts.append(f"<tr><th>this try spent</th><td>{_text(spent)}</td></tr>")
    parts += [f"<tr><th>recorded</th><td>{_text(_when(row.written_at))}</td></tr>", "</table></section>"]
    return parts


def _fact_rows(facts: TryFacts, with_resume: bool) -> list[str]:
    """The table rows of a try's facts: its resume, each wind-down, each wait."""
    rows = []
    if with_resume and facts.resume is not None:
        resume = facts.resume
        rerun = ", ".join(resume.tool_calls_rerun) or "none"
        words = (
            f"from try {resume.from_try}: {resume.steps_reused} journaled model requests reused instead "
            f"of repeated ({resume.messages_restored} messages restored; tool calls run again: {rerun})"
        )
        rows.append(f"<tr><th>resumed</th><td class='resumed'>{_text(words)}</td></tr>")
    for wind_down in facts.wound_down:
        words = _wind_down_words(wind_down)
        rows.append(f"<tr><th>wound down</th><td class='wound-down'>{_text(words)}</td></tr>")
    for wait in facts.waits:
        rows.append(
            f"<tr><th>waited ({_text(wait.kind)})</th><td class='wait {_text(wait.kind)}'>"
            f"{_text(_wait_words(wait))}</td></tr>"
        )
    return rows


def _wind_down_words(wind_down: WindDownFacts) -> str:
    why = wind_down.reason.replace("_", " ")
    before = f", {wind_down.left_s:.1f} s before it" if wind_down.left_s is not None else ""
    left = f", {wind_down.requests_left} requests left" if wind_down.requests_left is not None else ""
    took = (
        f"the final answer took {wind_down.final_answer_s:.2f} s"
        if wind_down.final_answer_s is not None
        else "no final answer"
    )
    at = f" at {_when(wind_down.at)}" if wind_down.at else ""
    return (
        f"at the {why}{before}{at}: {wind_down.started_s:.1f} s into the run, after "
        f"{wind_down.requests_made} requests{left}; {took}"
    )


def _wait_words(wait: WaitFacts) -> str:
    what = "deferred to a trigger" if wait.kind == "deferred" else "awaiting approval"
    calls = f" for {', '.join(wait.calls)}" if wait.calls else ""
    timed_out = f"; timed out: {', '.join(wait.timed_out)}" if wait.timed_out else ""
    ended = f"; ended {_when(wait.ended_at)}" if wait.ended_at else ""
    return f"{wait.waited_s:.1f} s {what}{calls}, holding no worker slot{timed_out}{ended}"


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
    facts = row.facts
    if facts.wound_down or facts.waits:
        parts += ["<table class='facts'>", *_fact_rows(facts, with_resume=False), "</table>"]
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
    if next_row is not None and next_row.killed:
        words += f"; try {next_row.try_number} was killed too"
    elif next_row is not None and (resume := next_row.facts.resume) is not None:
        words += (
            f"; try {next_row.try_number} resumed from try {resume.from_try} and reused "
            f"{resume.steps_reused} journaled model requests"
        )
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
    """Kills across the fleet: by cause over time, unwind p50/p99 by DAG, leftovers; every
    stored try's resumes and steps saved, wind-downs, deferral and approval waits; then the
    records themselves, one page at a time. ``rows`` are the newest ``window`` records the
    filter matches (the summaries), ``page_rows`` the listed page."""
    body = ["<h1>Cancellations</h1>", _filter_form(query)]
    body.append(
        f"<p class='muted'>{total} records match; summaries over the newest {min(total, window)}.</p>"
    )
    kills = [r for r in rows if r.killed]
    body.extend(_by_cause_over_time(kills))
    body.extend(_unwind_by_dag(kills))
    leftovers = sum(_int(r.record.get("processes_left")) for r in kills)
    facts = [(r, r.facts) for r in rows]
    resumed = [f.resume for _, f in facts if f.resume is not None]
    killed_resumed = sum(1 for r, f in facts if r.killed and f.resume is not None)
    wind_downs = sum(len(f.wound_down) for _, f in facts)
    answered = sum(1 for _, f in facts if f.outcome == "wound_down")
    body.append("<h2>Totals</h2><table class='totals'>")
    body.append(f"<tr><th>leftover processes (should be 0)</th><td class='leftovers'>{leftovers}</td></tr>")
    body.append(f"<tr><th>tries that resumed an earlier try</th><td class='resumes'>{len(resumed)}</td></tr>")
    body.append(
        "<tr><th>steps saved (journaled model requests reused instead of repeated)</th>"
        f"<td class='steps-saved'>{sum(r.steps_reused for r in resumed)}</td></tr>"
    )
    body.append(f"<tr><th>killed tries that had resumed</th><td>{killed_resumed}</td></tr>")
    body.append(
        "<tr><th>messages restored instead of repeated</th>"
        f"<td>{sum(r.messages_restored for r in resumed)}</td></tr>"
    )
    body.append(f"<tr><th>wind-downs started</th><td class='wind-downs'>{wind_downs}</td></tr>")
    body.append(f"<tr><th>tries that answered at a wind-down</th><td>{answered}</td></tr>")
    for kind in WAIT_KINDS:
        waits = [w.waited_s for _, f in facts for w in f.waits_of(kind)]
        body.append(
            f"<tr><th>{kind} waits that held no slot</th>"
            f"<td class='{kind}-waits'>{len(waits)} ({sum(waits):.0f} s)</td></tr>"
        )
    body.append("</table>")
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
        "<th>try</th><th>cause (or how a try that was not killed ended)</th><th>unwound</th>"
        "<th>killed / left</th></tr>"
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
        unwound = unwound_ms(row.record) if row.killed else None
        killed = len(row.record.get("killed") or ()) if row.killed else 0
        what = str(row.record.get("cause", "unknown")) if row.killed else _ended_words(row.facts)
        out.append(
            f"<tr><td>{_text(_when(row.written_at))}</td><td>{_text(row.dag_id)}</td>"
            f"<td><a href='{_text(link)}'>{_text(row.task_id)}</a></td><td>{_text(row.run_id)}</td>"
            f"<td>{row.try_number}</td><td>{_text(what)}</td>"
            f"<td>{'-' if unwound is None else f'{unwound:.0f} ms'}</td>"
            f"<td>{killed} / {_int(row.record.get('processes_left')) if row.killed else 0}</td></tr>"
        )
    out.append("</table>")
    return out


def _ended_words(facts: TryFacts) -> str:
    """A try that was not killed, in the listing: how it ended and what it did."""
    said = ["wound down" if facts.outcome == "wound_down" else facts.outcome]
    if facts.resume is not None:
        said.append(f"resumed from try {facts.resume.from_try}, {facts.resume.steps_reused} steps saved")
    for kind in WAIT_KINDS:
        waits = facts.waits_of(kind)
        if waits:
            said.append(f"{len(waits)} {kind} wait(s), {sum(w.waited_s for w in waits):.0f} s")
    return "; ".join(said)


def _pager(query: FleetQuery, total: int, page_size: int) -> str:
    pages = max(1, -(-total // page_size))
    links = []
    for number, words in ((query.page - 1, "previous"), (query.page + 1, "next")):
        if 1 <= number <= pages:
            params = {"dag_id": query.dag_id, "since": query.since, "until": query.until, "page": number}
            links.append(f"<a href='?{_text(urlencode(params))}'>{words}</a>")
    return f"<p class='pager'>page {query.page} of {pages} {' '.join(links)}</p>"
