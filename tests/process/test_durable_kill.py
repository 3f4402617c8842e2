"""Durable runs killed for real: SIGKILL (no Python runs, nothing written at kill time) at every
step boundary in turn, and in the middle of a tool; the next try resumes from the files the
journal wrote under an ``ObjectStoragePath``; two live copies of one task race on that store.
Model requests are counted on the local model server (real HTTP); tool executions in a file the
tool appends to.

Each try is a process forked from one zygote that imported everything once (see
``_durable_zygote.py``), so the seven tries of the boundary test cost milliseconds each.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.run.tool_calls import IDEMPOTENCY_META_KEY
from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.process.test_mcp_kill import HAVE_MCP
from tests.process.trees import eventually
from tests.taskproc import STARTUP, TaskChild

pytestmark = pytest.mark.process

STEPS = 3
ZYGOTE = Path(__file__).with_name("_durable_zygote.py")


class Zygote(TaskChild):
    """``_durable_zygote.py``: forks one try per command, each a real task process of its own."""

    def __init__(self, tmp: Path, base_url: str) -> None:
        self.tmp = tmp
        env = {**os.environ, "STEPS": str(STEPS), "BASE_URL": base_url}
        super().__init__([sys.executable, str(ZYGOTE)], env, tmp / "zygote.log", events_env="EVENTS_FD")
        self.next_of("ready", timeout=STARTUP)

    def next_of(self, *names: str, timeout: float = 30) -> dict[str, Any]:
        """The next event; it must be one of ``names``."""
        event = self.next_event(timeout)
        if event is None:
            raise AssertionError(f"no {names} within {timeout}s\n{self.tail(200)}")
        assert event["event"] in names, f"expected {names}, got {event}\n{self.tail(200)}"
        return event

    def run_try(self, try_number: int, **command: Any) -> int:
        """Fork try ``try_number``; return its pid."""
        command = {"try": try_number, "store": f"file://{self.store}", "lines": str(self.lines), **command}
        self.send(command)
        return int(self.next_of("started")["child"])

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        assert self.next_of("exited")["code"] == -signal.SIGKILL

    def steps_run(self) -> list[dict[str, Any]]:
        return (
            [json.loads(line) for line in self.lines.read_text().splitlines()] if self.lines.exists() else []
        )

    def new_task(self, name: str) -> None:
        """Tries from now on belong to a new task instance (its own store and tool log)."""
        self.store = self.tmp / name / "store"
        self.lines = self.tmp / name / "lines.jsonl"
        self.lines.parent.mkdir()


@pytest.fixture(scope="module")
def _zygote(
    tmp_path_factory: pytest.TempPathFactory, _model_server_session: ScriptedModelServer
) -> Iterator[Zygote]:
    zygote = Zygote(tmp_path_factory.mktemp("durable"), _model_server_session.base_url)
    try:
        yield zygote
    finally:
        zygote.close(timeout=10)


@pytest.fixture
def zygote(_zygote: Zygote, model_server: ScriptedModelServer, request: pytest.FixtureRequest) -> Zygote:
    _zygote.new_task(request.node.name)
    return _zygote


def _finish(zygote: Zygote, try_number: int, **command: Any) -> dict[str, Any]:
    zygote.run_try(try_number, **command)
    while (done := zygote.next_of("completed", "failed", "tool_result_recorded"))[
        "event"
    ] == "tool_result_recorded":
        pass
    assert done["event"] == "completed" and done["output"] == "all done", f"{done}\n{zygote.tail()}"
    assert zygote.next_of("exited")["code"] == 0
    return done


def test_sigkill_at_every_step_boundary_redoes_no_completed_step(
    zygote: Zygote, model_server: ScriptedModelServer
) -> None:
    """Try k is SIGKILLed right after it appended one more entry; the next try goes on from there.

    Written ahead (each entry stored before the run goes on, so the store that sleeps after its
    k-th entry stops the run right at that boundary) and with each tool's return appended at
    once (``flush: 0``): 2 * STEPS entries (per step: the
    response that calls the tool, then the tool's return): as many killed tries, then one that
    finishes. Over all of them the model is asked exactly as often as in one uninterrupted run,
    and every tool runs exactly once.
    """
    entries = 2 * STEPS
    kinds = []
    for try_number in range(1, entries + 1):
        pid = zygote.run_try(try_number, stop_after=1, flush=0, write_ahead=True)
        recorded = zygote.next_of("recorded", "failed")
        assert recorded["event"] == "recorded", f"{recorded}\n{zygote.tail()}"
        assert recorded["entries"] == try_number, "each try appended exactly the next entry"
        kinds.append(recorded["kind"])
        zygote.kill(pid)
    done = _finish(zygote, entries + 1, write_ahead=True)
    assert done["resumed_messages"] == entries + 1  # and the prompt
    assert kinds == ["step"] * entries
    assert model_server.request_count == STEPS + 1, "a completed model request was made again"
    runs = zygote.steps_run()
    assert [r["n"] for r in runs] == list(range(1, STEPS + 1)), f"a completed tool ran again: {runs}"
    print(f"\n[durable] {entries} SIGKILLs at step boundaries: {model_server.request_count} model requests")


@pytest.mark.parametrize("write_ahead", [True, False])
def test_sigkill_during_a_tool_reruns_exactly_that_tool_once(
    zygote: Zygote, model_server: ScriptedModelServer, write_ahead: bool
) -> None:
    """Written ahead, the tool's step is stored before the tool starts: a SIGKILL at its first
    line reruns it as a known re-run. Otherwise the step is stored while the tool runs: killed
    once it is there, the same."""
    pid = zygote.run_try(1, block_in=2, write_ahead=write_ahead)
    zygote.next_of("tool_running")
    step_2 = zygote.store / "cancellable_agents.durable.0.try1.1.json"
    assert write_ahead is False or step_2.exists(), "written ahead: stored before the tool started"
    assert eventually(step_2.exists, timeout=30), "the step that runs tool 2 was never stored"
    zygote.kill(pid)
    assert model_server.request_count == 2
    _finish(zygote, 2)
    runs = [(r["n"], r["try"], r["rerun"]) for r in zygote.steps_run()]
    assert runs == [(1, 1, False), (2, 1, False), (2, 2, True), (3, 2, False)], runs
    assert model_server.request_count == STEPS + 1, "try 2 made only the requests try 1 had not made"
    _assert_rerun_keeps_its_key(zygote.steps_run(), cut=2)
    t0 = zygote.events[0]["t"]
    print("\n" + " ".join(f"{e['event']}@{e['t'] - t0:.2f}" for e in zygote.events))


def test_sigkill_beside_a_returned_parallel_call_reruns_only_the_call_in_flight(
    zygote: Zygote, model_server: ScriptedModelServer
) -> None:
    """One model response calls ``fetch`` and ``slow`` at once; try 1 is SIGKILLed once ``fetch``
    returned (its result appended on its own) while ``slow`` still runs."""
    pid = zygote.run_try(1, parallel=True)
    seen = {zygote.next_of("tool_running", "tool_result_recorded")["event"] for _ in range(2)}
    assert seen == {"tool_running", "tool_result_recorded"}, zygote.tail()
    zygote.kill(pid)
    _finish(zygote, 2, parallel=True)
    runs = sorted((r["n"], r["try"], r["rerun"]) for r in zygote.steps_run())
    assert runs == [("fetch", 1, False), ("slow", 1, False), ("slow", 2, True)], runs
    assert model_server.request_count == 2, "try 2 asked only for the answer"
    _assert_rerun_keeps_its_key(zygote.steps_run(), cut="slow")


@pytest.mark.skipif(not HAVE_MCP, reason="needs pydantic-ai's fastmcp MCPToolset (the mcp extra)")
def test_a_completed_mcp_call_is_not_repeated_on_resume(
    zygote: Zygote, model_server: ScriptedModelServer
) -> None:
    """The steps are a real MCP stdio server's tool. Try 1 is SIGKILLed once step 1's call returned
    and step 2's call was recorded (written ahead, so it never ran); try 2 resumes: step 1 is not
    called again, every step reaches the server exactly once, each with its own key in ``_meta``."""
    calls = zygote.lines.with_name("mcp_calls.jsonl")
    pid = zygote.run_try(1, stop_after=3, flush=0, write_ahead=True, mcp=str(calls))
    recorded = zygote.next_of("recorded", "failed")
    assert recorded["event"] == "recorded" and recorded["entries"] == 3, f"{recorded}\n{zygote.tail()}"
    zygote.kill(pid)
    _finish(zygote, 2, write_ahead=True, mcp=str(calls))
    steps = [json.loads(line) for line in calls.read_text().splitlines() if '"step"' in line]
    assert [s["n"] for s in steps] == list(range(1, STEPS + 1)), f"an MCP call was repeated: {steps}"
    keys = [s["meta"].get(IDEMPOTENCY_META_KEY) for s in steps]
    assert all(keys) and len(set(keys)) == STEPS, keys
    assert model_server.request_count == STEPS + 1, "a completed model request was made again"


def test_a_sigkill_repeats_at_most_max_unconfirmed_completed_steps(
    zygote: Zygote, model_server: ScriptedModelServer
) -> None:
    """The store answers each call 0.3 s late (an API server under load) while the steps take
    milliseconds: entries queue, each call stores what queued, and the run waits only when
    ``max_unconfirmed`` (3) are not yet stored. Try 1 is SIGKILLed in tool 8 of 10: try 2 runs
    tool 8 again and repeats at most 3 steps that had completed (unbounded, it would be ~7)."""
    limit, steps, cut = 3, 10, 8
    pid = zygote.run_try(1, steps=steps, block_in=cut, store_delay=0.3, max_unconfirmed=limit)
    assert zygote.next_of("tool_running")["n"] == cut
    zygote.kill(pid)
    requests_try_1 = model_server.request_count
    assert requests_try_1 == cut
    _finish(zygote, 2, steps=steps)
    runs = zygote.steps_run()
    try_2 = [r["n"] for r in runs if r["try"] == 2]
    repeated = [n for n in try_2 if n < cut]
    print(f"\n[durable] SIGKILL in tool {cut} with max_unconfirmed={limit}: steps repeated {repeated}")
    assert len(repeated) <= limit, f"{len(repeated)} completed steps repeated: {runs}"
    assert try_2 == list(range(cut - len(repeated), steps + 1)), runs
    assert model_server.request_count == requests_try_1 + steps + 1 - (cut - len(repeated)), (
        "try 2 asked again for more than what was lost"
    )


def _assert_rerun_keeps_its_key(runs: list[dict[str, Any]], cut: int | str) -> None:
    """The call cut by the SIGKILL in try 1 and its re-run in try 2 carry one idempotency key
    (and the same tool call id); every other call has a key of its own. Prints the re-run table."""
    print("\n[idempotency] call | try | is_rerun | tool_call_id | key")
    for r in runs:
        print(f"[idempotency] {r['n']} | {r['try']} | {r['rerun']} | {r['id']} | {r['key']}")
    cut_runs = [r for r in runs if r["n"] == cut]
    assert [(r["try"], r["rerun"]) for r in cut_runs] == [(1, False), (2, True)], cut_runs
    assert cut_runs[0]["key"] == cut_runs[1]["key"] and cut_runs[0]["id"] == cut_runs[1]["id"]
    others = [r["key"] for r in runs if r["n"] != cut]
    assert len({*others, cut_runs[0]["key"]}) == len(others) + 1, "another call shares the cut call's key"


def test_a_stale_try_cannot_change_what_the_newest_try_resumes_from(
    zygote: Zygote, model_server: ScriptedModelServer
) -> None:
    """Two copies of one task on a real filesystem store: an orphaned try 1 and its retry.

    Try 2 takes the record over from the live try 1 (it reads it, reruns tool 2, records step
    3). Try 1 then runs on beside it, unaware (nothing reads before a write): it records step 3
    and its completion under its own keys. Try 2 is SIGKILLed in tool 3; try 3 resumes from what
    try 2 recorded, exactly, as if try 1 had written nothing after the takeover.
    """
    release = zygote.lines.with_name("release-try-1")
    zygote.run_try(1, block_in=2, release=str(release), wait=False)
    assert zygote.next_of("tool_running")["n"] == 2
    second = zygote.run_try(2, block_in=3, wait=False)  # takes the record over from the live try 1
    running = zygote.next_of("tool_running")
    assert (running["pid"], running["n"]) == (second, 3)
    release.touch()  # try 1's tool 2 returns: it goes on to the end, beside try 2
    stale = zygote.next_of("completed")
    assert stale["pid"] != second and stale["resumed_messages"] == 0, stale
    late = sorted(p.name for p in zygote.store.iterdir() if ".try1." in p.name)
    assert late == [f"cancellable_agents.durable.0.try1.{j}.json" for j in range(4)], (
        "try 1 appended step 3 and its completion after the takeover, and its completion dropped nothing"
    )
    requests_before_try_3 = model_server.request_count
    os.kill(second, signal.SIGKILL)  # try 2 dies in tool 3; try 3 goes on from try 2's record
    done = _finish(zygote, 3)
    assert done["resumed_messages"] == 6, "requests and responses 1..3: what try 2 recorded"
    runs = [(r["n"], r["try"], r["rerun"]) for r in zygote.steps_run()]
    assert runs == [(1, 1, False), (2, 1, False), (2, 2, True), (3, 2, False), (3, 1, False), (3, 3, True)], (
        runs
    )
    assert model_server.request_count == requests_before_try_3 + 1, "try 3 asked only for the answer"
