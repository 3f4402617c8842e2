"""Deferred tool calls (issue 33, item 1 and 3): a tool starts outside work and defers to a
trigger; the durable run stops at that step, the task defers (``TaskDeferred``), and the
resumed task continues the run from its record with the trigger's event as the call's result:
no model request repeats, no tool runs again. Refusals name the fix.

The operator is driven the way the Task SDK drives it (``execute``, then ``resume_execution``
with the event); the trigger runs here on an event loop, as the triggerer would run it. The real
task process and the inline triggerer of ``dag.test()``: tests/process/test_deferral_process.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
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

from cancellable_agents import AgentOperator, DurableOptions, PollTrigger, defer_to
from cancellable_agents.airflow._adapter import has_trigger_on_kill
from cancellable_agents.airflow.deferral import RESUME_METHOD, answers_from_event
from cancellable_agents.airflow.triggers import DeferredCallsTrigger
from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.testing import jobs as deferred_jobs
from tests.unit.durable_runs import TI

needs_3_3 = pytest.mark.skipif(not has_trigger_on_kill(), reason="a trigger's on_kill is Airflow 3.3+")


@dataclass
class Counts:
    requests: int = 0
    started: list[str] = field(default_factory=list)


def _agent(
    counts: Counts, root: Path, jobs: tuple[str, ...] = ("j1",), trigger: Any = None
) -> Agent[None, str]:
    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        counts.requests += 1
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(
                parts=[TextPart("Starting.")]
                + [ToolCallPart("run_job", {"job": j}, tool_call_id=f"c-{j}") for j in jobs]
            )
        returned = [
            p.content
            for m in messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        ]
        return ModelResponse(parts=[TextPart(f"results: {json.dumps(returned, sort_keys=True)}")])

    def run_job(job: str) -> str:
        counts.started.append(job)
        deferred_jobs.start(str(root), job)
        defer_to(
            trigger
            or PollTrigger(
                "cancellable_agents.testing.jobs.status",
                {"root": str(root), "job": job},
                interval=0.01,
                cancel="cancellable_agents.testing.jobs.cancel",
            )
        )

    return Agent(FunctionModel(script), tools=[run_job])


def _operator(agent: Agent[None, str], root: Path, durable: Any = True) -> AgentOperator:
    return AgentOperator(
        task_id="agent",
        agent=agent,
        prompt="run the jobs",
        durable=DurableOptions(path=str(root / "record")) if durable is True else durable,
    )


def _fire(trigger: Any, timeout: float = 10.0) -> Any:
    """Run ``trigger`` as the triggerer does, until its first event (bounded)."""

    async def first() -> Any:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


@needs_3_3
def test_a_deferred_call_frees_the_task_and_its_result_comes_from_the_trigger(tmp_path: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    counts = Counts()
    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskDeferred) as deferred:
        _operator(_agent(counts, tmp_path), tmp_path).execute(context)
    assert deferred.value.method_name == RESUME_METHOD
    trigger = deferred.value.trigger
    assert isinstance(trigger, DeferredCallsTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "cancellable_agents.airflow.triggers.DeferredCallsTrigger"
    json.dumps(kwargs)  # what Airflow stores for the triggerer
    assert (counts.requests, counts.started) == (1, ["j1"])

    deferred_jobs.finish(str(tmp_path), "j1", {"rows": 42})
    event = _fire(trigger)
    # A new process runs the resumed task: a new operator; dag.test() hands it the event alone.
    resumed = _operator(_agent(counts, tmp_path), tmp_path)
    output = resumed.resume_execution(RESUME_METHOD, {"event": event}, context)
    assert output == 'results: [{"rows": 42}]'
    assert (counts.requests, counts.started) == (2, ["j1"]), "no request repeated, the job started once"
    assert resumed.cancellation.attached["deferred"]["calls"] == ["c-j1"], "the try's facts name the wait"


@needs_3_3
def test_several_deferred_calls_of_one_step_all_wait(tmp_path: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    counts = Counts()
    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskDeferred) as deferred:
        _operator(_agent(counts, tmp_path, jobs=("a", "b")), tmp_path).execute(context)
    deferred_jobs.finish(str(tmp_path), "a", "A")

    async def not_before_both() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(deferred.value.trigger.run()), 0.2)

    asyncio.run(not_before_both())
    deferred_jobs.finish(str(tmp_path), "b", "B")
    event = _fire(deferred.value.trigger)
    assert event["results"] == {"c-a": "A", "c-b": "B"}
    output = _operator(_agent(counts, tmp_path, jobs=("a", "b")), tmp_path).resume_execution(
        RESUME_METHOD, {"event": event}, context
    )
    assert output == 'results: ["A", "B"]'
    assert (counts.requests, sorted(counts.started)) == (2, ["a", "b"])


@needs_3_3
def test_a_retry_of_a_task_that_failed_while_deferred_waits_again_without_running_the_tool(
    tmp_path: Path,
) -> None:
    """A deferral that timed out (Airflow fails the try) is waited on again by the next try from
    the record: the outside work is not started a second time, the model is not asked again."""
    from airflow.sdk.exceptions import TaskDeferred

    counts = Counts()
    with pytest.raises(TaskDeferred):
        _operator(_agent(counts, tmp_path), tmp_path).execute({"ti": TI(), "task_instance": TI()})
    retry = {"ti": TI(try_number=2), "task_instance": TI(try_number=2)}
    with pytest.raises(TaskDeferred) as again:
        _operator(_agent(counts, tmp_path), tmp_path).execute(retry)
    assert (counts.requests, counts.started) == (1, ["j1"])
    deferred_jobs.finish(str(tmp_path), "j1", 7)
    output = _operator(_agent(counts, tmp_path), tmp_path).resume_execution(
        RESUME_METHOD, {"event": _fire(again.value.trigger)}, retry
    )
    assert output == "results: [7]" and (counts.requests, counts.started) == (2, ["j1"])


@needs_3_3
def test_after_a_clear_while_deferred_a_resumed_run_starts_the_work_again(tmp_path: Path) -> None:
    """With ``resume_after_clear``, the try after a Clear of the deferred task continues the run,
    but the wait it stopped at is void (the Clear ran the trigger's ``on_kill``: the work was
    stopped): the deferred call runs again and defers to its new work; the model is not asked
    again."""
    from airflow.sdk.exceptions import TaskDeferred

    counts = Counts()
    options = DurableOptions(path=str(tmp_path / "record"), resume_after_clear=True)

    def context(try_number: int, clears: int) -> dict[str, Any]:
        ti = TI(try_number=try_number)
        return {"ti": ti, "task_instance": ti, "dag_run": SimpleNamespace(clear_number=clears)}

    with pytest.raises(TaskDeferred):
        _operator(_agent(counts, tmp_path), tmp_path, options).execute(context(1, 0))
    deferred_jobs.cancel(str(tmp_path), "j1")  # what the Clear's on_kill did
    with pytest.raises(TaskDeferred) as again:
        _operator(_agent(counts, tmp_path), tmp_path, options).execute(context(2, 1))
    assert (counts.requests, counts.started) == (1, ["j1", "j1"]), "the tool ran again, not the model"
    assert deferred_jobs.state_of(str(tmp_path), "j1") == "running"
    deferred_jobs.finish(str(tmp_path), "j1", 9)
    output = _operator(_agent(counts, tmp_path), tmp_path, options).resume_execution(
        RESUME_METHOD, {"event": _fire(again.value.trigger)}, context(2, 1)
    )
    assert output == "results: [9]" and counts.requests == 2


@needs_3_3
def test_on_kill_stops_the_outside_work_still_waited_on(tmp_path: Path) -> None:
    deferred_jobs.start(str(tmp_path), "j1")
    poll = PollTrigger(
        "cancellable_agents.testing.jobs.status",
        {"root": str(tmp_path), "job": "j1"},
        0.01,
        "cancellable_agents.testing.jobs.cancel",
    )
    classpath, kwargs = poll.serialize()
    trigger = DeferredCallsTrigger(
        "0", [{"tool_call_id": "c", "tool": "run_job", "classpath": classpath, "kwargs": kwargs}], 0.0
    )

    async def killed_while_waiting() -> None:
        waiting = asyncio.ensure_future(anext(trigger.run()))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await trigger.on_kill()  # the triggerer: a user marked the deferred task failed
        waiting.cancel()
        await trigger.cleanup()

    asyncio.run(killed_while_waiting())
    assert deferred_jobs.state_of(str(tmp_path), "j1") == "cancelled"


@needs_3_3
def test_a_stop_slower_than_the_triggerers_loop_is_not_cut_off_by_its_repeated_cancel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Airflow 3.3's triggerer cancels a trigger a user stopped once per loop (1 s) until it has
    ended, its ``on_kill`` included; the stop must still reach the job. Run here by Airflow's own
    ``TriggerRunner`` (``run_trigger``, ``cleanup_finished_triggers``, ``cancel_triggers``), with
    the supervisor's part played as it is: the trigger's id in every sync's ``to_cancel`` until
    the trigger is finished. The job's cancel call answers after 3 such loops."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner

    monkeypatch.setenv("AIRFLOW_DISABLE_GREENBACK_PORTAL", "true")  # no sync calls from this trigger
    root, loop_s = str(tmp_path), 0.2
    deferred_jobs.start(root, "j1")
    classpath, kwargs = PollTrigger(
        "cancellable_agents.testing.jobs.status",
        {"root": root, "job": "j1", "answer_s": 3 * loop_s},
        0.01,
        "cancellable_agents.testing.jobs.acancel",
    ).serialize()
    trigger = DeferredCallsTrigger(
        "0", [{"tool_call_id": "c", "tool": "run_job", "classpath": classpath, "kwargs": kwargs}], 0.0
    )

    async def stopped_by_a_user() -> int:
        ours = asyncio.all_tasks()
        runner = TriggerRunner()
        runner.triggers[1] = {"task": None, "is_watcher": False, "name": "agent (ID 1)", "events": 0}
        runner.triggers[1]["task"] = asyncio.create_task(runner.run_trigger(1, trigger))
        while deferred_jobs.last_polled(root, "j1") is None:
            await asyncio.sleep(0.01)
        cancels = 0
        while 1 in runner.triggers:
            await runner.cleanup_finished_triggers()
            if 1 in runner.triggers:
                runner.to_cancel.append(1)  # the supervisor's cancelling set, sent on every sync
                cancels += 1
            await runner.cancel_triggers()
            await asyncio.sleep(loop_s)
        await asyncio.gather(*asyncio.all_tasks() - ours)  # what outlived the trigger
        return cancels

    cancels = asyncio.run(asyncio.wait_for(stopped_by_a_user(), 10))
    assert cancels >= 2, "the trigger ended at the first cancel: nothing was cut off"
    assert deferred_jobs.state_of(root, "j1") == "cancelled", "the repeated cancel cut the stop off"


def test_cleanup_alone_does_not_stop_the_outside_work(tmp_path: Path) -> None:
    """A triggerer restart runs ``cleanup``, not ``on_kill``: the outside work goes on."""
    deferred_jobs.start(str(tmp_path), "j1")
    poll = PollTrigger(
        "cancellable_agents.testing.jobs.status",
        {"root": str(tmp_path), "job": "j1"},
        0.01,
        "cancellable_agents.testing.jobs.cancel",
    )
    classpath, kwargs = poll.serialize()
    trigger = DeferredCallsTrigger(
        "0", [{"tool_call_id": "c", "tool": "run_job", "classpath": classpath, "kwargs": kwargs}], 0.0
    )
    asyncio.run(trigger.cleanup())
    assert deferred_jobs.state_of(str(tmp_path), "j1") == "running"


# -- refusals (item 3) ---------------------------------------------------------------------------


def test_a_deferral_without_durable_is_refused_at_the_deferring_step(tmp_path: Path) -> None:
    counts = Counts()
    with pytest.raises(ConfigurationError, match=r"needs durable=True"):
        _operator(_agent(counts, tmp_path), tmp_path, durable=None).execute(
            {"ti": TI(), "task_instance": TI()}
        )
    assert counts.started == ["j1"], "refused where the tool defers"


def test_a_deferral_below_airflow_3_3_is_refused_and_says_so(tmp_path: Path) -> None:
    if has_trigger_on_kill():
        pytest.skip("Airflow 3.3+: deferral is supported here (the refusal is for 3.1/3.2)")
    with pytest.raises(ConfigurationError, match=r"needs Airflow 3\.3"):
        _operator(_agent(Counts(), tmp_path), tmp_path).execute({"ti": TI(), "task_instance": TI()})


class _DagFileTrigger:
    """What a trigger class defined in a DAG file serializes as."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "unusual_prefix_0123_my_dag.MyTrigger", {}


class _NotJsonTrigger:
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "my_pkg.triggers.MyTrigger", {"when": object()}


@needs_3_3
@pytest.mark.parametrize(
    ("trigger", "message"),
    [
        (_DagFileTrigger(), r"cannot import a trigger defined in a DAG file"),
        (_NotJsonTrigger(), r"kwargs are not JSON"),
        ("not a trigger", r"takes an Airflow trigger"),
    ],
)
def test_a_trigger_that_cannot_be_serialised_is_refused_at_the_deferring_step(
    tmp_path: Path, trigger: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        _operator(_agent(Counts(), tmp_path, trigger=trigger), tmp_path).execute(
            {"ti": TI(), "task_instance": TI()}
        )


def test_a_result_that_is_not_json_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"not JSON"):
        answers_from_event({"run_key": "0", "results": {"c": {1, 2}}, "deferred_at": 0.0})
    run_key, answers = answers_from_event({"run_key": "0", "results": {"c": [1, 2]}, "deferred_at": 0.0})
    assert run_key == "0" and answers["c"].result == [1, 2]


@needs_3_3
def test_a_wait_past_its_timeout_stops_the_work_and_the_model_is_told(tmp_path: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    counts = Counts()
    trigger = PollTrigger(
        "cancellable_agents.testing.jobs.status",
        {"root": str(tmp_path), "job": "j1"},
        interval=0.01,
        cancel="cancellable_agents.testing.jobs.cancel",
    )

    def slow_job(job: str) -> str:
        counts.started.append(job)
        deferred_jobs.start(str(tmp_path), job)
        defer_to(trigger, timeout=0.3)

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        counts.requests += 1
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("slow_job", {"job": "j1"}, tool_call_id="c1")])
        (told,) = [p.content for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        return ModelResponse(parts=[TextPart(f"told: {told}")])

    def operator() -> AgentOperator:
        agent = Agent(FunctionModel(script), tools=[slow_job])
        return _operator(agent, tmp_path)

    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskDeferred) as deferred:
        operator().execute(context)
    assert deferred.value.timeout is not None and deferred.value.timeout.total_seconds() > 0.3, "a backstop"
    event = _fire(deferred.value.trigger)
    assert deferred_jobs.state_of(str(tmp_path), "j1") == "cancelled", "the outside work was stopped"
    assert event["timed_out"] == ["c1"]
    output = operator().resume_execution(RESUME_METHOD, {"event": event}, context)
    assert "did not finish within its timeout of 0.3 s and was stopped" in output
    assert (counts.requests, counts.started) == (2, ["j1"])


@needs_3_3
def test_a_wait_past_a_failing_timeout_ends_the_task_as_timeout_and_stops_every_call(tmp_path: Path) -> None:
    """``on_timeout="fail"``: the call's work is stopped, and so is the work of the step's other
    call (the task ends, nothing will read it); the trigger fires at the timeout, not when the
    other call is done, and the resumed task ends as ``timeout`` naming the wait, asking the
    model nothing more."""
    from airflow.sdk.exceptions import TaskDeferred

    from cancellable_agents.core.causes import CancelCause
    from cancellable_agents.core.exceptions import TaskCancelled

    counts = Counts()
    root = str(tmp_path)

    def run_job(job: str, limit: float | None) -> str:
        counts.started.append(job)
        deferred_jobs.start(root, job)
        trigger = PollTrigger(
            "cancellable_agents.testing.jobs.status",
            {"root": root, "job": job},
            interval=0.01,
            cancel="cancellable_agents.testing.jobs.cancel",
        )
        defer_to(trigger, timeout=limit, on_timeout="fail")

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        counts.requests += 1
        return ModelResponse(
            parts=[
                ToolCallPart("run_job", {"job": "short", "limit": 0.3}, tool_call_id="c-short"),
                ToolCallPart("run_job", {"job": "long", "limit": None}, tool_call_id="c-long"),
            ]
        )

    def operator() -> AgentOperator:
        return _operator(Agent(FunctionModel(script), tools=[run_job]), tmp_path)

    context = {"ti": TI(), "task_instance": TI()}
    with pytest.raises(TaskDeferred) as deferred:
        operator().execute(context)
    event = _fire(deferred.value.trigger)
    assert event["failed"] == {"tool_call_id": "c-short", "tool": "run_job", "timeout_s": 0.3}
    assert [deferred_jobs.state_of(root, j) for j in ("short", "long")] == ["cancelled", "cancelled"]

    resumed = operator()
    with pytest.raises(
        TaskCancelled, match=r"timed out: deferred call run_job \(c-short\) waited 0.3 s"
    ) as ended:
        resumed.resume_execution(RESUME_METHOD, {"event": event}, context)
    assert ended.value.cause is CancelCause.TIMEOUT
    assert resumed.cancellation.attached["deferred"]["failed"]["tool_call_id"] == "c-short"
    assert (counts.requests, sorted(counts.started)) == (1, ["long", "short"]), "nothing asked again"

    # A retry (the timeout cause) continues the run, but not the wait: its work was stopped. The
    # step's calls run again, start their work anew and defer; the model is not asked again.
    retry = {"ti": TI(try_number=2), "task_instance": TI(try_number=2)}
    with pytest.raises(TaskDeferred):
        operator().execute(retry)
    assert (counts.requests, sorted(counts.started)) == (1, ["long", "long", "short", "short"])
    assert [deferred_jobs.state_of(root, j) for j in ("short", "long")] == ["running", "running"]


def test_an_unknown_on_timeout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"on_timeout='retry'"):
        defer_to(PollTrigger("my_pkg.jobs.status"), timeout=5, on_timeout="retry")


@needs_3_3
def test_the_try_that_waited_deferred_stores_the_wait_at_its_end(tmp_path: Path) -> None:
    """The Cancellations view's facts: the wait without a worker slot, stored once, at the end of
    the try (the resumed execution), under the try's key; the deferral writes nothing."""
    from airflow.sdk.exceptions import TaskDeferred

    from cancellable_agents.airflow.kill_record._stored import key_for_try
    from cancellable_agents.airflow.kill_record._try_facts import TryFacts
    from cancellable_agents.durable import MemoryStore

    store = MemoryStore()
    counts = Counts()
    context = {"ti": TI(), "task_instance": TI(), "task_state_store": store}
    with pytest.raises(TaskDeferred) as deferred:
        _operator(_agent(counts, tmp_path), tmp_path).execute(context)
    assert deferred.value.kwargs == {"run_key": "0", "waits": []}
    assert store.writes == 0, "a pause is not the end of the try"
    deferred_jobs.finish(str(tmp_path), "j1", {"rows": 42})
    event = _fire(deferred.value.trigger)
    resumed = _operator(_agent(counts, tmp_path), tmp_path)
    resumed.resume_execution(RESUME_METHOD, {**deferred.value.kwargs, "event": event}, context)
    assert store.writes == 1
    document = store.get(key_for_try(1))
    assert document["kind"] == "facts"
    facts = TryFacts.from_dict(document["record"])
    (wait,) = facts.waits
    assert (wait.kind, wait.calls, wait.timed_out) == ("deferred", ("c-j1",), ())
    assert wait.waited_s == pytest.approx(event["fired_at"] - event["deferred_at"], abs=0.01)
    assert facts.resume is None, "continuing its own try after the pause is no resume"
