"""The environment a sandboxed command gets: the task's, minus Airflow's settings and secrets."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["is_sensitive", "scrubbed_environment"]

_SCRUBBED_PREFIXES = ("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")
_SECRET_WORDS = ("API_KEY", "TOKEN", "SECRET", "PASSWORD")


def is_sensitive(name: str) -> bool:
    """Whether an environment variable is kept from commands unless passed explicitly."""
    upper = name.upper()
    return upper.startswith(_SCRUBBED_PREFIXES) or any(word in upper for word in _SECRET_WORDS)


def scrubbed_environment(
    base: Mapping[str, str], explicit: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` without Airflow settings, connections, variables and secret-looking names,
    plus everything in ``explicit`` (the DAG author's deliberate choice wins)."""
    env = {name: value for name, value in base.items() if not is_sensitive(name)}
    env.update(explicit or {})
    return env
