"""KubernetesExecutor pods, proven on a pod's real process model (``tests/e2e/pod.py``).

Each try of ``e2e_pod`` (a durable agent: four tool calls, killed while the model request after
the second streams, a ``setsid``-ing sandboxed tree started before the run; ``e2e_pod_tool``: the
same, killed while its third tool call, a sync tool, runs) is queued by the real
scheduler to the test ``PodExecutor`` and run by the kubelet in a pod of its own: ``dumb-init`` as
PID 1 of a fresh PID namespace, the Task SDK supervisor under it talking to the real API server.
Every way a pod goes away is driven at once, with task-sdk 1.3.2's forwarding supervisor and
with a warm-shutdown one (apache/airflow#69034, emulated: ``tests/e2e/pod_supervisor.py``), on
the session's LocalExecutor stack. Per path the tests assert what reached the task (the cause in
its record, or "died without a word"), what was left in the namespace when it was SIGKILLed, and
that the retry, in a new pod, resumed from the continuity record without redoing a completed tool
call, with no entry of the stale try after the retry took the record over.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest

from tests.e2e.airflow_stack import wait_until
from tests.e2e.conftest import E2EEnv, _await_dags
from tests.e2e.dags.kill_paths import CELERY_STALL_AFTER, CELERY_STEPS, POD_TOOL_AT
from tests.e2e.driver import (
    E2E_TEST_TIMEOUT,
    START_TIMEOUT,
    KillPath,
    PathResult,
    _retried,
    _terminal_run,
    await_messages_stored,
    clear,
    drive,
    mark_failed,
    tree_marker,
)
from tests.e2e.pod import DUMB_INIT, Kubelet, Pod, PodEnd, RestrictedPods, SupervisorMode
from tests.e2e.procs import ancestors, is_alive, marked_processes
from tests.e2e.test_celery import (
    RECORDED_BY_TRY_1,
    UNINTERRUPTED,
    _durable,
    _try_1_wrote_nothing_after_the_takeover,
)
from tests.e2e.test_kill_paths import _the_record, explained
from tests.process.restricted_pod import unavailable_reason
from tests.process.trees import landlock_reason, landlock_usable

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(E2E_TEST_TIMEOUT),
    pytest.mark.skipif(not os.path.exists(DUMB_INIT), reason="dumb-init not installed (make system-deps)"),
]

DAG_ID = "e2e_pod"
#: The same agent, killed while try 1 is in a sync tool (call :data:`POD_TOOL_AT`) instead.
TOOL_DAG_ID = "e2e_pod_tool"
#: The same agent in an unprivileged pod (``RestrictedPods``): uid 50000, no capabilities,
#: ``no_new_privs``, the container runtime's default seccomp profile.
RESTRICTED_DAG_ID = "e2e_pod_restricted"
#: Why an unprivileged pod cannot be made here (``None``: it can): its scenarios are left out.
NO_RESTRICTED_POD = unavailable_reason() or (None if landlock_usable() else landlock_reason())
#: How long a pod may take from its tree being up to the sync tool it then calls (start-up).
TOOL_START_TIMEOUT_S = START_TIMEOUT
#: How many pod scenarios run at once.
POD_WAVE = 8
#: ``terminationGracePeriodSeconds`` of the KubernetesExecutor's pod template.
DELETE_GRACE_S = 30.0
#: A drain's grace below the provider's 4 s unwind budget.
DRAIN_GRACE_S = 2.0
#: The preStop recipe (docs/content/kubernetes.md): SIGTERM every process of the container but
#: PID 1, so the task hears it whatever its supervisor forwards.
PRE_STOP = "kill -TERM -1"

FORWARDING, WARM = SupervisorMode.FORWARDING, SupervisorMode.WARM


@dataclass
class PodRun:
    """What one scenario did to its first pod (filled by the kill, read by the tests)."""

    pod: Pod | None = None
    #: Host pids of try 1's sandboxed tree at the kill, found by its per-run argv marker (the tree
    #: lives in bubblewrap's own nested PID namespace: the pod's namespace alone does not hold it).
    tree: set[int] = field(default_factory=set)
    #: Of those, the ones that did not descend from try 1's task process (host pid -> ancestors):
    #: anything here means the harness mapped the pod's pids wrongly.
    strays: dict[int, list[int]] = field(default_factory=dict)
    end: PodEnd | None = None
    ending: threading.Thread | None = None
    notes: dict[str, Any] = field(default_factory=dict)


Kill = Callable[[Pod, E2EEnv, PathResult, PodRun], None]


def _terminate(grace: float, how: str, pod: Pod, env: E2EEnv, result: PathResult, run: PodRun) -> None:
    """Delete or drain (SIGTERM to PID 1, SIGKILL at ``grace``) in the background, as the kubelet."""

    def end() -> None:
        run.end = pod.terminate(grace, how)

    run.ending = threading.Thread(target=end, name=f"terminate-{pod.name}", daemon=True)
    run.ending.start()


def _pre_stop_then_delete(pod: Pod, env: E2EEnv, result: PathResult, run: PodRun) -> None:
    run.notes["pre_stop"] = pod.pre_stop(PRE_STOP).returncode
    _terminate(DELETE_GRACE_S, "preStop + deletion", pod, env, result, run)


def _oom(pod: Pod, env: E2EEnv, result: PathResult, run: PodRun) -> None:
    pod.oom_kill(result.task_pid)


def _node_loss(pod: Pod, env: E2EEnv, result: PathResult, run: PodRun) -> None:
    run.end = pod.lose_node()


def _rest(
    call: Callable[[E2EEnv, PathResult], object], pod: Pod, env: E2EEnv, result: PathResult, run: PodRun
) -> None:
    call(env, result)


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: SupervisorMode
    kill: Kill
    #: Whether a signal can reach the task (the task writes its record, the pod ends by itself).
    reaches_task: bool
    settled: Callable[[PathResult], bool] = _retried
    #: ``TOOL_DAG_ID``: killed while try 1 runs a sync tool, not while a model request streams.
    dag_id: str = DAG_ID

    @property
    def restricted(self) -> bool:
        return self.dag_id == RESTRICTED_DAG_ID

    @property
    def in_tool(self) -> bool:
        return self.dag_id == TOOL_DAG_ID


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("fwd_delete", FORWARDING, partial(_terminate, DELETE_GRACE_S, "deletion"), True),
        Scenario(
            "fwd_delete_tool",
            FORWARDING,
            partial(_terminate, DELETE_GRACE_S, "deletion"),
            True,
            dag_id=TOOL_DAG_ID,
        ),
        Scenario("fwd_drain", FORWARDING, partial(_terminate, DRAIN_GRACE_S, "drain"), True),
        Scenario("fwd_oom", FORWARDING, _oom, False),
        Scenario("fwd_node_loss", FORWARDING, _node_loss, False),
        Scenario("fwd_mark_failed", FORWARDING, partial(_rest, mark_failed), True, _terminal_run),
        Scenario("fwd_clear", FORWARDING, partial(_rest, clear), True),
        Scenario("warm_delete", WARM, partial(_terminate, DELETE_GRACE_S, "deletion"), False),
        Scenario("warm_drain", WARM, partial(_terminate, DRAIN_GRACE_S, "drain"), False),
        Scenario("warm_prestop", WARM, _pre_stop_then_delete, True),
        # The warm supervisor forwards no signal it receives; a refused heartbeat still signals.
        Scenario("warm_mark_failed", WARM, partial(_rest, mark_failed), True, _terminal_run),
        Scenario("warm_clear", WARM, partial(_rest, clear), True),
        # In an unprivileged pod: the sandbox is in landlock mode there.
        Scenario(
            "rpod_delete",
            FORWARDING,
            partial(_terminate, DELETE_GRACE_S, "deletion"),
            True,
            dag_id=RESTRICTED_DAG_ID,
        ),
        Scenario(
            "rpod_drain",
            FORWARDING,
            partial(_terminate, DRAIN_GRACE_S, "drain"),
            True,
            dag_id=RESTRICTED_DAG_ID,
        ),
        Scenario(
            "rpod_mark_failed",
            FORWARDING,
            partial(_rest, mark_failed),
            True,
            _terminal_run,
            dag_id=RESTRICTED_DAG_ID,
        ),
    )
    if not (s.restricted and NO_RESTRICTED_POD)
}


def _scenario_of(run_id: str) -> Scenario:
    return SCENARIOS[run_id.rsplit("-", 1)[0]]


def _kill_in_pod(
    kubelet: Kubelet, runs: dict[str, PodRun], env: E2EEnv, result: PathResult
) -> tuple[float, float]:
    """Find try 1's pod, map the pids the task reported (the pod's own) to the host's, and kill."""
    scenario = _scenario_of(result.run_id)
    pod = kubelet.pod(result.run_id, 1)
    run = runs[scenario.name]
    run.pod = pod
    if scenario.in_tool:
        in_tool = env.state_dir / f"{result.dag_id}.{result.run_id}.in_tool"
        wait_until(
            in_tool.exists, TOOL_START_TIMEOUT_S, f"{result.run_id} try 1 in its sync tool", interval=0.05
        )
    if not scenario.reaches_task and not scenario.in_tool:
        # No code of try 1 runs after this kill: what it recorded must be stored first (a step's
        # entry may wait out the batch window), or the retry has less to resume from.
        await_messages_stored(env, result, RECORDED_BY_TRY_1)
    result.notes["pod_pids"] = (result.task_pid, result.supervisor_pid)
    result.task_pid, result.supervisor_pid = (
        pod.host_pid(result.task_pid),
        pod.host_pid(result.supervisor_pid),
    )
    run.tree = set(marked_processes(tree_marker(env, result, 1)))
    run.strays = {pid: chain for pid in run.tree if result.task_pid not in (chain := ancestors(pid))}
    clicked = time.time()
    scenario.kill(pod, env, result, run)
    return clicked, time.time()


@dataclass
class Outcome:
    result: PathResult
    run: PodRun
    retry_pod: Pod | None


@pytest.fixture(scope="module")
def pod_runs(e2e: E2EEnv) -> Iterator[dict[str, Outcome]]:
    """Every scenario at once, each in its own pods; the kubelet is gone (and every pod) after."""
    _await_dags(
        e2e.stack,
        e2e.rest,
        dag_ids=(DAG_ID, TOOL_DAG_ID, *(() if NO_RESTRICTED_POD else (RESTRICTED_DAG_ID,))),
    )
    runs = {name: PodRun() for name in SCENARIOS}
    log_dir = e2e.stack.home / "components"
    restricted = None if NO_RESTRICTED_POD else RestrictedPods(e2e.stack.home, e2e.state_dir)
    with contextlib.ExitStack() as stack:
        if restricted is not None:
            stack.callback(restricted.close)
        kubelet = stack.enter_context(
            Kubelet(
                e2e.state_dir,
                e2e.stack.env,
                lambda run_id: _scenario_of(run_id).mode,
                log_dir,
                lambda run_id: restricted if _scenario_of(run_id).restricted else None,
            )
        )
        started = time.monotonic()
        kill = partial(_kill_in_pod, kubelet, runs)
        paths = {
            name: KillPath(name, s.dag_id, kill, s.settled, streams=not s.in_tool)
            for name, s in SCENARIOS.items()
        }
        # Two waves: fifteen pods starting Airflow at once beside a CI lane held the machine past
        # the pods' own 30 s grace windows (ci: 5 of 15 paths failed; alone, 15 of 15 passed).
        with ThreadPoolExecutor(max_workers=POD_WAVE, thread_name_prefix="e2e-pod") as pool:
            futures = {name: pool.submit(drive, e2e, path) for name, path in paths.items()}
            results = {name: future.result() for name, future in futures.items()}
        for run in runs.values():
            if run.ending is not None:
                run.ending.join(DELETE_GRACE_S + 15)
        outcomes = {
            name: Outcome(results[name], runs[name], kubelet._get(results[name].run_id, 2))
            for name in SCENARIOS
        }
        took = time.monotonic() - started
        assert not kubelet.errors, kubelet.errors
        print(f"\n[pods] {len(SCENARIOS)} pod scenarios took {took:.1f}s at once")
        for name, outcome in outcomes.items():
            print(_report_line(e2e, name, outcome))
        yield outcomes


# -- reading what happened ---------------------------------------------------------------------


def _report_line(env: E2EEnv, name: str, outcome: Outcome) -> str:
    """path | supervisor | what reached the task | cause | left at SIGKILL | retry / requests."""
    try:
        result, end = outcome.result, outcome.run.end
        records = result.records(1)
        record = records[0] if records else None
        reached = "nothing"
        if record is not None and result.click_wall is not None:
            reached = (
                f"kill_received {(record['wall_origin'] - result.click_wall) * 1000:.0f} ms after the kill"
            )
        cause = f"{record['cause']}/{record['detail']}" if record else "none (died without a word)"
        if record is not None:
            cause += " [" + " ".join(f"{e['event']}@{e['ms']:.0f}" for e in record["timeline"]) + "]"
        if end is None:
            pod_end = "pod ended by itself"
        elif end.by_itself:
            pod_end = f"PID 1 exited {end.took_s:.1f}s after SIGTERM, nothing SIGKILLed; {_gone(outcome)}"
        else:
            pod_end = f"SIGKILLed at {end.took_s:.1f}s with {_what_was_left(outcome)}; {_gone(outcome)}"
        durable = _durable(env, result)
        return (
            f"[pods] {name:<16}| {_scenario_of(result.run_id).mode.name.lower():<10}| {reached} | {cause} | "
            f"{pod_end} | final {result.final_ti.get('state')} try {result.final_ti.get('try_number')}, "
            f"lines try1 {durable.lines_of(1)} try2 {durable.lines_of(2)}, "
            f"model requests {len(durable.requests)} (uninterrupted {UNINTERRUPTED}) | "
            f"notes {result.notes} {outcome.run.notes}"
        )
    except Exception as exc:
        return f"[pods] {name}: no measurements ({exc!r}; error: {outcome.result.error!r})"


def _what_was_left(outcome: Outcome) -> str:
    """The processes left at the SIGKILL, by role (the task, its sandbox, the supervisor)."""
    end, result = outcome.run.end, outcome.result
    assert end is not None
    roles = {result.task_pid: "task", result.supervisor_pid: "supervisor"}
    names = [
        roles.get(pid, "sandbox" if pid in outcome.run.tree else line[:40]) for pid, line in end.left.items()
    ]
    return ", ".join(f"{names.count(n)} {n}" for n in sorted(set(names))) or "nothing"


def _gone(outcome: Outcome) -> str:
    """When the task, the last of its sandbox and the supervisor were seen gone after the SIGTERM."""
    end, result = outcome.run.end, outcome.result
    assert end is not None
    # Neither gone nor left: dead before the SIGTERM (a preStop hook signalled it directly).
    tree = [end.gone.get(pid, None if pid in end.left else 0.0) for pid in outcome.run.tree]
    at = {
        "task": end.gone.get(result.task_pid),
        "sandbox": None if None in tree or not tree else max(t for t in tree if t is not None),
        "supervisor": end.gone.get(result.supervisor_pid),
    }
    return "gone at " + ", ".join(f"{k} {'-' if v is None else f'{v:.2f}s'}" for k, v in at.items())


@contextlib.contextmanager
def judged(e2e: E2EEnv, outcome: Outcome) -> Iterator[None]:
    with explained(e2e, outcome.result):
        yield


def _nothing_of_try_1_left(outcome: Outcome) -> None:
    """Try 1's task process and its sandboxed tree are gone (the tree was up at the kill)."""
    assert len(outcome.run.tree) >= 3, f"try 1's tree was not running at the kill: {outcome.run.tree}"
    assert outcome.run.strays == {}, f"try 1's tree is not under its task {outcome.result.task_pid}"
    assert not is_alive(outcome.result.task_pid)
    alive = sorted(pid for pid in outcome.run.tree if is_alive(pid))
    assert alive == [], f"processes started by try 1 survived: {alive}"


def _task_left_at_sigkill(outcome: Outcome) -> list[int]:
    """Try 1's task process and tree pids that were still there when the pod was SIGKILLed."""
    end = outcome.run.end
    ours = {outcome.result.task_pid, *outcome.run.tree}
    return sorted(pid for pid in (end.left if end else {}) if pid in ours)


def _in_a_new_pod(outcome: Outcome) -> None:
    result = outcome.result
    assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2), result.states_seen
    pod, retry = outcome.run.pod, outcome.retry_pod
    assert pod is not None and retry is not None and retry is not pod
    assert not pod.alive() and retry.pid1 != pod.pid1
    _nothing_of_try_1_left(outcome)


def _resumed(e2e: E2EEnv, outcome: Outcome, *ended: str, last_return_may_be_lost: bool = False) -> None:
    """Try 2 went on after try 1's two completed tool calls; try 1 wrote nothing once try 2 owned
    the record. Killed in a sync tool, try 1 had also recorded the model's call of that tool: try 2
    runs that call again (it never completed) and asks the model nothing it already answered.

    ``last_return_may_be_lost``: try 1 was SIGKILLed, and the last call's return rides with the
    next response, the 1 s flush or the end entry, any of which the SIGKILL may have cut (the
    documented window): try 2 then runs that call again, knowing it is a re-run."""
    result = outcome.result
    run = _durable(e2e, result)
    in_tool = _scenario_of(result.run_id).in_tool
    lost = (
        last_return_may_be_lost
        and not in_tool
        and f"{RECORDED_BY_TRY_1 - 1} messages restored, 1 tool call(s)" in result.log_text(2)
    )
    assert run.lines_of(1) == list(range(1, CELERY_STALL_AFTER + 1)), run.lines
    first_of_try_2 = CELERY_STALL_AFTER if lost else CELERY_STALL_AFTER + 1
    assert run.lines_of(2) == list(range(first_of_try_2, CELERY_STEPS + 1)), run.lines
    assert len(run.requests) <= UNINTERRUPTED + 1, f"{len(run.requests)} model requests over both tries"
    recorded = RECORDED_BY_TRY_1 + 1 if in_tool else RECORDED_BY_TRY_1 - int(lost)
    resuming = [
        f"durable: resuming from try 1 ({end}): {recorded} messages restored, "
        f"{1 if in_tool or lost else 0} tool call(s) in flight run again"
        for end in ended
    ]
    assert any(line in result.log_text(2) for line in resuming), result.log_text(2)
    rerun = [POD_TOOL_AT] if in_tool else [CELERY_STALL_AFTER] if lost else []
    assert [line["n"] for line in run.lines if line["rerun"]] == rerun, run.lines
    if in_tool:
        assert len(run.requests) == UNINTERRUPTED, "a model request was repeated"
    _try_1_wrote_nothing_after_the_takeover(result, run, recorded)


# -- the signal reaches the task ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["fwd_delete", "fwd_delete_tool", "fwd_drain", "warm_prestop"])
def test_a_pod_termination_that_reaches_the_task_evicts_it_and_the_retry_resumes(
    e2e: E2EEnv, pod_runs: dict[str, Outcome], name: str
) -> None:
    """SIGTERM to PID 1 reaches the task (dumb-init -> the supervisor, which forwards it; or the
    preStop recipe, whatever the supervisor does): it records an eviction and its unwind, sandboxed
    tree included, is over before any SIGKILL; the retry resumes in a new pod.

    A 30 s deletion leaves nothing of the task to SIGKILL. A drain's 2 s is below the 4 s budget
    the task is allowed: our unwind must fit in it (it takes tens of ms), but what Airflow does
    after it in the task process (the failure report, the callbacks: 0.2-1.7 s measured under
    load) may not, nor the supervisor's exit. When the task itself was SIGKILLed, its end entry may
    be missing from the record, and the retry then says "died without a word". Nor can the drain
    promise the task *log* its record line: the supervisor ships the task's log lines, and it is
    SIGKILLed at 2 s with whatever it had not written yet (seen under CI load). Under load both
    can be cut (a store call then took over 1.9 s): the retry resumes all the same, and says
    "died without a word"."""
    outcome = pod_runs[name]
    result, end = outcome.result, outcome.run.end
    with judged(e2e, outcome):
        drained = name == "fwd_drain"
        record = (
            _the_record(result, "eviction", "worker shutdown") if not drained or result.records(1) else None
        )
        assert end is not None
        left = _task_left_at_sigkill(outcome)
        assert not outcome.run.tree & set(left), f"the sandbox was SIGKILLed with the pod: {end}"
        if drained and record is not None:
            released = result.event_ms(record, "resources_released")
            assert released is not None and released < DRAIN_GRACE_S * 1000, record["timeline"]
        elif not drained:
            assert left == [], f"the pod was SIGKILLed with {end}"
        _in_a_new_pod(outcome)
        # A task SIGKILLed at the drain may have written its end entry before (one store call,
        # right after its unwind) or not, whether or not its record line reached the log (the
        # supervisor that ships it is SIGKILLed too): the retry says which. A task gone before
        # the SIGKILL wrote it.
        killed = result.task_pid in left
        ends = ("died without a word", "ended eviction") if killed else ("ended eviction",)
        _resumed(e2e, outcome, *ends, last_return_may_be_lost=killed)


@pytest.mark.parametrize("name", ["fwd_mark_failed", "fwd_clear", "warm_mark_failed", "warm_clear"])
def test_a_users_stop_reaches_the_task_in_its_pod(
    e2e: E2EEnv, pod_runs: dict[str, Outcome], name: str
) -> None:
    """Mark failed / Clear do not delete the pod: the supervisor's heartbeat gets the news and
    signals the task's group (with either supervisor: the warm one only stops forwarding the
    signals it receives); the pod then ends by itself."""
    outcome = pod_runs[name]
    result = outcome.result
    with judged(e2e, outcome):
        marked_failed = name.endswith("mark_failed")
        detail = "marked failed" if marked_failed else "cleared"
        _the_record(result, "user", detail)
        assert outcome.run.pod is not None and outcome.run.pod.end is None
        assert not outcome.run.pod.alive()
        _nothing_of_try_1_left(outcome)
        if marked_failed:
            assert (result.final_ti["state"], [t["try_number"] for t in result.tries]) == ("failed", [1])
        else:
            assert (result.final_ti["state"], result.final_ti["try_number"]) == ("success", 2)
            assert _durable(e2e, result).lines_of(2) == list(range(1, CELERY_STEPS + 1)), (
                "a clear starts fresh"
            )


# -- nothing reaches the task ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["warm_delete", "warm_drain", "fwd_node_loss", "fwd_oom"])
def test_a_pod_that_dies_without_a_word_resumes_from_the_record(
    e2e: E2EEnv, pod_runs: dict[str, Outcome], name: str
) -> None:
    """A warm-shutdown supervisor forwards nothing, a node loss or an OOM kill runs no code: no
    record, the retry in a new pod says so and resumes from what try 1 wrote while it ran."""
    outcome = pod_runs[name]
    with judged(e2e, outcome):
        assert outcome.result.records(1) == [], "no code of try 1 should have run after the kill"
        _in_a_new_pod(outcome)
        _resumed(e2e, outcome, "died without a word")
        end = outcome.run.end
        if name.startswith("warm_"):
            assert end is not None and not end.by_itself
            assert outcome.result.task_pid in _task_left_at_sigkill(outcome), "the task outlived the grace"


# -- an unprivileged pod ----------------------------------------------------------------------


@pytest.mark.skipif(NO_RESTRICTED_POD is not None, reason=f"no unprivileged pod here: {NO_RESTRICTED_POD}")
@pytest.mark.parametrize("name", ["rpod_delete", "rpod_drain", "rpod_mark_failed"])
def test_in_an_unprivileged_pod_every_stop_ends_the_sandbox_and_a_hostile_command_is_refused(
    e2e: E2EEnv, pod_runs: dict[str, Outcome], name: str
) -> None:
    """The task runs as uid 50000 with no capabilities, ``no_new_privs`` and the container
    runtime's default seccomp profile: the sandbox is in landlock mode (bubblewrap cannot start
    there). A sandboxed command reads neither the secret in the pod's HOME nor reaches the API
    server's port (the task itself, the control, does both); deletion, drain and *Mark failed*
    each stop every sandboxed process before any SIGKILL."""
    outcome = pod_runs[name]
    result = outcome.result
    with judged(e2e, outcome):
        hostile = json.loads((e2e.state_dir / f"{result.dag_id}.{result.run_id}.hostile.json").read_text())
        assert (hostile["uid"], hostile["mode"]) == (50000, "landlock"), hostile
        assert "pod-secret" not in hostile["stdout"] and "connected" not in hostile["stdout"], hostile
        assert "Permission denied" in hostile["stderr"], hostile
        assert hostile["task_reads"] and hostile["task_connects"], hostile
        if name == "rpod_mark_failed":
            _the_record(result, "user", "marked failed")
            _nothing_of_try_1_left(outcome)
            assert result.final_ti["state"] == "failed"
            return
        end = outcome.run.end
        assert end is not None
        left = _task_left_at_sigkill(outcome)
        assert not outcome.run.tree & set(left), f"the sandbox was SIGKILLed with the pod: {end}"
        _in_a_new_pod(outcome)
