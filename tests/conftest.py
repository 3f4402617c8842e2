"""Session-wide guard: a compatibility run must test the Airflow it was built for.

``make compat-airflow`` runs the suite in ``.venv-airflow-<major.minor>`` with
``CANCELLABLE_AGENTS_EXPECT_AIRFLOW=<major.minor>``. If the venv resolved to another Airflow
(a stale venv, a changed pin, uv picking a different release), every test could pass while
proving nothing about the version it claims to cover, so the session refuses to start.
``tests.airflow_versions`` is imported only when needed: it imports Airflow, which the
Airflow-free unit tests should not pay for.
"""

from __future__ import annotations

import os

import pytest

EXPECT_ENV = "CANCELLABLE_AGENTS_EXPECT_AIRFLOW"


def pytest_configure(config: pytest.Config) -> None:
    expected = os.environ.get(EXPECT_ENV, "").strip()
    if not expected:
        return
    from tests.airflow_versions import AIRFLOW_VERSION, major_minor

    if major_minor(AIRFLOW_VERSION) != major_minor(expected):
        raise pytest.UsageError(
            f"{EXPECT_ENV}={expected} but the installed Airflow is {AIRFLOW_VERSION}: "
            f"this run would test the wrong Airflow. Rebuild its venv: rm -rf .venv-airflow-{expected} "
            "and run `make compat-airflow` again."
        )


def pytest_report_header(config: pytest.Config) -> str:
    from tests.airflow_versions import installed_airflow

    return f"airflow: {installed_airflow()}"
