"""The provider's deployment settings: Airflow's ``[cancellable_agents]`` config section.

Declared in ``provider.yaml`` (``config:``, with description, type, default and example, so
``airflow config list`` shows them) and read through Airflow's ``conf``
(``AIRFLOW__CANCELLABLE_AGENTS__CANCELLATION_BUDGET=3`` and the like). An operator argument left
``None`` takes the deployment's value; one given wins. `OPTIONS` is the typed table the code
reads; a unit test holds it and ``provider.yaml`` to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from cancellable_agents.core.unwind import DEFAULT_BUDGET

SECTION = "cancellable_agents"


@dataclass(frozen=True)
class Option:
    """One option of the section: its type and the default used where the config has none."""

    kind: type[float] | type[bool]
    default: float | bool


OPTIONS: dict[str, Option] = {
    "cancellation_budget": Option(float, DEFAULT_BUDGET),
    "timeout_margin": Option(float, 2.0),
    #: Seconds before the run's deadline its wind-down starts; 0: off (a deployment turns it on).
    "wind_down": Option(float, 0.0),
    "classify_timeout": Option(float, 1.0),
    "durable_flush_after": Option(float, 1.0),
    "durable_write_ahead": Option(bool, False),
    "durable_batch_window": Option(float, 20.0),
    "genai_spans": Option(bool, False),
    "genai_span_content": Option(bool, False),
    #: Store each killed try's record for the Cancellations view (one bounded write).
    "store_cancellation_record": Option(bool, True),
}


def deployment_setting(name: str) -> float | bool:
    """``[cancellable_agents] <name>`` from Airflow's config, or its declared default.

    A value that is not of the option's type is refused with the option named (a typo in one
    worker's environment must not silently become the default).
    """
    option = OPTIONS[name]
    try:
        from airflow.configuration import conf
    except ImportError:  # pragma: no cover - Airflow is a dependency
        return option.default
    try:
        if option.kind is bool:
            return conf.getboolean(SECTION, name, fallback=option.default)
        return conf.getfloat(SECTION, name, fallback=option.default)
    except Exception as exc:  # AirflowConfigException, whose module moved between 3.1 and 3.3
        from cancellable_agents.core.exceptions import ConfigurationError

        env = f"AIRFLOW__{SECTION.upper()}__{name.upper()}"
        raise ConfigurationError(
            f"[{SECTION}] {name} must be a {option.kind.__name__} ({exc}); fix it in airflow.cfg or {env}"
        ) from exc
