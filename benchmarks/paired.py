"""Side-by-side timing in one process: a bare run and a compared run, interleaved in pairs.

Which of the two goes first alternates from pair to pair, so drift on a busy machine hits both
alike; the overhead is the median of the paired differences, not the difference of medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(
    bare: Callable[[], Any],
    candidate: Callable[[int], Callable[[], Any]],
    pairs: int,
    warmup: int,
) -> tuple[list[float], list[float]]:
    """Time ``pairs`` (after ``warmup``) of ``bare`` and ``candidate(i)()``; per-pair setup happens
    in ``candidate(i)``, untimed. Returns (bare seconds, compared seconds), pair by pair."""
    bare_s: list[float] = []
    other_s: list[float] = []
    for i in range(warmup + pairs):
        other = candidate(i)
        if i % 2 == 0:
            t_bare, t_other = timed(bare), timed(other)
        else:
            t_other, t_bare = timed(other), timed(bare)
        if i >= warmup:
            bare_s.append(t_bare)
            other_s.append(t_other)
    return bare_s, other_s


def median_difference(other: Sequence[float], bare: Sequence[float]) -> float:
    """The median of the paired differences (seconds)."""
    return statistics.median([o - b for o, b in zip(other, bare, strict=True)])


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], *, text_columns: int = 1) -> str:
    """A Markdown table; the first ``text_columns`` are left-aligned, the rest (numbers) right."""
    align = ["---" if i < text_columns else "---:" for i in range(len(header))]
    lines = [f"| {' | '.join(header)} |", f"|{'|'.join(align)}|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)
