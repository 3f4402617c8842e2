"""What ``durable=True`` costs a run: the journal's time and bytes per step, side by side with the
same run without it, in one process, interleaved.

A 50-step agent (``overhead.fifty_step_agent``: 49 tool calls, then an answer) runs under a task
scope bare (``run_agent_in_scope``) and durable (the same plus a :class:`Journal`), alternating
which goes first in each pair. Two stores: ``MemoryStore`` (the journal's own cost: serialising,
hashing) and ``PathStore`` on a local directory (one JSON file per entry, written to a temporary
name and renamed, as ``durable_path=`` does). Airflow's task state store adds one supervisor
round trip per store call on top of the first row: the last column counts them (a first try
reads nothing, writes one entry per step and one end).

Reported: medians of both runs, the median paired difference per run and per step, the bytes
written per step (step 2 and step 49: the cost does not grow with the history), the end of the
record (part of the durable run's time) and the store calls per step.

``python -m benchmarks.durable_cost [--pairs N]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_ai.capabilities import AbstractCapability

from benchmarks.overhead import STEPS, fifty_step_agent
from benchmarks.paired import interleaved, markdown_table, median_difference
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable import Journal, MemoryStore, PathStore
from cancellable_agents.run.runner import run_agent_in_scope


class _Counting:
    """Wraps a store: counts its calls (each a supervisor round trip through Airflow's task state
    store) and the bytes of each entry written, in order. It cannot list keys, as that store
    cannot, so a completed run leaves its entries, as there."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.entry_bytes: list[int] = []
        self.calls = 0

    def get(self, key: str) -> Any:
        self.calls += 1
        return self.store.get(key)

    def set(self, key: str, value: Any) -> None:
        import json

        self.calls += 1
        self.entry_bytes.append(len(json.dumps(value)))
        self.store.set(key, value)

    def delete(self, key: str) -> None:
        self.calls += 1
        self.store.delete(key)


#: ``hook``: control, an ``after_node_run`` capability that does nothing (what pydantic-ai charges
#: for the hook); ``memory``: the journal's own cost; ``path``: local files, as ``durable_path=``.
STORES = ("hook", "memory", "path")


class _NoOpHook(AbstractCapability[Any]):
    async def after_node_run(self, ctx: Any, *, node: Any, result: Any) -> Any:
        return result


def _run(agent: Any, store: Any | None, hook_only: bool = False) -> None:
    scope = TaskCancellation("bench")
    journal = Journal(store, try_number=1, scope=scope) if store is not None else None
    kwargs: dict[str, Any] = {"capabilities": [_NoOpHook()]} if hook_only else {}
    with scope.activate():
        result = run_agent_in_scope(scope, agent, "go", journal=journal, **kwargs)
    assert result.output == "done"


def _candidate(kind: str, agent: Any, tmp: str) -> Callable[[], None]:
    if kind == "hook":
        return functools.partial(_run, agent, None, True)
    store = MemoryStore() if kind == "memory" else PathStore(Path(tmp))
    return functools.partial(_run, agent, store)


def measure(kind: str, pairs: int = 100, warmup: int = 5) -> dict[str, Any]:
    agent = fifty_step_agent("async")
    counted = _Counting(MemoryStore())
    with tempfile.TemporaryDirectory(prefix="durable-bench-") as tmp:
        bare = functools.partial(_run, agent, None)
        bare_s, durable_s = interleaved(bare, lambda _: _candidate(kind, agent, tmp), pairs, warmup)
        if kind != "hook":
            counted = _Counting(MemoryStore() if kind == "memory" else PathStore(Path(tmp)))
            _run(agent, counted)
    diff = median_difference(durable_s, bare_s)
    sizes = counted.entry_bytes
    return {
        "store": kind,
        "steps": STEPS,
        "pairs": pairs,
        "bare_ms": round(statistics.median(bare_s) * 1000, 2),
        "durable_ms": round(statistics.median(durable_s) * 1000, 2),
        "overhead_ms": round(diff * 1000, 2),
        "per_step_ms": round(diff * 1000 / STEPS, 3),
        "entries": len(sizes),
        "bytes_total": sum(sizes),
        "bytes_per_step": round(sum(sizes) / STEPS),
        "bytes_first_step": sizes[1] if len(sizes) > 2 else 0,
        "bytes_last_step": sizes[-2] if len(sizes) > 2 else 0,
        "calls_per_step": round(counted.calls / STEPS, 2),
    }


_LABELS = {
    "hook": "control: a no-op after_node_run hook",
    "memory": "durable=True, in-memory store",
    "path": "durable=True, local files (durable_path)",
}


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        f"{STEPS}-step agent (pairs)",
        "bare (ms)",
        "compared (ms)",
        "per run (ms)",
        "per step (ms)",
        "bytes per step",
        "step 2 / step 49 (bytes)",
        "entries",
        "store calls per step",
    ]
    return markdown_table(
        header,
        (
            [
                f"{_LABELS[r['store']]} ({r['pairs']})",
                f"{r['bare_ms']:.2f}",
                f"{r['durable_ms']:.2f}",
                f"{r['overhead_ms']:.2f}",
                f"{r['per_step_ms']:.3f}",
                str(r["bytes_per_step"]),
                f"{r['bytes_first_step']} / {r['bytes_last_step']}",
                str(r["entries"]),
                f"{r['calls_per_step']:.2f}",
            ]
            for r in rows
        ),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100)
    args = parser.parse_args(argv)
    rows = [measure(kind, args.pairs) for kind in STORES]
    print(table(rows))


if __name__ == "__main__":
    main()
