"""Where the continuity record is kept: the [`Store`][] protocol a
[`Journal`][cancellable_agents.durable._journal.Journal] writes to, and its implementations. Each
holds JSON values by key and survives the task's retries.

- [`TaskStateStore`][]: Airflow 3.3's ``context["task_state_store"]`` (AIP-103), per task
  instance, through the supervisor comms channel (so only from the main thread between steps,
  never from a signal handler; the channel's lock is not re-entrant).
- [`PathStore`][]: one JSON file per key under an ``ObjectStoragePath`` (local, ``s3://`` ...),
  for Airflow 3.1/3.2 (``durable_path=``), or by choice on 3.3; or under a ``pathlib.Path``.
- [`MemoryStore`][]: a dict, for tests and benchmarks.

A completed run's keys are dropped where listing them is cheap ([`ListableStore`][]:
``MemoryStore``, ``PathStore``); Airflow's task state store cannot list a task instance's keys and
its ``clear()`` would also drop other runs' records and the task's own keys, so there they stay
until ``[state_store] clear_on_success`` or ``default_retention_days`` removes them (unreachable:
the completed run's end entry tells every later try to start fresh).

Airflow-free: a ``durable_path=`` given as a string becomes an ``ObjectStoragePath`` in
[`cancellable_agents.airflow._durable_task`][], before it reaches [`PathStore`][].
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cancellable_agents.core.exceptions import ConfigurationError


class Store(Protocol):
    """A key-value store of JSON values that survives the task's retries. One that warns about
    values over a size has ``max_value_bytes`` (their JSON's length; absent or ``0``: no limit),
    and the journal keeps each of its calls under it where it can (an entry larger on its own
    still goes alone)."""

    def get(self, key: str) -> Any:
        """The value, or ``None`` if the key does not exist."""

    def set(self, key: str, value: Any) -> None: ...

    def delete(self, key: str) -> None:
        """Remove the key; no error if it does not exist."""


@runtime_checkable
class ListableStore(Store, Protocol):
    """A store that lists its keys without a round trip per key (a dict, a directory)."""

    def keys_under(self, prefix: str) -> list[str]:
        """Every key that is ``prefix`` or starts with ``prefix.``."""


@dataclass
class MemoryStore:
    """A dict of JSON values (each value is copied through JSON, as a real store would)."""

    data: dict[str, str] = field(default_factory=dict)
    writes: int = 0
    bytes_written: int = 0
    max_value_bytes: int = 0

    def get(self, key: str) -> Any:
        raw = self.data.get(key)
        return None if raw is None else json.loads(raw)

    def set(self, key: str, value: Any) -> None:
        raw = json.dumps(value)
        self.data[key] = raw
        self.writes += 1
        self.bytes_written += len(raw)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys_under(self, prefix: str) -> list[str]:
        return [k for k in self.data if k == prefix or k.startswith(f"{prefix}.")]


@dataclass
class TaskStateStore:
    """Airflow 3.3's task state store (``context["task_state_store"]``), scoped to the task instance.
    ``max_value_bytes``: Airflow's ``[state_store] max_value_storage_bytes`` (64 kB by default),
    above which every write logs Airflow's warning in the task log."""

    accessor: Any
    max_value_bytes: int = 0

    def get(self, key: str) -> Any:
        return self.accessor.get(key)

    def set(self, key: str, value: Any) -> None:
        self.accessor.set(key, value)

    def delete(self, key: str) -> None:
        self.accessor.delete(key)


@dataclass
class PathStore:
    """One JSON file per key under ``base``: an ``ObjectStoragePath``, or a ``pathlib.Path`` (a
    string is taken as a local path; a URL must come as an ``ObjectStoragePath``).

    Local files are written to a temporary name and renamed, so a kill mid-write leaves the old
    value or none; remote stores write whole objects. A file that does not parse reads back as
    what it is (the journal then starts fresh, naming why).
    """

    base: Any

    def __post_init__(self) -> None:
        self.base = _path(self.base)

    @classmethod
    def for_task(cls, root: Any, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> PathStore:
        """The store of one task instance under ``root`` (shared by all of its tries)."""
        base = _path(root) / _safe(dag_id) / _safe(run_id) / _safe(task_id)
        return cls(base / f"map_{map_index}" if map_index >= 0 else base)

    def _file(self, key: str) -> Any:
        return self.base / f"{_safe(key)}.json"

    def get(self, key: str) -> Any:
        path = self._file(key)
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"unparsable": raw[:200]}

    def set(self, key: str, value: Any) -> None:
        path = self._file(key)
        raw = json.dumps(value)
        if getattr(path, "protocol", "file") in ("file", "local", ""):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.tmp"
            tmp.write_text(raw)
            tmp.rename(path)
            return
        path.write_text(raw)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(key).unlink()

    def keys_under(self, prefix: str) -> list[str]:
        """The keys whose files are in ``base`` (keys are stored under their `_safe` form,
        which is the key itself for the journal's keys)."""
        safe = _safe(prefix)
        try:
            names = [p.name for p in self.base.iterdir()]
        except FileNotFoundError:
            return []
        keys = [n.removesuffix(".json") for n in names if n.endswith(".json") and not n.startswith(".")]
        return [k for k in keys if k == safe or k.startswith(f"{safe}.")]


def _path(value: Any) -> Any:
    """``value`` as a path object; a URL string is refused, because only Airflow's
    ``ObjectStoragePath`` reads one and this module stays Airflow-free."""
    if not isinstance(value, str):
        return value
    if "://" in value:
        raise ConfigurationError(
            f"PathStore: pass {value!r} as an ObjectStoragePath (a string is a local path)"
        )
    return Path(value)


def _safe(part: str) -> str:
    """A key or id as one path segment."""
    return "".join(c if c.isalnum() or c in "._-+=" else "_" for c in str(part)) or "_"
