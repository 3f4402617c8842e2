"""``durable=DurableOptions(...)``: how one operator keeps its continuity record.

``durable=True`` is ``DurableOptions()``. Options left ``None`` take the deployment's value from
Airflow's ``[cancellable_agents]`` config section (declared in ``provider.yaml``), so a platform
team tunes the fleet in one place and a DAG author overrides it for one task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DurableOptions"]


@dataclass(frozen=True)
class DurableOptions:
    """Keep a continuity record while runs go, so the next try of a killed task resumes where it
    stopped (``docs/content/durable.md``). Transcripts may hold sensitive data: off by default.

    :param path: keep the record under this ``ObjectStoragePath``, or a string such as
        ``"s3://bucket/agents"`` or ``"/shared/agents"`` (required on Airflow 3.1/3.2; default on
        3.3+: the task state store).
    :param resume_after_clear: resume also after a user's Clear (default: a Clear starts fresh).
    :param usage_limits_span_tries: the run's ``usage_limits`` count earlier tries too.
    :param flush_after: seconds a step's tool returns wait to be written with the next model
        response (one store call per step) before they are written alone; only a SIGKILL in that
        window reruns a tool that had returned. ``0``: at once (two calls per step). ``None``:
        ``[cancellable_agents] durable_flush_after`` (1 s).
    :param write_ahead: write each step before its tools start instead of while they run: a
        tool started just before a SIGKILL is then always known to the next try as a re-run, for
        one store round trip on every step's path. ``None``: ``[cancellable_agents]
        durable_write_ahead`` (``False``).
    :param batch_window: seconds a completed step's entry may wait for later steps to share its
        store call: at fleet scale every call is a round trip through Airflow's API server, which
        the fleet's heartbeats share (at 20 s a run of quick steps adds about one call per four
        of Airflow's 5 s heartbeats). A step that took more than half the window is stored as it
        completes (no later one would share the call), and 32 waiting steps go out without
        waiting for the rest. Only a SIGKILL in the window repeats its steps (never more than
        64); an unwind, the run's end and ``write_ahead`` store what waits at once. ``0``: as
        soon as no call is in flight. ``None``: ``[cancellable_agents] durable_batch_window``
        (20 s).
    """

    path: Any = None
    resume_after_clear: bool = False
    usage_limits_span_tries: bool = False
    flush_after: float | None = None
    write_ahead: bool | None = None
    batch_window: float | None = None

    def __post_init__(self) -> None:
        for name in ("flush_after", "batch_window"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and 0 <= value < math.inf):
                from cancellable_agents.core.exceptions import ConfigurationError

                raise ConfigurationError(f"DurableOptions({name}=...) must be >= 0 seconds, got {value!r}")

    @classmethod
    def of(cls, durable: bool | DurableOptions | None) -> DurableOptions | None:
        """``durable=`` as options: ``True`` is the defaults, ``False``/``None`` is off."""
        if isinstance(durable, DurableOptions):
            return durable
        if durable is None or durable is False:
            return None
        if durable is True:
            return cls()
        from cancellable_agents.core.exceptions import ConfigurationError

        raise ConfigurationError(f"durable= takes True, False or DurableOptions(...), got {durable!r}")
