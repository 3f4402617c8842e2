"""Ten trivial DAGs: each run holds 1,000 stored records (benchmarks/cancellations_view.py)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

for i in range(10):
    with DAG(
        f"view_bench_{i}", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
    ):

        @task
        def noop() -> None:
            return None

        noop()
