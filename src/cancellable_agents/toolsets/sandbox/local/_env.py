"""The environment a sandboxed command gets: an allowlist of the task's, never a denylist.

A denylist of secret-looking names misses the rest (``DATABASE_URL``, ``MYSQL_PWD``,
``SENTRY_DSN``, ``REDIS_URL``, a cloud SDK's settings), so a command gets only what it needs to
run: ``PATH``, the locale (``LANG``, ``LC_*``), ``TERM``, ``TZ``, ``HOME`` set to its workdir,
what the sandbox sets itself, and what the DAG author passes explicitly (``env=``), which wins.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["PASSED_NAMES", "PASSED_PREFIXES", "is_sensitive", "scrubbed_environment"]

#: The task's variables a command gets as they are.
PASSED_NAMES: frozenset[str] = frozenset({"PATH", "LANG", "TERM", "TZ"})
#: ... and those whose names start with one of these (the locale categories).
PASSED_PREFIXES: tuple[str, ...] = ("LC_",)


def is_sensitive(name: str) -> bool:
    """Whether an environment variable is kept from commands unless passed explicitly: every
    name that is not on the allowlist."""
    return name not in PASSED_NAMES and not name.startswith(PASSED_PREFIXES)


def scrubbed_environment(
    base: Mapping[str, str], explicit: Mapping[str, str] | None = None, *, home: str | None = None
) -> dict[str, str]:
    """The allowlisted part of ``base``, ``HOME=home`` (when given), then everything in
    ``explicit`` (the DAG author's deliberate choice wins, ``HOME`` included)."""
    env = {name: value for name, value in base.items() if not is_sensitive(name)}
    if home is not None:
        env["HOME"] = home
    env.update(explicit or {})
    return env
