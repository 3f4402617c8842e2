"""The record's checks: a record that is not exactly what a try wrote (edited, missing an entry,
unparsable, a foreign header) is not resumed; the run starts fresh with one warning naming why."""

from __future__ import annotations

import json
import logging

import pytest

from cancellable_agents.durable import MemoryStore
from cancellable_agents.durable._record_format import RecordProblem, chain, load_record, segment_key
from tests.unit.durable_runs import RECORD, STEPS, Task, killed_at


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("edit", "does not match its checksum"),
        ("drop", "is missing"),
        ("garble", "does not parse"),
        ("head", "head"),
        ("format_1", "older version"),
    ],
)
def test_a_damaged_record_starts_fresh_with_one_warning(
    damage: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = killed_at(3)
    keys = [segment_key(RECORD, 1, j) for j in range(3)]
    if damage == "edit":  # entry 2 holds the return of step 2 (with response 3)
        assert "step 2 ok" in data[keys[2]]
        data[keys[2]] = data[keys[2]].replace("step 2 ok", "step 2 FAILED")
    elif damage == "drop":
        del data[keys[1]]
    elif damage == "garble":
        data[keys[2]] = '"not an entry"'
    elif damage == "head":
        data[keys[0]] = data[keys[0]].replace('"format": 3', '"format": 4')
    else:  # what an older version of this package left: a header key and entries per message
        data = {RECORD: json.dumps({"format": 1, "generation": "abc"}), f"{RECORD}.abc.0": "{}"}
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
    data = killed_at(3)
    fp = MemoryStore(data).get(segment_key(RECORD, 1, 0))["head"]["fingerprint"]
    one, two = segment_key(RECORD, 1, 1), segment_key(RECORD, 1, 2)
    data[one], data[two] = data[two], data[one]
    with pytest.raises(RecordProblem, match="entry 1 does not match its checksum"):
        load_record(MemoryStore(data), RECORD, 2, fp)


def test_a_first_try_reads_nothing_and_a_later_one_reads_back_to_the_newest_segment() -> None:
    """Try 4 finds try 1's record through try 3's and try 2's missing segments (they wrote
    nothing); try 1 itself never looks (no earlier try can have written)."""
    data = killed_at(3)
    fp = MemoryStore(data).get(segment_key(RECORD, 1, 0))["head"]["fingerprint"]
    assert load_record(MemoryStore(data), RECORD, 1, fp) is None
    loaded = load_record(MemoryStore(data), RECORD, 4, fp)
    assert loaded is not None and loaded.owner_try == 1 and loaded.segments == [[1, 3]]
    assert len(loaded.messages) == 6


def test_the_chain_depends_on_the_previous_hash_and_not_on_key_order() -> None:
    body = {"i": 1, "kind": "step", "try": 1}
    assert chain("a", body) == chain("a", dict(reversed(body.items())))
    assert chain("a", body) != chain("b", body)
