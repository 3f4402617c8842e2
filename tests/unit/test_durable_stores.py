"""The stores the record is kept in, without Airflow."""

from __future__ import annotations

from pathlib import Path

import pytest

from cancellable_agents.durable import PathStore


def test_a_path_store_keeps_json_values_in_files_under_its_task(tmp_path: Path) -> None:
    store = PathStore.for_task(str(tmp_path), "dag/1", "run 1", "task", map_index=2)
    assert store.get("k") is None
    store.set("k", {"a": [1, 2]})
    assert store.get("k") == {"a": [1, 2]}
    assert [p.name for p in (tmp_path / "dag_1" / "run_1" / "task" / "map_2").iterdir()] == ["k.json"]
    store.delete("k")
    store.delete("k")  # no error for a key that is gone
    assert store.get("k") is None


def test_a_path_store_lists_the_keys_of_one_record(tmp_path: Path) -> None:
    store = PathStore(tmp_path)
    assert store.keys_under("r.0") == []
    for key in ("r.0", "r.0.try1.0", "r.0.try2.3", "r.01.try1.0", "other"):
        store.set(key, {})
    assert sorted(store.keys_under("r.0")) == ["r.0", "r.0.try1.0", "r.0.try2.3"]
    assert PathStore(tmp_path / "absent").keys_under("r.0") == []


def test_a_file_that_does_not_parse_reads_back_as_what_it_is(tmp_path: Path) -> None:
    store = PathStore(tmp_path)
    (tmp_path / "k.json").write_text("{not json")
    assert store.get("k") == {"unparsable": "{not json"}


def test_a_url_string_is_refused_not_taken_for_a_local_path() -> None:
    with pytest.raises(ValueError, match="ObjectStoragePath"):
        PathStore("s3://bucket/agents")
