"""Drive common.ai's operators through real kills: shared by the process tests and the benchmark.

One task process (``dags_common_ai/common_ai_scenarios.py`` under ``dag.test()``) runs several
scenarios as consecutive tasks, so the process start (seconds) is paid once. For each scenario
the driver waits for its moment, sends SIGTERM to the task pid only (as the supervisor does on an
eviction) and reads what the task reported. A kill that produces no failure within Airflow's 5 s
grace is *lost*: the process is SIGKILLed, as the supervisor would, and the remaining scenarios
go to a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from cancellable_agents.testing.openai_server import RequestRecord, ScriptedModelServer
from tests.process.harness import TaskProcess
from tests.taskproc import STARTUP

SCRIPT = Path(__file__).with_name("dags_common_ai") / "common_ai_scenarios.py"
#: Airflow SIGKILLs a task 5 s after SIGTERM.
GRACE = 5.0
#: What the fallback connection answers with: a request for it means the kill was "failed over".
FALLBACK_MODEL = "echo?delay_first=0"
#: The kill scenarios, in the order one process runs them.
KILL_SCENARIOS = (
    "before_run",
    "stream",
    "llm_nonstream",
    "sync_tool",
    "subprocess",
    "after_result",
    "hitl_wait",
    "sandbox",
    "fallback",
    "durable",  # last: its retry runs in the same process, the tasks after it would wait for it
)


@dataclass
class KillResult:
    """What one kill did. ``raised_ms``: SIGTERM -> the task's failure callback (``None``: never)."""

    scenario: str
    impl: str
    outcome: str
    raised_ms: float | None
    sent: float = 0.0
    """When the SIGTERM was sent (monotonic, comparable with the events' ``t``)."""
    problems: list[str] = field(default_factory=list)
    failed: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    retried: dict[str, Any] | None = None
    other_requests: list[RequestRecord] = field(default_factory=list)
    """Requests of no scenario made after the kill (a retry policy asking a model)."""
    log_tail: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems


def task_env(
    airflow_env: dict[str, str], server: ScriptedModelServer, impl: str, marker: str
) -> dict[str, str]:
    conn = {"conn_type": "pydanticai", "host": server.base_url, "password": "not-a-real-key"}
    fallback = {**conn, "extra": {"model": f"openai-chat:{FALLBACK_MODEL}"}}
    return {
        **airflow_env,
        "IMPL": impl,
        "MARKER": marker,
        "AIRFLOW_CONN_LOCAL_MODEL": json.dumps(conn),
        "AIRFLOW_CONN_LOCAL_MODEL_B": json.dumps(fallback),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }


def new_marker() -> str:
    """A ``sleep`` argument no other process uses, to find the processes a scenario started."""
    return f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"


def _is_sleep(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return (proc.cmdline() or [""])[0] == "sleep"
    return False


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


def kill_marked(marker: str) -> None:
    for proc in marked_processes(marker):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def run_kills(
    impl: str,
    scenarios: tuple[str, ...] | list[str],
    *,
    server: ScriptedModelServer,
    airflow_env: dict[str, str],
    log_dir: Path,
) -> Iterator[KillResult]:
    """Kill each scenario once, in order; yield its result as soon as it is known."""
    pending = list(scenarios)
    while pending:
        marker = new_marker()
        log = log_dir / f"{impl}-{len(scenarios) - len(pending)}"
        log.mkdir(parents=True, exist_ok=True)
        since = time.monotonic()  # the server may hold requests of earlier runs with the same prompts
        task = TaskProcess(",".join(pending), task_env(airflow_env, server, impl, marker), log, script=SCRIPT)
        try:
            for index, scenario in enumerate(list(pending)):
                pending.remove(scenario)
                result = _kill_one(task, scenario, impl, server, f"{marker}{index}", since)
                yield result
                if result.outcome == "lost":
                    break
        finally:
            task.close(timeout=0)
            kill_marked(marker)


def scenario_requests(records: list[RequestRecord], scenario: str, since: float) -> list[RequestRecord]:
    """The requests scenario ``scenario`` made (its prompt names it) since ``since`` (monotonic)."""
    prompt = f"scenario {scenario}"
    return [r for r in records if r.started_at >= since and any(_says(m, prompt) for m in r.messages)]


def _says(message: dict[str, Any], prompt: str) -> bool:
    return message.get("role") == "user" and message.get("content") == prompt


def _of_a_scenario(record: RequestRecord) -> bool:
    return any(str(m.get("content", "")).startswith("scenario ") for m in record.messages)


def _kill_one(
    task: TaskProcess, scenario: str, impl: str, server: ScriptedModelServer, marker: str, since: float
) -> KillResult:
    before = server.request_count  # the previous task may have started already: filter by prompt too
    _READY[scenario](task, server, scenario, since, marker)
    sent = task.sigterm()
    end = _terminal_event(task, scenario, timeout=GRACE)
    if end is None:
        result = KillResult(
            scenario, impl, "lost", None, problems=["no failure within the 5 s grace (SIGKILLed)"]
        )
        result.log_tail = task.tail(80)
        _sigkill(task)
        result.requests = scenario_requests(server.requests, scenario, since)
        _check_left_behind(result, server, marker, since)
        return result
    if end["event"] == "task_succeeded":
        result = KillResult(
            scenario, impl, "succeeded", (end["t"] - sent) * 1000, problems=["the killed task succeeded"]
        )
    else:
        result = KillResult(scenario, impl, end["exc_type"], (end["raised_t"] - sent) * 1000)
        result.failed = end
        if end["raised_t"] - sent > GRACE:
            result.problems.append("failed after the grace")
    if scenario == "durable" and result.outcome != "succeeded":  # the retry: replay, then the answer
        retried = _terminal_event(task, scenario, timeout=STARTUP, after=end)
        result.retried = retried
        if retried is None or retried["event"] != "task_succeeded":
            result.problems.append("the retry did not succeed")
    result.sent = sent
    result.events = [e for e in task.events if e.get("scenario") in (scenario, None)]
    result.requests = scenario_requests(server.requests, scenario, since)
    _check_left_behind(result, server, marker, since)
    result.other_requests = [
        r for r in server.requests[before:] if r.started_at > sent and not _of_a_scenario(r)
    ]
    _CHECKS.get(scenario, _no_check)(result)
    result.log_tail = task.tail(80)
    return result


def _terminal_event(
    task: TaskProcess, scenario: str, timeout: float, after: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The scenario's next ``task_failed``/``task_succeeded`` (after the event ``after``)."""
    names = ("task_failed", "task_succeeded")
    try:  # + the failure callback's 1 s look at tools still running
        if after is None:
            return task.expect(names, timeout=timeout + 1.5, scenario=scenario)
        return task.expect(names, timeout=timeout, scenario=scenario, try_number=after["try_number"] + 1)
    except AssertionError:
        return None


def _sigkill(task: TaskProcess) -> None:
    """What the supervisor does 5 s after SIGTERM (here the pid only: the child shares our group)."""
    if task.proc.poll() is None:
        task.proc.kill()
        task.proc.wait(10)


def _check_left_behind(result: KillResult, server: ScriptedModelServer, marker: str, since: float) -> None:
    """Everything the scenario started must be gone about 1 s after the failure."""
    scenario = result.scenario
    ended = server.wait_until(
        lambda rs: all(r.outcome for r in scenario_requests(rs, scenario, since)) or None, 2.0
    )
    if not ended:
        result.problems.append("a model request was still open")
    deadline = time.monotonic() + 1.0
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)  # polled: these are processes of another process tree
    if alive:
        result.problems.append(f"{len(alive)} process(es) the task started outlived it")
    running = (result.failed or {}).get("tools_running") or []
    if any("daemon=False" in thread for thread in running):
        result.problems.append(f"a tool still runs on a thread that keeps the process alive: {running}")


# -- when to kill ----------------------------------------------------------------------------


def _request_streaming(
    task: TaskProcess, server: ScriptedModelServer, scenario: str, since: float, _: str
) -> None:
    got = server.wait_until(
        lambda rs: any(r.tokens_sent >= 5 for r in scenario_requests(rs, scenario, since)), 90
    )
    assert got, f"no streaming request\n{task.tail()}"


def _request_started(
    task: TaskProcess, server: ScriptedModelServer, scenario: str, since: float, _: str
) -> None:
    assert server.wait_until(lambda rs: scenario_requests(rs, scenario, since) or None, 90), task.tail()


def _processes_running(count: int) -> Callable[[TaskProcess, ScriptedModelServer, str, float, str], None]:
    def ready(
        task: TaskProcess, server: ScriptedModelServer, scenario: str, since: float, marker: str
    ) -> None:
        deadline = time.monotonic() + 90
        # The sleeps themselves: a shell (or its fork before exec) also carries the marker.
        while len([p for p in marked_processes(marker) if _is_sleep(p)]) < count:
            assert time.monotonic() < deadline, f"the tool's processes never started\n{task.tail()}"
            time.sleep(0.05)  # polled: processes of another tree have no event to await

    return ready


def _ready_for(scenario: str) -> Callable[[TaskProcess, ScriptedModelServer, str, float, str], None]:
    event = {"before_run": "pre_execute", "after_result": "result_arrived", "hitl_wait": "hitl_polled"}
    if scenario in event:
        name = event[scenario]

        def ready(task: TaskProcess, server: ScriptedModelServer, _: str, since: float, marker: str) -> None:
            task.expect(name, timeout=STARTUP, scenario=scenario)

        return ready
    if scenario == "sync_tool":

        def tool(task: TaskProcess, server: ScriptedModelServer, _: str, since: float, marker: str) -> None:
            task.expect("tool_started", timeout=STARTUP, scenario=scenario)

        return tool
    if scenario in ("stream", "fallback"):
        return _request_streaming
    if scenario == "llm_nonstream":
        return _request_started
    if scenario in ("subprocess", "sandbox"):
        return _processes_running(2)
    if scenario == "durable":

        def in_flight(
            task: TaskProcess, server: ScriptedModelServer, _: str, since: float, marker: str
        ) -> None:
            task.expect("tool_started", timeout=STARTUP, scenario=scenario, tool="summarize_orders")

        return in_flight
    raise KeyError(scenario)


_READY = {name: _ready_for(name) for name in KILL_SCENARIOS}


# -- what else must hold ---------------------------------------------------------------------


def _no_check(result: KillResult) -> None:
    return


def _check_before_run(result: KillResult) -> None:
    if result.requests:
        result.problems.append(f"{len(result.requests)} model request(s) after the kill")


def _check_sandbox(result: KillResult) -> None:
    finished = [e for e in result.events if e["event"] == "destroy_finished"]
    if not finished:
        result.problems.append("the sandbox's destroy never ran")
    elif result.failed and finished[0]["t"] > result.failed["t"]:
        result.problems.append("the sandbox was destroyed after the task failed")


def _check_fallback(result: KillResult) -> None:
    if any(r.model == FALLBACK_MODEL for r in result.requests):
        result.problems.append("the kill was tried on the fallback connection")
    if result.other_requests:
        result.problems.append(
            f"{len(result.other_requests)} model request(s) after the kill (the retry policy)"
        )
    failed = result.failed or {}
    if "ExceptionGroup" in " ".join(failed.get("exc_mro", [])):
        result.problems.append("the kill was wrapped in an exception group")
    if failed.get("saved_usage") is None:
        result.problems.append("the usage budget did not record the killed try")


def _check_durable(result: KillResult) -> None:
    """The retry replays the completed steps: no model request or tool call of them again."""
    ran = [e["tool"] for e in result.events if e["event"] == "tool_ran"]
    if ran.count("fetch_orders") != 1:
        result.problems.append(f"the completed tool call ran {ran.count('fetch_orders')} times")
    if len(result.requests) != 2:  # try 1: the tool calls; try 2: (replayed) then the answer
        result.problems.append(f"{len(result.requests)} model requests over both tries (2 without repeats)")


_CHECKS = {
    "before_run": _check_before_run,
    "sandbox": _check_sandbox,
    "fallback": _check_fallback,
    "durable": _check_durable,
}
