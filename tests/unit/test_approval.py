"""Tool approval in a durable run, without Airflow: the run stops where its model calls a tool that
requires approval, the record holds the pending calls, and the next execution continues from the
record with the reviewer's answers; nothing completed is requested or run twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.causes import CancelCause, CauseVerdict
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.durable import FreshStart, Journal, MemoryStore, current_resume
from cancellable_agents.durable._fingerprint import tools_requiring_approval
from cancellable_agents.durable._pauses import ApprovalRequest, AwaitingApproval, Decision
from cancellable_agents.durable._record_format import AWAITING, load_record
from cancellable_agents.run.runner import run_agent_in_scope
from tests.unit.durable_runs import RECORD


def _answer(messages: list[ModelMessage]) -> str:
    """The tool returns the model got, as the final text (so a test reads what it was told)."""
    returns = [
        f"{p.tool_name}={p.content}"
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    return "; ".join(returns)


@dataclass
class Script:
    """Response 1: look something up (no approval) and send it (approval); response 2: pay
    (approval); response 3: the final text, listing every tool return it was given."""

    requests: int = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        done = sum(isinstance(m, ModelResponse) for m in messages)
        if done == 0:
            return ModelResponse(
                parts=[
                    TextPart("The report is ready; it must go to the board."),
                    ToolCallPart("lookup", {"q": "board"}, tool_call_id="c1"),
                    ToolCallPart("send", {"to": "board@example.com"}, tool_call_id="c2"),
                ]
            )
        if done == 1:
            return ModelResponse(
                parts=[
                    TextPart("The vendor invoice is due."),
                    ToolCallPart("pay", {"amount": 900}, tool_call_id="c3"),
                ]
            )
        return ModelResponse(parts=[TextPart(_answer(messages))])


@dataclass
class Task:
    """One durable agent task; each :meth:`execute` is one execution (a try, or a try continued
    after a pause), its tool runs counted across them."""

    store: MemoryStore = field(default_factory=MemoryStore)
    script: Script = field(default_factory=Script)
    runs: list[tuple[str, dict[str, Any], bool]] = field(default_factory=list)
    cancel_in: str | None = None

    def agent(self) -> Agent[None, str]:
        agent: Agent[None, str] = Agent(FunctionModel(self.script), system_prompt="be brief")

        def record(ctx: RunContext[None], name: str, args: dict[str, Any]) -> None:
            resume = current_resume()
            self.runs.append((name, args, bool(resume and resume.is_rerun(ctx.tool_call_id))))
            scope = current_cancellation()
            if name == self.cancel_in and scope is not None:
                self.cancel_in = None
                verdict = CauseVerdict(CancelCause.EVICTION)
                scope.cancel(verdict.cause, classify=lambda: verdict)
                scope.wait(5)

        @agent.tool
        def lookup(ctx: RunContext[None], q: str) -> str:
            record(ctx, "lookup", {"q": q})
            return "3 members"

        @agent.tool(requires_approval=True)
        def send(ctx: RunContext[None], to: str) -> str:
            record(ctx, "send", {"to": to})
            return f"sent to {to}"

        @agent.tool(requires_approval=True)
        def pay(ctx: RunContext[None], amount: int) -> str:
            record(ctx, "pay", {"amount": amount})
            return f"paid {amount}"

        return agent

    def execute(self, try_number: int, answers: dict[str, Decision] | None = None) -> Any:
        """One execution: the run's output, the :class:`ApprovalRequest` it stopped at, or the
        :class:`TaskCancelled` it raised."""
        scope = TaskCancellation(f"try{try_number}")
        journal = Journal(self.store, try_number=try_number, scope=scope, answers=answers)
        with scope.activate():
            try:
                return run_agent_in_scope(scope, self.agent(), "send the report", journal=journal).output
            except AwaitingApproval as paused:
                return paused.request
            except TaskCancelled as exc:
                return exc

    def ran(self, name: str) -> int:
        return sum(1 for n, _, _ in self.runs if n == name)


def test_a_run_stops_at_each_approval_and_continues_from_the_record_with_the_answers() -> None:
    task = Task()
    first = task.execute(1)
    assert isinstance(first, ApprovalRequest)
    assert [(c.tool_name, c.args) for c in first.calls] == [("send", {"to": "board@example.com"})]
    assert first.reason == "The report is ready; it must go to the board."
    # The call that needed no approval ran; the one that does did not.
    assert (task.script.requests, task.ran("lookup"), task.ran("send")) == (1, 1, 0)

    second = task.execute(1, {"c2": Decision(True, override_args={"to": "chair@example.com"})})
    assert isinstance(second, ApprovalRequest)
    assert [(c.tool_name, c.args) for c in second.calls] == [("pay", {"amount": 900})]
    assert second.reason == "The vendor invoice is due."
    assert (task.script.requests, task.ran("lookup"), task.ran("send")) == (2, 1, 1)
    assert task.runs[1] == ("send", {"to": "chair@example.com"}, False)  # the reviewer's arguments

    output = task.execute(1, {"c3": Decision(False, "over budget: ask finance")})
    assert output == "lookup=3 members; send=sent to chair@example.com; pay=over budget: ask finance"
    assert (task.script.requests, task.ran("lookup"), task.ran("send"), task.ran("pay")) == (3, 1, 1, 0)


def test_the_paused_record_is_not_a_completed_one_and_a_later_try_without_answers_waits_again() -> None:
    task = Task()
    first = task.execute(1)
    assert isinstance(first, ApprovalRequest)
    loaded = load_record(task.store, RECORD, 2, _fingerprint(task))
    assert loaded is not None and loaded.entries[-1]["state"] == AWAITING
    keys = dict(task.store.data)
    # A new try (say the waiting task was cleared with resume_after_clear) asks again: no model
    # request, no tool, nothing written.
    again = task.execute(2)
    assert again == first
    assert (task.script.requests, len(task.runs), task.store.data) == (1, 1, keys)
    # ... and its continuation takes the answer into a segment of its own.
    assert isinstance(task.execute(2, {"c2": Decision(True)}), ApprovalRequest)
    assert (task.script.requests, task.ran("send")) == (2, 1)
    assert any(key.startswith(f"{RECORD}.try2.") for key in task.store.data)


def test_a_kill_while_the_approved_tool_runs_resumes_with_the_recorded_answer() -> None:
    """The answer is in the record before the approved call runs, so the next try of a task
    evicted during that call runs it again (at-least-once, and it knows) without asking again."""
    task = Task(cancel_in="send")
    task.execute(1)
    killed = task.execute(1, {"c2": Decision(True)})
    assert isinstance(killed, TaskCancelled) and killed.cause is CancelCause.EVICTION
    request = task.execute(2)  # no answers: they come from the record
    assert isinstance(request, ApprovalRequest) and [c.tool_name for c in request.calls] == ["pay"]
    assert [r for r in task.runs if r[0] == "send"] == [
        ("send", {"to": "board@example.com"}, False),
        ("send", {"to": "board@example.com"}, True),
    ]
    assert (task.script.requests, task.ran("lookup")) == (2, 1)


def test_an_answer_for_other_arguments_asks_again_and_one_for_these_goes_on() -> None:
    """An approval is bound to the arguments the reviewer saw: if the run would make the call
    (same tool call id) with others, nothing runs and the run asks again, with its own."""
    task = Task()
    first = task.execute(1)
    assert isinstance(first, ApprovalRequest)
    elsewhere = {"c2": Decision(True, args={"to": "everyone@example.com"})}
    again = task.execute(1, elsewhere)
    assert again == first, "asked again, with the arguments the run would call with"
    assert (task.script.requests, task.ran("send")) == (1, 0)
    bound = task.execute(1, {"c2": Decision(True, args={"to": "board@example.com"})})
    assert isinstance(bound, ApprovalRequest) and [c.tool_name for c in bound.calls] == ["pay"]
    assert task.runs[-1] == ("send", {"to": "board@example.com"}, False)


def test_a_decision_keeps_the_arguments_it_answered_through_the_record() -> None:
    decision = Decision(True, args={"to": "board@example.com"})
    assert Decision.from_dict(decision.as_dict()) == decision
    assert Decision.from_dict({"approved": False}) == Decision(False)


def test_a_cleared_waiting_task_starts_fresh() -> None:
    task = Task()
    scope = TaskCancellation("try1")
    journal = Journal(task.store, try_number=1, scope=scope, clear_count=0)
    with scope.activate(), pytest.raises(AwaitingApproval):
        run_agent_in_scope(scope, task.agent(), "send the report", journal=journal)
    cleared = Journal(task.store, try_number=2, scope=TaskCancellation("try2"), clear_count=1)
    with pytest.raises(AwaitingApproval):
        run_agent_in_scope(cleared.scope, task.agent(), "send the report", journal=cleared)  # type: ignore[arg-type]
    assert cleared.fresh_start is FreshStart.USER_STOP
    assert task.script.requests == 2  # asked the model again: a Clear is a fresh start


def test_tools_requiring_approval_are_found_on_tools_toolsets_and_agents() -> None:
    assert tools_requiring_approval(agent=Task().agent()) == ["send", "pay"]
    assert tools_requiring_approval(agent=Agent(FunctionModel(Script()))) == []


def _fingerprint(task: Task) -> str:
    from cancellable_agents.durable import fingerprint

    return fingerprint(task.agent(), "send the report", {})
