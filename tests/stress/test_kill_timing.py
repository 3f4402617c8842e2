"""Kill-timing stress: many real runs, each killed at a random moment, never lost, never leaking.

A long-lived task process (``_stress_child.py``: the Task SDK's own SIGTERM handler shape and
SIGALRM timeout, a fresh ``AgentOperator`` per run, the local HTTP model server) runs one planned
run after another. For each run the parent draws, from one seeded RNG, the tools (async tool with
a subprocess, cooperative sync tool, busy sync tool that ignores cancellation, sandbox command in
either isolation mode, sub-agent), the task state the cause query will answer, and the trigger:
SIGTERM (1, or a burst of 2-20) at a moment drawn across every phase (before start, during
``pre_execute``, model request, tool, sub-agent, teardown, as the result arrives, after the result,
or any time at all), or ``execution_timeout``.

Invariants, on every run (the child checks what needs the inside view, see ``check()`` there):
exactly one terminal outcome; a kill before the result makes ``execute`` raise ``TaskCancelled``
(never a success), a kill after it is a logged no-op; no exception escapes ``on_kill``; the
recorded cause matches the trigger; the run ends inside Airflow's 5 s grace; no thread of ours,
no started process and no HTTP request is left after the 4 s budget; a kill before the run makes
no model request.

Default budget ~85 s; ``CANCELLABLE_AGENTS_STRESS_SECONDS`` runs longer, and
``CANCELLABLE_AGENTS_STRESS_SEED`` replays a sequence of plans (timing still varies).

Two more tests: ``execution_timeout`` with ``timeout_margin=0`` (the run's deadline racing the
SIGALRM; xfail, see its reason), and SIGTERMs hammered at a process that keeps creating task
scopes: a kill that lands while the scope is being created must be neither lost nor a deadlock.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from cancellable_agents.toolsets.sandbox import bwrap_support
from tests.airflow_env import airflow_env
from tests.taskproc import GRACE, ROOT, TaskChild, kill_markers, wait_markers_gone

SECONDS = float(os.environ.get("CANCELLABLE_AGENTS_STRESS_SECONDS", "85"))
#: The SIGALRM-race sub-case (``timeout_margin=0``) gets this share of the budget.
SIGALRM_RACE_SECONDS = max(20.0, SECONDS / 4)
SEED = int(os.environ.get("CANCELLABLE_AGENTS_STRESS_SEED", str(random.SystemRandom().randrange(10**9))))
#: The provider's default grace budget: everything must be gone this long after the kill.
BUDGET = 4.0
START_TIMEOUT = 120.0

pytestmark = [pytest.mark.process, pytest.mark.timeout(int(SECONDS) + 300)]

PHASES = (
    "before_start",
    "pre_execute",
    "model",
    "tool",
    "subagent",
    "teardown",
    "result",
    "after_result",
    "random",
)
STATES = ("failed", "restarting", "running", "hang", "error")
#: The child's event that opens each phase.
ANCHORS = {
    "before_start": "waiting_for_kill",
    "pre_execute": "waiting_for_kill",
    "tool": "tool_started",
    "subagent": "subagent_started",
    "teardown": "teardown_started",
    "result": "teardown_started",
    "after_result": "after_result",
}


# -- planning -------------------------------------------------------------------------------


def draw_plan(rng: random.Random, run: int, namespace_ok: bool) -> dict[str, Any]:
    """One run's plan; everything random comes from ``rng`` so a seed replays the sequence."""
    marker = f"7{rng.randrange(100):02d}.{rng.randrange(10**8):08d}"
    if rng.random() < 0.15:
        return _timeout_plan(rng, run, marker)
    phase = rng.choice(PHASES)
    tools: dict[str, Any] = {}
    if rng.random() < 0.6 or phase == "tool":
        tools["async_ms"] = rng.randint(30, 400)
    if rng.random() < 0.5:
        tools["sync_ms"] = rng.randint(30, 400)
    if rng.random() < 0.3:
        tools["busy_ms"] = rng.randint(30, 400)
    if rng.random() < 0.4:
        tools["shell"] = rng.choice(["namespace", "process-group"] if namespace_ok else ["process-group"])
        tools["shell_s"] = round(rng.uniform(0.05, 0.4), 3)
    if rng.random() < 0.3 or phase == "subagent":
        tools["subagent_tokens"] = rng.randint(5, 40)
    burst = 1 if rng.random() < 0.7 else rng.randint(2, 20)
    return {
        "run": run,
        "marker": marker,
        "phase": phase,
        "state": rng.choice(STATES),
        "tools": tools,
        "tokens": rng.randint(5, 40),
        "delay_first": round(rng.uniform(0.0, 0.2), 3),
        "teardown_ms": rng.randint(10, 150),
        "timeout": None,
        "burst": burst,
        "burst_gap": round(rng.uniform(0.0, 0.003), 4),
        "jitter": rng.random(),
    }


def _timeout_plan(rng: random.Random, run: int, marker: str, margin: float | None = None) -> dict[str, Any]:
    """``execution_timeout`` of 0.6-1.5 s over a 4 s stream; the run's own deadline comes
    ``margin`` earlier (0 means it races Airflow's SIGALRM, see the xfail test below)."""
    seconds = round(rng.uniform(0.6, 1.5), 3)
    return {
        "run": run,
        "marker": marker,
        "phase": "timeout",
        "state": "running",
        "tools": {},
        "tokens": 0,
        "delay_first": 0.0,
        "teardown_ms": rng.randint(10, 100),
        "timeout": {"seconds": seconds, "margin": rng.choice([0.2, 0.4]) if margin is None else margin},
        "burst": 0,
        "burst_gap": 0.0,
        "jitter": 0.0,
    }


def expected_seconds(plan: dict[str, Any]) -> float:
    """A rough length of the run, for kills at a random moment."""
    tools = plan["tools"]
    longest = max(
        tools.get("async_ms", 0) / 1000,
        tools.get("sync_ms", 0) / 1000,
        tools.get("busy_ms", 0) / 1000,
        tools.get("shell_s", 0),
        tools.get("subagent_tokens", 0) * 0.01 + 0.05,
    )
    return 2 * plan["delay_first"] + longest + plan["teardown_ms"] / 1000 + 0.15


# -- one run, parent side -------------------------------------------------------------------


@dataclass
class RunRecord:
    plan: dict[str, Any]
    violations: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)


class Stress:
    """Runs plans in a long-lived task process; a spent process is replaced by a warm spare."""

    def __init__(self, server: ScriptedModelServer, env: dict[str, str], log_dir: Path) -> None:
        self.server, self.env, self.log_dir = server, env, log_dir
        self.child: TaskChild | None = None
        self.spare: TaskChild | None = None
        self.children = 0

    def _spawn(self) -> TaskChild:
        self.children += 1
        return TaskChild("tests.stress._stress_child", self.env, self.log_dir / f"child-{self.children}.log")

    def ensure_child(self) -> TaskChild:
        if self.child is not None and self.child.alive:
            return self.child
        if self.child is not None:
            self.child.close(2.0)
        self.child = self.spare if self.spare is not None and self.spare.alive else self._spawn()
        self.spare = self._spawn()
        return self.child

    def close(self) -> None:
        for child in (self.child, self.spare):
            if child is not None:
                child.close(5.0)

    def run(self, plan: dict[str, Any]) -> RunRecord:
        """One planned run: start it, trigger it, then check what the parent can see."""
        record = RunRecord(plan)
        child = self.ensure_child()
        self.server.reset()
        child.send(plan)
        if child.wait_for({"started"}, START_TIMEOUT) is None:
            return self._abandon(record, child, "the task process did not start the run")
        finished = self._wait_for_moment(child, plan) if plan["burst"] else None
        kill_at = child.sigterm(plan["burst"], plan["burst_gap"]) if plan["burst"] else None
        limit = (kill_at or time.monotonic()) + GRACE + (plan["timeout"]["seconds"] if plan["timeout"] else 0)
        finished = finished or child.wait_for({"finished"}, max(0.0, limit - time.monotonic()))
        if finished is None:
            return self._abandon(
                record, child, "no outcome inside the 5 s grace: Airflow would SIGKILL (lost kill)"
            )
        child.send({"signals": plan["burst"] if kill_at is not None else 0})
        report = child.wait_for({"report"}, BUDGET + GRACE + 5)
        if report is None:
            self._abandon(record, child, "the task process did not report")
        else:
            record.report = report
            record.violations += report["violations"]
            if report["exiting"] and not child.wait_exit(GRACE):
                child.sigkill()
        record.violations += self._leaks(plan, kill_at if kill_at is not None else finished["at"])
        return record

    def _abandon(self, record: RunRecord, child: TaskChild, why: str) -> RunRecord:
        """Record ``why`` with the task process's thread stacks, then end it (as the SIGKILL would)."""
        if child.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR1)  # faulthandler: every thread's stack to its log
            child.wait_exit(0.5)
        record.violations.append(f"{why}\n{child.tail(60)}")
        child.sigkill()
        child.wait_exit(GRACE)
        kill_markers(record.plan["marker"])
        return record

    def _wait_for_moment(self, child: TaskChild, plan: dict[str, Any]) -> dict[str, Any] | None:
        """Wait for the plan's phase and its drawn moment inside it.

        Returns the ``finished`` event if the run ended before the phase came (the kill then
        lands after the result, which is a case of its own).
        """
        phase = plan["phase"]
        if phase in ANCHORS:
            event = child.wait_for({ANCHORS[phase], "finished"}, 30)
            if event is None or event["event"] == "finished":
                return event
        elif phase == "model":
            self.server.wait_for_request(1, timeout=30)
        if phase == "result":
            # The teardown is the run's last step: aim at its end, where the result arrives and
            # the outcome is settled (a few ms either side; the machine's jitter spreads it more).
            time.sleep(max(0.0, plan["teardown_ms"] / 1000 - 0.002 + plan["jitter"] * 0.005))
            return None
        windows = {
            "tool": 0.2,
            "subagent": 0.1,
            "teardown": plan["teardown_ms"] / 1000,
            "model": plan["delay_first"],
            "random": expected_seconds(plan) * 1.2,
        }
        time.sleep(plan["jitter"] * windows.get(phase, 0.0))  # the drawn moment inside the phase
        return None

    def _leaks(self, plan: dict[str, Any], start: float) -> list[str]:
        """Processes and HTTP requests of the run still there at the end of the budget."""
        out = []
        deadline = start + BUDGET + 0.5
        if wait_markers_gone(plan["marker"], deadline) is None:
            out.append(f"started processes alive after the budget: pids {kill_markers(plan['marker'])}")
        records = self.server.requests
        # In these phases the task process waits for the kill before the run: it must not start.
        if plan["phase"] in ("before_start", "pre_execute") and records:
            out.append(f"a kill before the run must make no model request; the server saw {len(records)}")
        if records and not self.server.wait_for_finished(len(records), max(0.0, deadline - time.monotonic())):
            open_ = [r.model[:40] for r in self.server.requests if r.outcome is None]
            out.append(f"HTTP requests still open after the budget: {open_}")
        return out


@pytest.fixture
def stress(tmp_path: Path) -> Iterator[Stress]:
    with ScriptedModelServer() as server, ScriptedModelServer() as warmup:
        conn = {"conn_type": "cancellable_agents_model", "host": server.base_url}
        env = airflow_env(
            tmp_path / "airflow_home",
            {"AIRFLOW_CONN_BENCH_MODEL": json.dumps(conn), "BENCH_WARMUP_URL": warmup.base_url},
        )
        harness = Stress(server, env, tmp_path)
        try:
            yield harness
        finally:
            harness.close()


def test_kills_at_any_moment_are_never_lost_and_never_leak(stress: Stress) -> None:
    rng = random.Random(SEED)
    namespace_ok = bwrap_support().usable
    stress.ensure_child()
    deadline = time.monotonic() + SECONDS
    records: list[RunRecord] = []
    while time.monotonic() < deadline:
        records.append(stress.run(draw_plan(rng, len(records), namespace_ok)))
    _report_and_assert(records, stress, "")


@pytest.mark.xfail(
    strict=False,
    reason=(
        "timeout_margin=0: the run's own deadline races Airflow's SIGALRM. AirflowTaskTimeout raised "
        "at an arbitrary bytecode inside the event loop can leave an anyio Lock in pydantic-ai marked "
        "as held; the unwind then fails with RuntimeError('Attempted to acquire an already held "
        "Lock'), so execute raises RuntimeError instead of AirflowTaskTimeout / TaskCancelled(timeout), "
        "the Task SDK never calls on_kill (it only does for AirflowTaskTimeout) and the scope records "
        "no TIMEOUT cause. Seen once in ~60 such runs (seed 310112703, run 26). The default margin "
        "(2 s) keeps SIGALRM out of the run; the main stress test uses margins of 0.2-0.4 s."
    ),
)
def test_execution_timeout_racing_sigalrm_ends_as_a_timeout(stress: Stress) -> None:
    rng = random.Random(SEED)
    stress.ensure_child()
    deadline = time.monotonic() + SIGALRM_RACE_SECONDS
    records: list[RunRecord] = []
    while time.monotonic() < deadline:
        run = len(records)
        records.append(
            stress.run(_timeout_plan(rng, run, f"7{run:02d}.{rng.randrange(10**8):08d}", margin=0.0))
        )
    _report_and_assert(records, stress, " (timeout_margin=0)")


def _report_and_assert(records: list[RunRecord], stress: Stress, label: str) -> None:
    """Print the counts and the first violations; fail with the seed to replay them."""
    bad = [r for r in records if r.violations]
    phases = Counter(r.plan["phase"] for r in records)
    bursts = sum(1 for r in records if r.plan["burst"] > 1)
    print(
        f"\n[stress{label}] {len(records)} runs, {len(bad)} violations, seed {SEED} "
        f"({stress.children} task processes; phases {dict(sorted(phases.items()))}; {bursts} bursts)"
    )
    for r in bad[:10]:
        print(f"[stress] run {r.plan['run']} plan={json.dumps(r.plan)}\n    " + "\n    ".join(r.violations))
        if r.report:
            print(f"    report: {json.dumps({k: v for k, v in r.report.items() if k != 'violations'})}")
    assert records, "no run finished inside the budget"
    assert not bad, (
        f"{len(bad)} of {len(records)} runs broke an invariant; replay with "
        f"CANCELLABLE_AGENTS_STRESS_SEED={SEED} (first: run {bad[0].plan['run']}: {bad[0].violations[0]})"
    )


#: How long the scope-creation race is hammered.
RACE_SECONDS = 3.0


def test_a_kill_while_the_scope_is_being_created_is_neither_lost_nor_a_deadlock(tmp_path: Path) -> None:
    """SIGTERMs hammered at a process that keeps creating task scopes (``_scope_race_child.py``).

    ``on_kill`` runs on the main thread and needs the scope; when the signal lands while the main
    thread is creating it, a non-reentrant creation lock deadlocks the task (found here: it hung
    within ~1 s, until Airflow's SIGKILL), and a scope built twice would lose the kill.
    """
    log = tmp_path / "race.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.stress._scope_race_child", str(RACE_SECONDS)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
            stdout=subprocess.PIPE,
            stderr=err,
        )
        try:
            out, _ = proc.communicate(timeout=RACE_SECONDS + 30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # faulthandler: the stacks, for the failure message
            time.sleep(0.5)  # give faulthandler a moment to write before the SIGKILL
            proc.kill()  # SIGTERM would only run the handler again
            proc.communicate(timeout=10)
            stacks = log.read_text()[-3000:]
            pytest.fail(f"the task process hung (a kill during scope creation deadlocked it):\n{stacks}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    print(f"\n[stress] scope-creation race: {result}")
    assert result["killed"] > 0, "no SIGTERM landed during the run; the test proved nothing"
    assert result["lost"] == 0, result
