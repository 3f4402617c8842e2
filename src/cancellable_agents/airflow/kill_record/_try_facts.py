"""A try's wind-down, resume and wait facts as one typed document: what is stored for a try that
was not killed but has such facts, and what the Cancellations view reads from any stored try.

Airflow-free. The facts come from where the try already keeps them: its scope's attached facts
(``durable``: the journal's; ``waits``: each pause of the try that held no worker slot) and its
timeline (``wind_down_started``). [`TryFacts.of_scope`][] reads them from a live try (the write
at its end), [`TryFacts.of_record`][] from a kill record (whose ``attached`` and ``timeline`` are
the same facts); [`TryFacts.from_dict`][] reads the stored document back. One reader, so a
killed try and a finished one show the same facts the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["MAX_WAITS", "WAIT_KINDS", "ResumeFacts", "TryFacts", "WaitFacts", "WindDownFacts", "wait_facts"]

#: A try keeps at most this many waits (the newest); ``waits_total`` counts them all.
MAX_WAITS = 20

WaitKind = Literal["deferred", "approval"]
#: Every kind of wait, in the order the view lists them.
WAIT_KINDS: tuple[WaitKind, ...] = ("deferred", "approval")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True)
class WindDownFacts:
    """One run that wound down: why (``deadline``, ``request_limit``, ...), when (``at``: wall
    clock; ``started_s`` into the run, ``left_s`` before its deadline), after how many requests,
    and how long the final answer took."""

    reason: str
    started_s: float
    requests_made: int
    at: float | None = None
    left_s: float | None = None
    requests_left: int | None = None
    final_answer_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "at": self.at,
            "started_s": self.started_s,
            "left_s": self.left_s,
            "requests_made": self.requests_made,
            "requests_left": self.requests_left,
            "final_answer_s": self.final_answer_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WindDownFacts:
        left = data.get("requests_left")
        return cls(
            reason=str(data.get("reason") or "unknown"),
            started_s=_float(data.get("started_s")) or 0.0,
            requests_made=_int(data.get("requests_made")),
            at=_float(data.get("at")),
            left_s=_float(data.get("left_s")),
            requests_left=left if isinstance(left, int) and not isinstance(left, bool) else None,
            final_answer_s=_float(data.get("final_answer_s")),
        )


@dataclass(frozen=True)
class ResumeFacts:
    """A durable run that continued an earlier try's journal: from which try, how many journaled
    model requests it reused instead of repeating (``steps_reused``: the steps saved), how many
    messages it restored, which tool calls ran again (in flight when that try stopped)."""

    from_try: int
    steps_reused: int
    messages_restored: int = 0
    tool_calls_rerun: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "from_try": self.from_try,
            "steps_reused": self.steps_reused,
            "messages_restored": self.messages_restored,
            "tool_calls_rerun": list(self.tool_calls_rerun),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResumeFacts:
        return cls(
            from_try=_int(data.get("from_try")),
            steps_reused=_int(data.get("steps_reused")),
            messages_restored=_int(data.get("messages_restored")),
            tool_calls_rerun=_strings(data.get("tool_calls_rerun")),
        )

    @classmethod
    def of_durable(cls, durable: Mapping[str, Any]) -> ResumeFacts | None:
        """From the journal's facts (``attached["durable"]``): ``None`` unless the run continued an
        earlier try (a run that continues its own try after a pause resumed nothing)."""
        this_try = _int(durable.get("try"))
        reused_from = [t for t in (_int(t) for t in durable.get("reused_from_tries") or ()) if t]
        resumed = _int(durable.get("resumed_from_try"))
        from_try = resumed if resumed and resumed != this_try else max(reused_from, default=0)
        if not from_try:
            return None
        return cls(
            from_try=from_try,
            steps_reused=_int(durable.get("steps_reused")),
            messages_restored=_int(durable.get("messages_restored")),
            tool_calls_rerun=_strings(durable.get("tool_calls_rerun")),
        )


@dataclass(frozen=True)
class WaitFacts:
    """One pause of the try that held no worker slot: a deferral (the task waited for a trigger)
    or an approval (it waited in ``AWAITING_INPUT`` for a person); how long, for which calls,
    which timed out, and when it ended (wall clock)."""

    kind: WaitKind
    waited_s: float
    calls: tuple[str, ...] = ()
    timed_out: tuple[str, ...] = ()
    ended_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "waited_s": round(self.waited_s, 3),
            "calls": list(self.calls),
            "timed_out": list(self.timed_out),
            "ended_at": self.ended_at,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WaitFacts:
        kind: WaitKind = "approval" if data.get("kind") == "approval" else "deferred"
        return cls(
            kind=kind,
            waited_s=max(0.0, _float(data.get("waited_s")) or 0.0),
            calls=_strings(data.get("calls")),
            timed_out=_strings(data.get("timed_out")),
            ended_at=_float(data.get("ended_at")),
        )


def wait_facts(earlier: Iterable[Any], wait: WaitFacts) -> list[dict[str, Any]]:
    """``earlier`` waits of the try (as stored, from a pause's kwargs) with ``wait`` after them:
    the newest ``MAX_WAITS``, as plain values (what a pause carries to the next execution)."""
    kept = [dict(w) for w in earlier if isinstance(w, Mapping)]
    return [*kept, wait.as_dict()][-MAX_WAITS:]


@dataclass(frozen=True)
class TryFacts:
    """What a try did besides being killed: its wind-downs, its resume, its waits.

    ``outcome``: how the try ended (``completed``, ``wound_down``: it answered at a wind-down,
    or ``cancelled`` for a killed try's facts read from its kill record).
    """

    outcome: str
    wound_down: tuple[WindDownFacts, ...] = ()
    resume: ResumeFacts | None = None
    waits: tuple[WaitFacts, ...] = ()
    #: The try's model usage (plain counts), where the journal knows it.
    usage: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        """Whether there is anything to store (a plain successful try has none of these facts)."""
        return bool(self.wound_down or self.resume or self.waits)

    def waits_of(self, kind: WaitKind) -> list[WaitFacts]:
        return [w for w in self.waits if w.kind == kind]

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "wound_down": [w.as_dict() for w in self.wound_down],
            "resume": self.resume.as_dict() if self.resume else None,
            "waits": [w.as_dict() for w in self.waits],
            "usage": dict(self.usage),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TryFacts:
        """A stored document's facts; missing or malformed parts read as absent."""
        resume = data.get("resume")
        return cls(
            outcome=str(data.get("outcome") or "completed"),
            wound_down=tuple(
                WindDownFacts.from_dict(w) for w in data.get("wound_down") or () if isinstance(w, Mapping)
            ),
            resume=ResumeFacts.from_dict(resume) if isinstance(resume, Mapping) else None,
            waits=tuple(WaitFacts.from_dict(w) for w in data.get("waits") or () if isinstance(w, Mapping)),
            usage=_mapping(data.get("usage")),
        )

    @classmethod
    def of_scope(
        cls,
        attached: Mapping[str, Any],
        wind_downs: Sequence[tuple[float | None, Mapping[str, Any]]],
        outcome: str = "completed",
    ) -> TryFacts:
        """A try's facts from its scope: ``attached`` (``durable``, ``waits``) and each wind-down
        as ``(wall clock, report)``; ``outcome`` is ``wound_down`` where one answered."""
        durable = _mapping(attached.get("durable"))
        wound = tuple(WindDownFacts.from_dict({**report, "at": at}) for at, report in wind_downs)
        usage = _mapping(durable.get("usage_this_try"))
        return cls(
            outcome="wound_down" if wound and outcome == "completed" else outcome,
            wound_down=wound,
            resume=ResumeFacts.of_durable(durable),
            waits=_waits(attached),
            usage={k: v for k, v in usage.items() if k != "try"},
        )

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> TryFacts:
        """A kill record's facts (its ``attached`` and its timeline's wind-downs)."""
        origin = _float(record.get("wall_origin"))
        wind_downs = [
            (origin + (_float(e.get("ms")) or 0.0) / 1000 if origin is not None else None, e)
            for e in record.get("timeline") or ()
            if isinstance(e, Mapping) and e.get("event") == "wind_down_started"
        ]
        return cls.of_scope(_mapping(record.get("attached")), wind_downs, outcome="cancelled")


def _waits(attached: Mapping[str, Any]) -> tuple[WaitFacts, ...]:
    """The try's waits: ``attached["waits"]``; a record written before they were kept there has
    only its last deferral (``attached["deferred"]``)."""
    waits = attached.get("waits")
    if isinstance(waits, list):
        return tuple(WaitFacts.from_dict(w) for w in waits if isinstance(w, Mapping))
    deferred = attached.get("deferred")
    if isinstance(deferred, Mapping):
        return (WaitFacts.from_dict({**deferred, "kind": "deferred"}),)
    return ()
