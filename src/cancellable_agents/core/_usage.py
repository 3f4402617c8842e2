"""A run's usage as plain counts: the one shape the kill record, a sub-agent's record and the
continuity record share (leaf module: imports nothing of the package, nor pydantic-ai)."""

from __future__ import annotations

from typing import Any

#: The counts every usage dict holds, in this order.
USAGE_FIELDS = ("requests", "input_tokens", "output_tokens", "tool_calls")


def usage_counts(usage: Any) -> dict[str, int]:
    """The counts of ``usage`` (a pydantic-ai ``RunUsage`` or anything with those attributes).

    A count that is missing or ``None`` reads 0. ``usage`` may also be the zero-argument method
    older pydantic-ai has for it (``result.usage``): it is called. ``None`` gives all zeros.
    """
    if usage is not None and not hasattr(usage, "requests") and callable(usage):
        usage = usage()
    return {name: int(getattr(usage, name, 0) or 0) for name in USAGE_FIELDS}


def usage_dict(usage: Any) -> dict[str, int] | None:
    """[`usage_counts`][], or ``None`` when there is no usage to report (a run that never
    started): a record then says so instead of claiming zero."""
    return None if usage is None else usage_counts(usage)
