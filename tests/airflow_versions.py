"""Which Airflow the tests run on, and the skips that follow from it.

The provider supports Airflow 3.1+; retry policies (``airflow.sdk.definitions.retry_policy``)
exist only from 3.3. Tests that need them skip on older Airflow with this module's reason, and
the tests of the older-Airflow contract skip on 3.3+ (``make compat-airflow`` runs them).
The version comes from the installed distribution's metadata; the retry-policy check imports
Airflow (finding a submodule imports its parent packages), so import this module from tests,
not at conftest load. The facts themselves are the provider's (``cancellable_agents.airflow._adapter``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from cancellable_agents.airflow._adapter import (
    RETRY_POLICY_MODULE,
    has_retry_policies,
)
from cancellable_agents.airflow._adapter import (
    execution_timeout_type as airflow_task_timeout,
)


def installed_airflow() -> str:
    """The installed Airflow's version (``apache-airflow-core``; ``apache-airflow`` before the split)."""
    for dist in ("apache-airflow-core", "apache-airflow"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise RuntimeError("Airflow is not installed in this environment")


def major_minor(text: str) -> tuple[int, int]:
    """``"3.1.8"`` -> ``(3, 1)``; ``"3.2"`` -> ``(3, 2)``."""
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()))


AIRFLOW_VERSION = installed_airflow()


#: Why a test of retry policies does not run here.
NO_RETRY_POLICIES = f"retry policies ({RETRY_POLICY_MODULE}) need Airflow 3.3+, this is {AIRFLOW_VERSION}"

requires_retry_policies = pytest.mark.skipif(not has_retry_policies(), reason=NO_RETRY_POLICIES)

only_without_retry_policies = pytest.mark.skipif(
    has_retry_policies(),
    reason=f"the Airflow < 3.3 contract; this is Airflow {AIRFLOW_VERSION}, `make compat-airflow` runs these",
)

__all__ = [
    "AIRFLOW_VERSION",
    "NO_RETRY_POLICIES",
    "airflow_task_timeout",
    "has_retry_policies",
    "only_without_retry_policies",
    "requires_retry_policies",
]
