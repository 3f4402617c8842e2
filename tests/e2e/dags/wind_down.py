"""DAGs for the wind-down e2e test (issue 41): one agent task whose model keeps calling its tool
for as long as it is offered (the scripted server's ``loop``), under ``execution_timeout=40s``.

``e2e_wind_down``: ``wind_down=15``: at 40 - 2 - 15 s the next request offers no tools and the
model answers; the task ends success with that answer in XCom.
``e2e_wind_down_off``: the same without ``wind_down``: killed at the run's deadline, failed as
``timeout`` (``retries=0``, so it ends there).
``e2e_wind_down_slow``: ``wind_down=15``, but the final answer takes 60 s: the test marks the task
failed while it waits for it (failed, ``user``, no retry although ``retries=1``).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import DAG

from cancellable_agents import AgentOperator

CONN_ID = "local_model"
PROMPT = "[{{ dag.dag_id }}/{{ run_id }}/try{{ ti.try_number }}] work until told to stop"
EXECUTION_TIMEOUT_S = 40
WIND_DOWN_S = 15


def work(n: int) -> str:
    """One step of work (a second: 40 s hold fewer than pydantic-ai's default 50 requests, so the
    run without wind-down meets its deadline, not its request limit), as often as asked for."""
    time.sleep(1.0)
    return f"result {n}"


def _dag(dag_id: str, model: str, retries: int, **agent: Any) -> DAG:
    with DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        is_paused_upon_creation=False,
        tags=["e2e"],
    ) as dag:
        AgentOperator(
            task_id="agent",
            prompt=PROMPT,
            model=model,
            llm_conn_id=CONN_ID,
            tools=[work],
            execution_timeout=timedelta(seconds=EXECUTION_TIMEOUT_S),
            retries=retries,
            retry_delay=timedelta(seconds=2),
            **agent,
        )
    return dag


wound = _dag("e2e_wind_down", "openai:loop?name=work", 1, wind_down=WIND_DOWN_S)
killed = _dag("e2e_wind_down_off", "openai:loop?name=work", 0)
slow = _dag("e2e_wind_down_slow", "openai:loop?name=work&final_delay=60", 1, wind_down=WIND_DOWN_S)
