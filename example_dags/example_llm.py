"""A plain LLM task: one prompt, one answer, written two ways (``LLMOperator`` and ``@task.llm``).

Runs anywhere with no API key: by default the tasks talk to pydantic-ai's keyless ``TestModel``
(model id ``test``), which answers at once without a network. To use a real model, create a
connection of type ``cancellable_agents_model`` (see docs/content/connections.md) and export
``CANCELLABLE_AGENTS_CONN=<its id>`` where the dag-processor and the workers run.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, task
from pydantic import BaseModel

from cancellable_agents import LLMOperator

# Read once at parse time: no connection or Variable lookups in top-level DAG code.
LLM_CONN_ID = os.environ.get("CANCELLABLE_AGENTS_CONN")
# ``None`` takes the model id from the connection; "test" is the keyless TestModel.
MODEL = None if LLM_CONN_ID else "test"


class Triage(BaseModel):
    """Structured output: the model must answer with these fields (validated by pydantic)."""

    severity: int
    summary: str


with DAG(
    dag_id="example_cancellable_llm",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["cancellable-agents", "example"],
):
    # The classic operator. ``prompt`` and ``system_prompt`` are templated.
    haiku = LLMOperator(
        task_id="haiku",
        prompt="Write a haiku about the data pipeline run of {{ ds }}.",
        system_prompt="You are a terse poet.",
        llm_conn_id=LLM_CONN_ID,
        model=MODEL,
    )

    # The TaskFlow way: the function returns the prompt, the task returns the model's answer.
    # With a pydantic ``output_type`` the XCom value is the validated object as a dict.
    @task.llm(llm_conn_id=LLM_CONN_ID, model=MODEL, output_type=Triage, system_prompt="Triage incidents.")
    def triage(report: str) -> str:
        return f"Triage this incident report and rate its severity from 1 to 5:\n\n{report}"

    @task
    def notify(result: dict) -> str:
        message = f"severity {result['severity']}: {result['summary']}"
        print(message)
        return message

    haiku >> notify(triage("db-1 is at 97% disk and growing 1%/hour"))
