"""Wind-down: a run near its deadline or its budget answers with what it has instead of being killed.

What a DAG author gives ([`WindDown`][]) and what a wound-down run reports ([`WindDownReport`][]).
Light on purpose (no pydantic-ai): a DAG file builds a ``WindDown`` at parse time. The pydantic-ai
hook that makes the last request tool-less is ``cancellable_agents.run._final_request``.

The contract, in the run's terms:

- **when**: at ``deadline - seconds`` (the run's own deadline, ``execution_timeout`` minus
  ``timeout_margin``), or, with ``budget=True``, at the request that would pass one of the run's
  ``usage_limits`` (requests; tokens or cost with a reserve for the final request);
- **what**: the step in flight finishes (a tool already running keeps the window to return);
  the next model request is the last: it offers no function tools (output tools stay) and
  carries one short instruction that time is up; its answer is the run's result, validated as
  any output is;
- **else**: a final answer that does not come before the deadline is killed as a run without
  wind-down is (cause ``timeout``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_WIND_DOWN_SECONDS",
    "WindDown",
    "WindDownReason",
    "WindDownReport",
    "wind_down_of",
]

#: The window ``wind_down=True`` gives: long enough for a final answer of ~500 output tokens from a
#: hosted model (time to first token 1-3 s plus 500 tokens at 50-100 tokens/s: 6-13 s), measured
#: in ``benchmarks/wind_down.py`` and explained in docs/content/wind-down.md.
DEFAULT_WIND_DOWN_SECONDS = 15.0

#: The final request's instruction unless the author gives one.
DEFAULT_INSTRUCTION = (
    "Time is up: do not call any more tools. Answer now with what you have, and say briefly what is missing."
)

#: Why a run wound down: its deadline, or the usage limit its next request would pass.
WindDownReason = Literal["deadline", "request_limit", "tokens_limit", "cost_limit"]

#: What a wound-down answer does to the task: it is the result, or the task fails as a timeout.
OnWindDown = Literal["answer", "fail"]

#: An author's final instruction: text, or a callable building it from the run's messages so far.
Instruction = str | Callable[[list[Any]], str]


def _refuse(message: str) -> None:
    from cancellable_agents.core.exceptions import ConfigurationError

    raise ConfigurationError(message)


@dataclass(frozen=True)
class WindDown:
    """How a run winds down (``wind_down=`` on the operators, the decorators and the mixin).

    :param seconds: how long before the run's deadline the wind-down starts; ``None`` or 0: not
        on the deadline. Must be below the run's timeout (checked where the timeout is known).
    :param instruction: the final request's instruction (default ``DEFAULT_INSTRUCTION``), or a
        callable ``(messages) -> str`` that builds it from the run's messages so far.
    :param on_wind_down: ``"answer"`` (default): the wound-down answer is the task's result;
        ``"fail"``: the task fails as ``timeout`` with the partial answer in its record, for
        pipelines where a partial answer is worse than none.
    :param budget: also wind down at the ``usage_limits`` (opt-in): the request that would pass the
        request limit, or leave less than the reserve under a token or cost limit, is the final one.
    :param reserve_tokens: tokens kept for the final request under a token limit; ``None``: the
        largest request of the run so far plus the final instruction's (an estimate: the final
        answer's size is not known in advance; give your model's answer size where it matters).
    :param reserve_cost: cost kept for the final request under ``cost_limit``; ``None``: the
        costliest request of the run so far.
    """

    seconds: float | None = None
    instruction: Instruction | None = None
    on_wind_down: OnWindDown = "answer"
    budget: bool = False
    reserve_tokens: int | None = None
    reserve_cost: float | None = None

    def __post_init__(self) -> None:
        seconds = self.seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
        ):
            _refuse(f"wind_down must be a number of seconds, got {seconds!r}")
        if seconds is not None and seconds < 0:
            _refuse(f"wind_down must be >= 0 seconds (0 or None: off), got {seconds!r}")
        if self.on_wind_down not in ("answer", "fail"):
            _refuse(f"on_wind_down must be 'answer' or 'fail', got {self.on_wind_down!r}")
        if self.instruction is not None and not (
            isinstance(self.instruction, str) or callable(self.instruction)
        ):
            _refuse("wind_down's instruction must be a str or a callable (messages) -> str")
        if self.reserve_tokens is not None and self.reserve_tokens < 0:
            _refuse(f"reserve_tokens must be >= 0, got {self.reserve_tokens!r}")
        if self.reserve_cost is not None and self.reserve_cost < 0:
            _refuse(f"reserve_cost must be >= 0, got {self.reserve_cost!r}")

    @property
    def on_deadline(self) -> bool:
        """Whether the run winds down before its deadline."""
        return bool(self.seconds)

    @property
    def active(self) -> bool:
        """Whether anything winds down at all (deadline or budget)."""
        return self.on_deadline or self.budget

    def final_instruction(self, messages: list[Any]) -> str:
        """The final request's instruction: the author's, built from ``messages`` if a callable."""
        if self.instruction is None:
            return DEFAULT_INSTRUCTION
        if isinstance(self.instruction, str):
            return self.instruction
        return str(self.instruction(list(messages)))

    def check_timeout(self, run_timeout: float | None, where: str = "execution_timeout") -> None:
        """Refuse a window that leaves no run before it: ``seconds`` must be below ``run_timeout``
        (the seconds the run may take), else the run would wind down before it started."""
        if not self.seconds or run_timeout is None:
            return
        if self.seconds >= run_timeout:
            _refuse(
                f"wind_down={self.seconds:g}s is not below the run's {run_timeout:g}s ({where} minus "
                "timeout_margin): lower wind_down or raise execution_timeout"
            )


def wind_down_of(value: Any, on_wind_down: OnWindDown | None = None) -> WindDown | None:
    """``wind_down=`` as options: a number of seconds, ``True`` (``DEFAULT_WIND_DOWN_SECONDS``),
    a [`WindDown`][], or ``None``/``0``/``False`` (off); ``on_wind_down`` overrides the options'."""
    if value is None or value is False:
        options = None
    elif value is True:
        options = WindDown(DEFAULT_WIND_DOWN_SECONDS)
    elif isinstance(value, WindDown):
        options = value
    elif isinstance(value, (int, float)):
        options = WindDown(float(value))
    else:
        _refuse(f"wind_down must be seconds, True, a WindDown or None, got {value!r}")
        return None  # unreachable: _refuse raises
    if on_wind_down is not None:
        from dataclasses import replace

        options = replace(options or WindDown(), on_wind_down=on_wind_down)
    return options if options is not None and options.active else None


@dataclass(frozen=True)
class WindDownReport:
    """How a run wound down: what the record, the log's summary line and the metrics say.

    ``started_s``: seconds from the run's start to the wind-down; ``requests_left``: requests the
    ``request_limit`` still allowed when it started (``None`` without one); ``final_answer_s``: how
    long the final request took to answer (``None`` if no answer came); ``left_s``: seconds left
    before the deadline when it started (``None`` without one).
    """

    reason: WindDownReason
    started_s: float
    requests_made: int
    requests_left: int | None = None
    left_s: float | None = None
    final_answer_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON values (the durable record's end, the timeline)."""
        return {
            "reason": self.reason,
            "started_s": round(self.started_s, 3),
            "requests_made": self.requests_made,
            "requests_left": self.requests_left,
            "left_s": round(self.left_s, 3) if self.left_s is not None else None,
            "final_answer_s": round(self.final_answer_s, 3) if self.final_answer_s is not None else None,
        }

    def summary(self) -> str:
        """One human line: ``wound down (deadline) 15.0s before it, after 4 requests ...``."""
        why = (
            f"{self.left_s:.1f}s before the deadline"
            if self.reason == "deadline" and self.left_s is not None
            else (f"at the {self.reason.replace('_', ' ')}")
        )
        left = f", {self.requests_left} request(s) left" if self.requests_left is not None else ""
        took = f"{self.final_answer_s:.2f}s" if self.final_answer_s is not None else "no answer"
        return (
            f"wound down {why} ({self.started_s:.1f}s into the run, after {self.requests_made} "
            f"request(s){left}); the final answer took {took}"
        )
