"""The record's checks: a record that is not exactly what a try wrote (edited, missing an entry,
unparsable, a foreign header) is not resumed; the run starts fresh with one warning naming why."""

from __future__ import annotations

import logging

import pytest

from cancellable_agents.durable import MemoryStore
from cancellable_agents.durable.record import KEY_PREFIX, RecordProblem, chain, load_record
from tests.unit.durable_runs import STEPS, Task, killed_at


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("edit", "does not match its checksum"),
        ("drop", "is missing"),
        ("garble", "does not parse"),
        ("header", "header"),
    ],
)
def test_a_damaged_record_starts_fresh_with_one_warning(
    damage: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = killed_at(7)
    keys = sorted((k for k in data if k.count(".") >= 4), key=lambda k: int(k.rsplit(".", 1)[1]))
    header_key = f"{KEY_PREFIX}.0"
    if damage == "edit":  # entry 4 holds the return of step 2
        assert "step 2 ok" in data[keys[4]]
        data[keys[4]] = data[keys[4]].replace("step 2 ok", "step 2 FAILED")
    elif damage == "drop":
        del data[keys[2]]
    elif damage == "garble":
        data[keys[5]] = '"not an entry"'
    else:
        data[header_key] = '{"format": 1}'
    task = Task()
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.durable"):
        result, journal, _ = task.run(MemoryStore(data), 2)
    assert result.output == "all done"
    assert journal.resume is None and task.script.requests == STEPS + 1, "must start fresh"
    warnings = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0], warnings


def test_an_entry_moved_to_another_place_breaks_the_chain() -> None:
    """Two entries swapped, each with its own valid hash, still fail: each hash covers the one
    before it."""
    data = killed_at(7)
    header = MemoryStore(data).get(f"{KEY_PREFIX}.0")
    base = f"{KEY_PREFIX}.0.{header['generation']}"
    data[f"{base}.1"], data[f"{base}.3"] = data[f"{base}.3"], data[f"{base}.1"]
    with pytest.raises(RecordProblem, match="step 1 does not match its checksum"):
        load_record(MemoryStore(data), f"{KEY_PREFIX}.0", header["fingerprint"])


def test_the_chain_depends_on_the_previous_hash_and_not_on_key_order() -> None:
    body = {"i": 1, "kind": "message", "try": 1}
    assert chain("a", body) == chain("a", dict(reversed(body.items())))
    assert chain("a", body) != chain("b", body)
