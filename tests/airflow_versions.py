"""Which Airflow the tests run on, and the skips that follow from it.

The provider supports Airflow 3.1+; retry policies (``airflow.sdk.definitions.retry_policy``)
exist only from 3.3. Tests that need them skip on older Airflow with this module's reason, and
the tests of the older-Airflow contract skip on 3.3+ (``make compat-airflow`` runs them).
The version comes from the installed distribution's metadata; the retry-policy check imports
Airflow (finding a submodule imports its parent packages), so import this module from tests,
not at conftest load.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

import pytest

#: Where retry policies live from Airflow 3.3 on.
RETRY_POLICY_MODULE = "airflow.sdk.definitions.retry_policy"


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


def has_retry_policies() -> bool:
    """True where ``airflow.sdk.definitions.retry_policy`` is importable (Airflow 3.3+)."""
    return importlib.util.find_spec(RETRY_POLICY_MODULE) is not None


#: Why a test of retry policies does not run here.
NO_RETRY_POLICIES = f"retry policies ({RETRY_POLICY_MODULE}) need Airflow 3.3+, this is {AIRFLOW_VERSION}"

requires_retry_policies = pytest.mark.skipif(not has_retry_policies(), reason=NO_RETRY_POLICIES)

only_without_retry_policies = pytest.mark.skipif(
    has_retry_policies(),
    reason=f"the Airflow < 3.3 contract; this is Airflow {AIRFLOW_VERSION}, `make compat-airflow` runs these",
)


def airflow_task_timeout() -> type[BaseException]:
    """The class the Task SDK raises on ``execution_timeout`` (SIGALRM).

    ``airflow.sdk.exceptions`` has it from 3.2; on 3.1 the Task SDK raises airflow-core's class.
    """
    try:
        from airflow.sdk.exceptions import AirflowTaskTimeout
    except ImportError:
        from airflow.exceptions import AirflowTaskTimeout  # type: ignore[no-redef]
    return AirflowTaskTimeout
