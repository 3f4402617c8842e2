"""A failover chain from connections (``fallback_conn_ids``): two real scripted servers, real HTTP,
a real cancel of the run's scope. A kill stops the chain, the record names the model in flight,
and a run that failed over stays with the model that answered (also across a durable resume,
whose history is the journaled messages)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import ConfigurationError, TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.durable import Journal, MemoryStore
from cancellable_agents.hooks.model import ModelHook
from cancellable_agents.run._failover import ANSWERED_BY, Failover, answered_by, failover
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.testing.openai_server import ScriptedModelServer

#: The primary's answer never comes: one token, a minute after the request.
HANGS = "openai:slow?tokens=1&delay=60"


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedModelServer, ScriptedModelServer]]:
    with ScriptedModelServer() as primary, ScriptedModelServer() as backup:
        yield primary, backup


def _connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: object) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


def _chain(
    monkeypatch: pytest.MonkeyPatch, primary: ScriptedModelServer, backup: ScriptedModelServer, model: str
) -> Failover:
    _connection(
        monkeypatch,
        "primary",
        conn_type="cancellable_agents_model",
        host=primary.base_url,
        schema=model,
        extra={"fallback_conn_ids": ["backup"]},
    )
    _connection(
        monkeypatch,
        "backup",
        conn_type="cancellable_agents_model",
        host=backup.base_url,
        schema="openai:echo",
    )
    chain = ModelHook(llm_conn_id="primary").get_model()
    assert isinstance(chain, Failover)
    assert [m.member for m in chain.members] == ["primary", "backup"]
    return chain


def test_a_model_that_is_down_fails_over_to_the_next(
    monkeypatch: pytest.MonkeyPatch, servers: tuple[ScriptedModelServer, ScriptedModelServer]
) -> None:
    primary, backup = servers
    chain = _chain(monkeypatch, primary, backup, "openai:no-such-behaviour")  # answered with a 400
    result = Agent(chain).run_sync("hello")
    assert result.output == "echo: hello"
    assert primary.request_count == 1 and backup.request_count == 1
    assert answered_by(result.all_messages()) == "backup"


def test_a_kill_during_a_fallback_request_stops_the_chain_and_names_the_model_in_flight(
    monkeypatch: pytest.MonkeyPatch, servers: tuple[ScriptedModelServer, ScriptedModelServer]
) -> None:
    primary, backup = servers
    chain = _chain(monkeypatch, primary, backup, HANGS)
    scope = TaskCancellation()
    reached = threading.Event()

    def kill_once_the_primary_is_asked() -> None:
        if primary.wait_for_request(1, timeout=30):
            reached.set()
            scope.cancel(CancelCause.USER)

    threading.Thread(target=kill_once_the_primary_is_asked, daemon=True).start()
    with pytest.raises(TaskCancelled) as info:
        run_agent_in_scope(scope, Agent(chain), "go")
    assert reached.is_set()
    assert info.value.cause is CancelCause.USER
    record = primary.wait_for_disconnect(timeout=5)
    assert record is not None, "the primary's request was not closed"
    assert backup.request_count == 0, "the chain moved on to the next model after the kill"
    in_flight = [e.detail for e in scope.timeline if e.event == "model_request"]
    assert in_flight == [{"model": "primary", "failover_position": 0}]


def test_the_chain_stays_with_the_model_that_answered_across_a_resume(
    monkeypatch: pytest.MonkeyPatch, servers: tuple[ScriptedModelServer, ScriptedModelServer]
) -> None:
    primary, backup = servers
    chain = _chain(monkeypatch, primary, backup, "openai:no-such-behaviour")
    first = Agent(chain).run_sync("one")
    # The durable journal stores the messages as pydantic-ai serializes them; the resumed try
    # reads them back as its history.
    journaled = ModelMessagesTypeAdapter.validate_json(
        ModelMessagesTypeAdapter.dump_json(first.all_messages())
    )
    assert answered_by(journaled) == "backup"
    primary.reset()
    backup.reset()
    resumed = ModelHook(llm_conn_id="primary").get_model()
    second = Agent(resumed).run_sync("two", message_history=journaled)
    assert second.output == "echo: two"
    assert primary.request_count == 0, "the resumed run went back to the model that had failed"
    assert backup.request_count == 1
    assert second.all_messages()[-1].provider_details[ANSWERED_BY] == "backup"  # type: ignore[union-attr]


def test_a_chain_lists_each_connection_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _connection(
        monkeypatch,
        "loop",
        conn_type="cancellable_agents_model",
        schema="test",
        extra={"fallback_conn_ids": ["loop"]},
    )
    with pytest.raises(ConfigurationError, match="listed twice"):
        ModelHook(llm_conn_id="loop").get_model()


def test_the_operator_argument_overrides_the_connection_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    _connection(
        monkeypatch,
        "chained",
        conn_type="cancellable_agents_model",
        schema="test",
        extra={"fallback_conn_ids": ["missing"]},
    )
    assert not isinstance(ModelHook(llm_conn_id="chained", fallback_conn_ids=[]).get_model(), Failover)
    with pytest.raises(ConfigurationError, match="'missing' not found"):
        ModelHook(llm_conn_id="chained").get_model()


class Flaky:
    """A FunctionModel script that fails as a provider outage does (a 503) while ``down``, else
    calls ``step`` once per response for three steps, then answers; counts its requests."""

    def __init__(self, down: bool) -> None:
        self.down = down
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.down:
            raise ModelHTTPError(503, "flaky", {"error": "overloaded"})
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done < 3:
            return ModelResponse(parts=[ToolCallPart("step", {"n": done + 1})])
        return ModelResponse(parts=[TextPart("all done")])


def test_a_durable_resume_keeps_using_the_model_that_answered() -> None:
    """Try 1: the primary is down, the backup answers, the worker is evicted in step 2. Try 2
    resumes from the journal with the primary back up: the backup is asked, not the primary."""
    primary, backup = Flaky(down=True), Flaky(down=False)
    chain = failover([("primary", FunctionModel(primary)), ("backup", FunctionModel(backup))])
    store = MemoryStore()

    def one_try(try_number: int, kill_in_step: int | None) -> object:
        agent: Agent[None, str] = Agent(chain)

        @agent.tool_plain
        def step(n: int) -> str:
            scope = current_cancellation()
            if n == kill_in_step and scope is not None:  # an eviction: the next try resumes
                scope.cancel(CancelCause.EVICTION)
                scope.wait(5)
            return f"step {n} ok"

        scope = TaskCancellation(f"try{try_number}")
        journal = Journal(store, try_number=try_number, scope=scope)
        with scope.activate():
            try:
                return run_agent_in_scope(scope, agent, "three steps", journal=journal)
            except TaskCancelled as exc:
                return exc

    assert isinstance(one_try(1, kill_in_step=2), TaskCancelled)
    assert backup.requests == 2
    primary.down = False
    asked_before = primary.requests
    result = one_try(2, kill_in_step=None)
    assert getattr(result, "output", None) == "all done", result
    assert primary.requests == asked_before, "the resumed run went back to the primary"


def test_a_streamed_answer_names_its_model_too(
    monkeypatch: pytest.MonkeyPatch, servers: tuple[ScriptedModelServer, ScriptedModelServer]
) -> None:
    primary, backup = servers
    chain = _chain(monkeypatch, primary, backup, "openai:no-such-behaviour")

    async def stream() -> list[ModelMessage]:
        async with Agent(chain).run_stream("hello") as result:
            assert await result.get_output() == "echo: hello"
        return result.all_messages()

    assert answered_by(asyncio.run(stream())) == "backup"
    assert backup.requests[0].stream


def test_a_common_ai_chain_works_unchanged_forwarding_a_bare_model_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """common.ai's Azure connections as they are: the fallback names no model and takes the
    primary's bare name on its own platform; the primary refuses its key (401), the fallback answers."""
    with ScriptedModelServer(api_key="primary-key") as primary, ScriptedModelServer() as dr:
        _connection(
            monkeypatch,
            "pydanticai_azure_default",
            conn_type="pydanticai_azure",
            host=primary.url + "/openai/v1",
            password="an-expired-key",
            extra={"model": "echo", "fallback_conn_ids": ["azure_dr"]},
        )
        _connection(
            monkeypatch, "azure_dr", conn_type="pydanticai_azure", host=dr.url + "/openai/v1", password="k"
        )
        chain = ModelHook(llm_conn_id="pydanticai_azure_default").get_model()
        result = Agent(chain).run_sync("hi")
        assert result.output == "echo: hi"
        assert [r.model for r in dr.requests] == ["echo"]
        assert answered_by(result.all_messages()) == "azure_dr"
