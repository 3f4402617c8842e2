"""HttpJobTrigger against a real job service on 127.0.0.1 (stdlib HTTP): the wait, the result, a
failed job, and the cancel a user's stop sends; and a deferred tool call through it end to end
in the operator (the trigger run as the triggerer runs it)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents import AgentOperator, DurableOptions, defer_to
from cancellable_agents.airflow.deferral import RESUME_METHOD
from cancellable_agents.airflow.http_job import HttpJobFailed, HttpJobTrigger
from cancellable_agents.airflow.triggers import import_callable
from tests.unit.durable_runs import TI
from tests.unit.test_deferral import _fire, needs_3_3


class JobService:
    """Jobs by id: ``GET /jobs/<id>`` their state, ``POST /jobs/<id>/cancel`` stops one."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.cancels: list[str] = []
        self.polls = 0
        self.polled_5 = threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                service.polls += 1
                if service.polls >= 5:
                    service.polled_5.set()
                job = service.jobs.get(self.path.rsplit("/", 1)[-1])
                self._answer(200 if job else 404, job or {"error": "no such job"})

            def do_POST(self) -> None:
                job_id = self.path.split("/")[-2]
                service.cancels.append(job_id)
                service.jobs[job_id] = {"state": "cancelled"}
                self._answer(202, {"state": "cancelling"})

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trigger(self, job_id: str) -> HttpJobTrigger:
        return HttpJobTrigger(
            f"{self.url}/jobs/{job_id}", cancel_url=f"{self.url}/jobs/{job_id}/cancel", interval=0.01
        )


@pytest.fixture
def service() -> Iterator[JobService]:
    running = JobService()
    yield running
    running.server.shutdown()
    running.server.server_close()


def _rebuilt(trigger: HttpJobTrigger) -> Any:
    """The trigger as the triggerer rebuilds it from what Airflow stored."""
    classpath, kwargs = trigger.serialize()
    json.dumps(kwargs)
    return import_callable(classpath)(**kwargs)


async def _first_event(trigger: Any, timeout: float = 10.0) -> Any:
    async def first() -> Any:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    return await asyncio.wait_for(first(), timeout)


def test_the_trigger_waits_while_the_job_runs_and_fires_with_its_result(service: JobService) -> None:
    service.jobs["j1"] = {"state": "running"}
    trigger = _rebuilt(service.trigger("j1"))

    async def scenario() -> Any:
        waiting = asyncio.ensure_future(_first_event(trigger))
        assert await asyncio.to_thread(service.polled_5.wait, 10)
        assert not waiting.done(), "five polls saw the job running: the wait goes on"
        service.jobs["j1"] = {"state": "SUCCEEDED", "result": {"rows": 3}}
        return await waiting

    assert asyncio.run(scenario()) == {"rows": 3}


def test_a_failed_job_ends_the_wait_with_its_state(service: JobService) -> None:
    service.jobs["j2"] = {"state": "failed", "reason": "out of memory"}
    with pytest.raises(HttpJobFailed, match=r"reports the job failed.*out of memory"):
        _fire(_rebuilt(service.trigger("j2")))


def test_a_users_stop_asks_the_job_service_to_cancel_the_job(service: JobService) -> None:
    service.jobs["j3"] = {"state": "running"}
    asyncio.run(_rebuilt(service.trigger("j3")).on_kill())
    assert service.cancels == ["j3"] and service.jobs["j3"]["state"] == "cancelled"


@needs_3_3
def test_a_deferred_call_gets_the_job_services_result(service: JobService, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    requests: list[int] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        requests.append(1)
        returned = [
            p.content
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        ]
        if returned:
            return ModelResponse(parts=[TextPart(f"rows: {returned[0]['rows']}")])
        return ModelResponse(parts=[ToolCallPart("count_rows", {"table": "orders"}, tool_call_id="c1")])

    def count_rows(table: str) -> dict[str, Any]:
        service.jobs[table] = {"state": "running"}
        defer_to(service.trigger(table))

    def operator() -> AgentOperator:
        return AgentOperator(
            task_id="agent",
            agent=Agent(FunctionModel(script), tools=[count_rows]),
            prompt="count the orders",
            durable=DurableOptions(path=str(tmp_path / "record")),
        )

    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskDeferred) as deferred:
        operator().execute(context)
    service.jobs["orders"] = {"state": "done", "result": {"rows": 12}}
    event = _fire(deferred.value.trigger)
    assert operator().resume_execution(RESUME_METHOD, {"event": event}, context) == "rows: 12"
    assert len(requests) == 2
