"""Parent side of the kill-latency benchmark: start the run, kill it, time the unwind.

Per repetition: tell a (warm, long-lived) child to start the scenario, wait for the scenario's
moment, send one SIGTERM to the task pid and take the time, then measure

- **raised**: SIGTERM -> ``execute`` raised in the task process. If nothing is raised within
  Airflow's 5 s grace the child is SIGKILLed, as the supervisor would, and the kill is *lost*;
- **gone**: SIGTERM -> everything the repetition started is gone: the run raised, every HTTP
  request it made has ended on the server, every marked process has exited, and every tool
  thread has ended (or the task process has exited, which ends them). Whatever is still there
  a second after the grace (after the supervisor's SIGKILL) is a *leak* (then killed by pid);
- **outlived the run**: something the run started was still running when ``execute`` raised.

A repetition the harness could not measure (the child died, the moment to kill never came) is
kept with its ``error`` and left out of the statistics.

For the ``timeout`` scenario there is no SIGTERM: both times are measured from the deadline the
implementation acts on (reported by the child).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.kill_scenarios import Impl, Scenario
from tests.taskproc import GRACE, TaskChild, kill_markers, marker_processes, wait_markers_gone

from cancellable_agents.testing.openai_server import ScriptedModelServer

#: How long a child may take to import and build its first operator on a busy machine.
START_TIMEOUT = 90.0
#: How long to wait for the scenario's moment to kill.
READY_TIMEOUT = 30.0
#: What is still there this long after the grace ended counts as leaked.
LEAK_SLACK = 1.0
#: How long the server may take to notice a closed request (it selects on the socket).
OUTLIVE_SLACK = 0.005


@dataclass
class RepResult:
    """One measured repetition. Times in ms after the trigger; ``None`` means never (lost / leak)."""

    rep: int
    raised_ms: float | None
    gone_ms: float | None
    outcome: str
    noticed_ms: float | None = None
    """SIGTERM -> the Task SDK's handler started in the task process (``None``: never)."""
    exc_type: str = ""
    cause: str | None = None
    sigkilled: bool = False
    leaked: list[str] = field(default_factory=list)
    outlived: list[str] = field(default_factory=list)
    """What the run started that was still running after ``execute`` raised (see ``_outlived``)."""
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ChildPool:
    """Keeps one warm spare child, so replacing a spent one costs no import time."""

    def __init__(self, module: str, env: dict[str, str], log_dir: Path, tag: str) -> None:
        self._module, self._env, self._log_dir, self._tag = module, env, log_dir, tag
        self._spare: TaskChild | None = None
        self._count = 0

    def _spawn(self) -> TaskChild:
        self._count += 1
        return TaskChild(self._module, self._env, self._log_dir / f"{self._tag}-{self._count}.log")

    def get(self, current: TaskChild | None) -> TaskChild:
        """``current`` if it can serve another repetition, else the spare (and a new spare)."""
        if current is not None and current.alive:
            return current
        if current is not None:
            current.close(1.0)
        child = self._spare if self._spare is not None and self._spare.alive else self._spawn()
        self._spare = self._spawn()
        return child

    def close(self) -> None:
        if self._spare is not None:
            self._spare.close(2.0)


def new_marker(rng: random.Random) -> str:
    """A ``sleep`` argument unique to one repetition: ~10 minutes if nothing kills it."""
    return f"6{rng.randrange(100):02d}.{rng.randrange(10**8):08d}"


def measure_scenario(
    scenario: Scenario,
    impl: Impl,
    reps: int,
    server: ScriptedModelServer,
    env: dict[str, str],
    log_dir: Path,
    progress: Callable[[str], None] = print,
) -> list[RepResult]:
    """Run ``reps`` measured repetitions of ``scenario`` through ``impl``."""
    rng = random.Random()
    pool = ChildPool("benchmarks._child", env, log_dir, f"{scenario.name}-{impl}")
    results: list[RepResult] = []
    child: TaskChild | None = None
    try:
        for rep in range(reps):
            child = pool.get(child)
            marker = new_marker(rng)
            try:
                result = _one_rep(scenario, impl, rep, marker, child, server)
            except _RepFailed as exc:
                child.sigkill()
                result = RepResult(rep, None, None, "error", error=f"{exc}\n{child.tail(15)}")
            finally:
                leftovers = kill_markers(marker)
            if leftovers and "processes" not in result.leaked:
                result.leaked.append("processes")
            results.append(result)
            progress(_progress_line(scenario, impl, result))
    finally:
        if child is not None:
            child.close(2.0)
        pool.close()
    return results


class _RepFailed(Exception):
    """The repetition could not be measured (the child died early, the moment never came)."""


def _one_rep(
    scenario: Scenario, impl: Impl, rep: int, marker: str, child: TaskChild, server: ScriptedModelServer
) -> RepResult:
    server.reset()
    child.send({"scenario": scenario.name, "impl": impl, "marker": marker, "rep": rep})
    if child.wait_for({"started"}, START_TIMEOUT) is None:
        raise _RepFailed("the child did not start the repetition")
    events: list[dict[str, Any]] = []
    _await_moment(scenario, marker, child, server, events)
    sent = child.sigterm() if scenario.trigger == "sigterm" else None
    limit = time.monotonic() + (GRACE if sent is not None else GRACE + 10.0)
    done = _collect(child, events, {"rep_done"}, limit)
    sigkilled = False
    if not any(e["event"] in ("raised", "returned") for e in events):
        child.dump_stacks()  # into its log: where a lost kill was stuck
        child.sigkill()  # the supervisor's SIGKILL at the end of the grace
        sigkilled = True
    if not done and not sigkilled and not child.alive:
        raise _RepFailed("the child died during the repetition")
    if sent is None:
        trigger = next((e["at"] for e in events if e["event"] == "trigger"), None)
        if trigger is None:
            raise _RepFailed("no timeout trigger reported")
        sent = trigger
    return _result(rep, sent, events, child, server, marker, scenario, sigkilled)


def _await_moment(
    scenario: Scenario,
    marker: str,
    child: TaskChild,
    server: ScriptedModelServer,
    events: list[dict[str, Any]],
) -> None:
    ok: Any = True
    if scenario.ready == "tokens":
        ok = server.wait_for_tokens(3, timeout=READY_TIMEOUT)
    elif scenario.ready == "request":
        ok = server.wait_for_request(1, timeout=READY_TIMEOUT)
    elif scenario.ready in ("tool_started", "ready"):
        event = child.wait_for({scenario.ready}, READY_TIMEOUT)
        ok = event is not None
        if event is not None:
            events.append(event)
    elif scenario.ready == "markers":
        ok = _wait_until(lambda: len(marker_processes_named(marker, "sleep")) >= scenario.marker_count)
    if not ok:
        raise _RepFailed(f"the moment to kill ({scenario.ready}) never came")


def marker_processes_named(marker: str, name: str) -> list[int]:
    import psutil

    found = []
    for pid in marker_processes(marker):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).name() == name:
                found.append(pid)
    return found


def _wait_until(predicate: Callable[[], bool], timeout: float = READY_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # polling the process table: there is no event for "a process started"
    return True


def _collect(child: TaskChild, events: list[dict[str, Any]], until: set[str], limit: float) -> bool:
    """Append the child's events until one named in ``until`` (True) or ``limit`` / exit (False)."""
    while True:
        event = child.next_event(limit - time.monotonic())
        if event is None:
            return False
        events.append(event)
        if event["event"] in until:
            return True
        if event["event"] == "_eof":
            return False


def _result(
    rep: int,
    sent: float,
    events: list[dict[str, Any]],
    child: TaskChild,
    server: ScriptedModelServer,
    marker: str,
    scenario: Scenario,
    sigkilled: bool,
) -> RepResult:
    end = next((e for e in events if e["event"] in ("raised", "returned")), None)
    raised_at = end["at"] if end is not None and end["event"] == "raised" and not sigkilled else None
    ended = _what_ended_when(events, child, server, marker, scenario, deadline=sent + GRACE + LEAK_SLACK)
    leaked = [kind for kind, at in ended.items() if at is None]
    times = [at for at in ended.values() if at is not None] + ([raised_at] if raised_at is not None else [])
    outlived = _outlived(events, server) if raised_at is not None else []
    if end is None or sigkilled:
        outcome = "lost: SIGKILL at 5 s"
    else:
        outcome = "raised" if end["event"] == "raised" else "lost: ended SUCCESS"
    noticed = next((e["t"] for e in events if e["event"] == "signal"), None)
    return RepResult(
        rep,
        noticed_ms=None if noticed is None or scenario.trigger != "sigterm" else (noticed - sent) * 1000,
        raised_ms=None if raised_at is None else (raised_at - sent) * 1000,
        gone_ms=None if leaked else max(0.0, (max(times, default=sent) - sent) * 1000),
        outcome=outcome,
        exc_type=end.get("exc_type", "") if end else "",
        cause=end.get("cause") if end else None,
        sigkilled=sigkilled,
        leaked=leaked,
        outlived=outlived,
    )


def _outlived(events: list[dict[str, Any]], server: ScriptedModelServer) -> list[str]:
    """What the run started that was still running when the task process reported the run over.

    The inside view at ``rep_done`` (right after ``execute`` raised, before any process exit):
    tool threads and marked processes the child saw alive, HTTP requests the server still had
    open (with a few ms for the server to notice a close).
    """
    done = next((e for e in events if e["event"] == "rep_done"), None)
    if done is None:
        return []
    out = [kind for kind in ("threads", "processes") if done.get(kind)]
    if any(r.ended_at is None or r.ended_at > done["t"] + OUTLIVE_SLACK for r in server.requests):
        out.append("http")
    return out


def _what_ended_when(
    events: list[dict[str, Any]],
    child: TaskChild,
    server: ScriptedModelServer,
    marker: str,
    scenario: Scenario,
    deadline: float,
) -> dict[str, float | None]:
    """When each kind of thing the repetition started was last seen gone (``None``: a leak).

    A leaked thing still there at ``deadline`` (a second after the grace, i.e. after the
    supervisor's SIGKILL) is killed by the caller.
    """
    ended: dict[str, float | None] = {}
    done = next((e for e in events if e["event"] == "rep_done"), None)
    exits = [e["t"] for e in events if e["event"] == "tool_exited"]
    if done is None or not done["clean"]:
        # The task process is leaving (or was SIGKILLed): its threads end with it.
        child.wait_exit(max(0.0, deadline - time.monotonic()) + 0.5)
        if done is None or done["threads"]:
            ended["threads"] = child.exited_at
    if exits and "threads" not in ended:
        ended["threads"] = max(exits)
    ended["http"] = _http_closed(server, deadline)
    if scenario.marker_count:
        ended["processes"] = wait_markers_gone(marker, deadline)
    return ended


def _http_closed(server: ScriptedModelServer, deadline: float) -> float | None:
    """When the last request of this repetition ended on the server (``None``: one is still open)."""
    while True:
        records = server.requests
        if all(r.outcome is not None for r in records):
            return max((r.ended_at or 0.0 for r in records), default=0.0)
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        server.wait_for_finished(len(records), timeout=min(0.5, left))


def _progress_line(scenario: Scenario, impl: Impl, r: RepResult) -> str:
    def fmt(v: float | None) -> str:
        return "never" if v is None else f"{v:7.1f}"

    extra = f" leaked={','.join(r.leaked)}" if r.leaked else ""
    extra += " (handler never ran)" if r.noticed_ms is None and scenario.trigger == "sigterm" else ""
    extra += " SIGKILL@5s" if r.sigkilled else ""
    extra += f" error={r.error.splitlines()[0]}" if r.error else ""
    return (
        f"  {scenario.name:<18} {impl:<9} rep {r.rep:>2}: raised {fmt(r.raised_ms)} ms, "
        f"gone {fmt(r.gone_ms)} ms{extra}"
    )
