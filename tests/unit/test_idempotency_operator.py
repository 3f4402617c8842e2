"""Idempotency keys through an operator: a task's tool calls derive their keys from its task
instance (DAG, task, run, map index), the order of its agent runs and its try."""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents import AgentOperator, current_tool_call
from cancellable_agents.run.tool_calls import RunIdentity, derive_key
from tests.unit.test_approval_operator import TI


def _key_of_the_call(ti: TI) -> str:
    """Run the task once for ``ti``; the key its one tool call saw."""
    keys: list[str] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("charge", {"cents": 500}, "call_0")])
        return ModelResponse(parts=[TextPart("charged")])

    def charge(cents: int) -> str:
        call = current_tool_call()
        assert call is not None
        keys.append(call.idempotency_key)
        return "ok"

    agent: Agent[None, str] = Agent(FunctionModel(script), tools=[charge])
    AgentOperator(task_id=ti.task_id, agent=agent, prompt="charge").execute({"ti": ti, "task_instance": ti})
    (key,) = keys
    return key


def test_a_tasks_calls_derive_their_keys_from_its_task_instance_and_try() -> None:
    first = _key_of_the_call(TI(map_index=0))
    assert first == derive_key(RunIdentity(("d", "agent", "manual__1", 0), "0", 1), 1, "call_0")
    assert _key_of_the_call(TI(map_index=0)) == first, "stable within the try: derived, not drawn"
    assert _key_of_the_call(TI(map_index=1)) != first, "another map index"
    assert _key_of_the_call(TI(run_id="manual__2", map_index=0)) != first, "another DAG run"
    assert _key_of_the_call(TI(try_number=2, map_index=0)) != first, "a retry of a run without a record"
