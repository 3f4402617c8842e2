"""What each try of a durable run spent, and the sums across tries the record keeps.

The head of each try's entries holds every earlier try's usage; a run with
``usage_limits_span_tries`` starts from their sum, and what this try spent is its own usage minus
that sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic_ai.usage import RunUsage

from cancellable_agents.core._usage import USAGE_FIELDS, usage_counts


@dataclass
class TryUsage:
    """What one try spent, as recorded (model responses received; tokens as the model reported)."""

    try_number: int
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0

    def counts(self) -> dict[str, int]:
        """The counts alone, in the shape of [`usage_counts`][cancellable_agents.core._usage.usage_counts]."""
        return usage_counts(self)

    def as_dict(self) -> dict[str, int]:
        """The counts and the try number (``try``), as the record and the kill record hold them."""
        return {"try": self.try_number, **self.counts()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TryUsage:
        """Read [`as_dict`][] back; a count an older record lacks reads 0."""
        return cls(int(data["try"]), **{name: int(data.get(name, 0)) for name in USAGE_FIELDS})

    @classmethod
    def of_run(cls, try_number: int, usage: Any) -> TryUsage:
        """The usage of a run (its ``RunUsage``, or older pydantic-ai's ``result.usage``)."""
        return cls(try_number, **usage_counts(usage))


def total_usage(tries: Iterable[TryUsage]) -> dict[str, int]:
    """The sum of ``tries`` (``try`` dropped)."""
    total = dict.fromkeys(USAGE_FIELDS, 0)
    for item in tries:
        for name in total:
            total[name] += getattr(item, name)
    return total


def add_usage(usage: RunUsage | None, tries: Iterable[TryUsage]) -> RunUsage:
    """``usage`` (a run's starting usage, or none) plus what ``tries`` spent: where a run whose
    usage limits span tries starts counting."""
    total = total_usage(tries)
    base = usage_counts(usage)
    summed = {name: base[name] + total[name] for name in USAGE_FIELDS}
    return RunUsage(
        requests=summed["requests"],
        input_tokens=summed["input_tokens"],
        output_tokens=summed["output_tokens"],
        tool_calls=summed["tool_calls"],
    )


def minus_usage(usage: TryUsage, tries: Iterable[TryUsage]) -> TryUsage:
    """``usage`` less what ``tries`` spent (never below 0): this try's own share of a run that
    started from the earlier tries' usage."""
    total = total_usage(tries)
    own = usage.counts()
    return TryUsage(usage.try_number, **{name: max(0, own[name] - total[name]) for name in USAGE_FIELDS})
