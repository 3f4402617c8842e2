"""Tool approval on the operators: refused at DAG parse time where the task could not wait without
a worker (``durable=False``, Airflow below 3.3), and on 3.3+ an execution that parks the task
(``TaskAwaitingInput`` with the Required Actions form) and one that continues after the answer,
as the Task SDK calls them (``execute``, then ``resume_execution`` with the form's event).

Runs on every supported Airflow (the compat venvs too). The form is written through the Task
SDK's supervisor channel, which a unit test does not have: that one call is captured here; the
end-to-end path (the REST API the UI uses) is for the e2e suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, Tool
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents import AgentOperator, DurableOptions
from cancellable_agents.airflow._adapter import has_task_awaiting_input
from cancellable_agents.airflow._approval import LATER_PAUSES_NOTE, RESUME_METHOD, decisions_from_event
from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.durable._pauses import ApprovalRequest, PendingCall
from tests.unit.durable_runs import TI

needs_3_3 = pytest.mark.skipif(not has_task_awaiting_input(), reason="TaskAwaitingInput is Airflow 3.3+")


@dataclass
class Counts:
    requests: int = 0
    sent: list[str] = field(default_factory=list)


def _agent(counts: Counts) -> Agent[None, str]:
    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        counts.requests += 1
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(
                parts=[
                    TextPart("The summary is ready."),
                    ToolCallPart("send", {"to": "lead"}, tool_call_id="s1"),
                ]
            )
        told = [
            p.content
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        ]
        return ModelResponse(parts=[TextPart(f"told: {told}")])

    def send(to: str) -> str:
        counts.sent.append(to)
        return f"sent to {to}"

    return Agent(FunctionModel(script), tools=[Tool(send, requires_approval=True)])


def _send_tool() -> Tool[Any]:
    return Tool(lambda to: to, name="send", requires_approval=True)


def test_requires_approval_without_durable_is_refused_at_parse_time() -> None:
    with pytest.raises(ConfigurationError, match=r"\['send'\] require approval.*durable=True"):
        AgentOperator(task_id="t", model="test", prompt="p", tools=[_send_tool()])
    with pytest.raises(ConfigurationError, match="durable=True"):
        AgentOperator(task_id="t", prompt="p", agent=_agent(Counts()))


def test_requires_approval_needs_airflow_3_3_and_says_so(tmp_path: Path) -> None:
    if has_task_awaiting_input():
        AgentOperator(task_id="t", model="test", prompt="p", tools=[_send_tool()], durable=True)
        return
    with pytest.raises(ConfigurationError, match=r"Airflow 3\.3"):
        AgentOperator(
            task_id="t",
            model="test",
            prompt="p",
            tools=[_send_tool()],
            durable=DurableOptions(path=str(tmp_path)),
        )


def test_tools_without_approval_are_not_checked() -> None:
    AgentOperator(task_id="t", model="test", prompt="p", tools=[Tool(lambda to: to, name="send")])


@needs_3_3
def test_the_task_parks_with_the_form_and_continues_from_the_record_after_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import TaskAwaitingInput
    from airflow.sdk.execution_time import hitl

    forms: list[dict[str, Any]] = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kwargs: forms.append(kwargs))
    counts = Counts()

    def operator() -> AgentOperator:
        return AgentOperator(
            task_id="agent", agent=_agent(counts), prompt="report", durable=DurableOptions(path=str(tmp_path))
        )

    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskAwaitingInput) as parked:
        operator().execute(context)
    assert parked.value.method_name == RESUME_METHOD
    (form,) = forms
    assert form["options"] == ["Approve", "Reject"] and form["defaults"] == ["Reject"]
    assert "The summary is ready." in form["body"] and '"to": "lead"' in form["body"]
    assert form["body"].endswith(LATER_PAUSES_NOTE), "a later pause in this try shows this form"
    assert form["params"]["arguments"]["value"] == {"to": "lead"}
    assert (counts.requests, counts.sent) == (1, [])

    # A new process runs the resumed task: a new operator, the answer in next_kwargs["event"].
    assert form["params"]["tool_call_id"]["value"] == "s1"
    answered = {"arguments": {"to": "chair"}, "message": None, "tool_call_id": "s1"}
    event = {"chosen_options": ["Approve"], "params_input": answered}
    output = operator().resume_execution(
        RESUME_METHOD, {**(parked.value.kwargs or {}), "event": event}, context
    )
    assert output == "told: ['sent to chair']"
    assert (counts.requests, counts.sent) == (2, ["chair"])


def test_arguments_from_a_form_made_for_an_earlier_call_are_not_applied() -> None:
    """Airflow keeps a task instance's first form for its later pauses: an approval answered on
    it approves the pending call with the model's arguments, never the earlier call's."""
    request = ApprovalRequest((PendingCall("c2", "send", {"n": 2}),), "", 1, "0")
    stale = {"arguments": {"n": 1}, "tool_call_id": "c1"}
    (decision,) = decisions_from_event(
        {"chosen_options": ["Approve"], "params_input": stale}, request
    ).values()
    assert decision.approved and decision.override_args is None
    assert decision.args == {"n": 2}, "bound to the arguments of the call the reviewer was shown"


def test_a_rejection_and_a_timeout_become_decisions() -> None:
    request = ApprovalRequest(
        (PendingCall("c1", "send", {"to": "x"}), PendingCall("c2", "pay", {})), "", 1, "0"
    )
    rejected = decisions_from_event(
        {"chosen_options": ["Reject"], "params_input": {"message": "not today"}}, request
    )
    assert {k: (d.approved, d.message) for k, d in rejected.items()} == {
        "c1": (False, "not today"),
        "c2": (False, "not today"),
    }
    timed_out = decisions_from_event(
        {"chosen_options": ["Reject"], "params_input": {}, "timedout": True}, request
    )
    assert all("in time" in (d.message or "") for d in timed_out.values())


@needs_3_3
def test_a_timeout_without_a_default_fails_the_task_for_good() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    request = ApprovalRequest((PendingCall("c1", "send", {"to": "x"}),), "", 1, "0")
    with pytest.raises(AirflowFailException, match=r"no answer to the approval of \['send'\]"):
        decisions_from_event({"error": "no response", "error_type": "timeout"}, request)


@needs_3_3
def test_the_try_that_waited_for_approval_stores_its_waits_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Cancellations view's facts: the approval wait (from the form to the answer) after the
    try's earlier waits, which the pause carries in its kwargs; one write, at the end of the try."""
    import time

    from airflow.sdk.exceptions import TaskAwaitingInput
    from airflow.sdk.execution_time import hitl

    from cancellable_agents.airflow.kill_record._stored import key_for_try
    from cancellable_agents.airflow.kill_record._try_facts import TryFacts
    from cancellable_agents.durable import MemoryStore

    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kwargs: None)
    counts, store = Counts(), MemoryStore()

    def operator() -> AgentOperator:
        return AgentOperator(
            task_id="agent", agent=_agent(counts), prompt="report", durable=DurableOptions(path=str(tmp_path))
        )

    context = {"ti": TI(), "task_instance": TI(), "task_state_store": store}
    before = time.time()
    with pytest.raises(TaskAwaitingInput) as parked:
        operator().execute(context)
    kwargs = dict(parked.value.kwargs or {})
    assert before <= kwargs["asked_at"] <= time.time() and kwargs["waits"] == []
    assert store.writes == 0
    # As an earlier pause of this try would have handed it on: a deferral's wait.
    earlier = {"kind": "deferred", "waited_s": 5.0, "calls": ["c0"], "timed_out": [], "ended_at": before}
    kwargs["waits"] = [earlier]
    event = {"chosen_options": ["Approve"], "params_input": {"tool_call_id": "s1"}}
    operator().resume_execution(RESUME_METHOD, {**kwargs, "event": event}, context)
    assert store.writes == 1
    facts = TryFacts.from_dict(store.get(key_for_try(1))["record"])
    first, approval = facts.waits
    assert (first.kind, first.waited_s) == ("deferred", 5.0)
    assert (approval.kind, approval.calls) == ("approval", ("send",))
    assert 0 <= approval.waited_s <= time.time() - kwargs["asked_at"]
