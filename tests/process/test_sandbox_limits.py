"""Limits per sandbox against real commands: memory and process count for the whole sandbox (its
cgroup), the workdir's total size (its tmpfs), the CPU limit's SIGXCPU before the SIGKILL, and
a cancel while a command sits at each limit. Each check has a control: the same command without
the cgroup (the per-process limits of before), or with the limit lifted."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from cancellable_agents.core._once import Once
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import Limits, LocalSandbox
from cancellable_agents.toolsets.sandbox.limits import CPU_KILL_GRACE, MiB
from cancellable_agents.toolsets.sandbox.local import _provision as provision
from cancellable_agents.toolsets.sandbox.local.boundary import _cgroups as cgroups
from cancellable_agents.toolsets.sandbox.local.boundary._cgroups import (
    PLACEMENT_FAILED,
    CgroupSupport,
    cgroup_support,
)
from cancellable_agents.toolsets.sandbox.sandbox_tools import _for_model
from tests.process.trees import BOUNDARY_MODES, eventually, survivors

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


needs_cgroup = pytest.mark.skipif(
    cgroup_support().version is None, reason=f"no cgroup per sandbox here: {cgroup_support().reason}"
)

#: Six children of 160 MiB each, alive together; prints how many still hold theirs at the end.
SIX_HOLDERS = """
import subprocess, sys
CHILD = (
    "import sys\\nb = bytearray(160 * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
    "print('held', flush=True)\\nfor _ in sys.stdin: print('still', flush=True)"
)
kids = [subprocess.Popen([sys.executable, '-c', CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True) for _ in range(6)]
held = [k for k in kids if k.stdout.readline() == 'held\\n']
together = 0
for k in held:
    try:
        k.stdin.write('?\\n'); k.stdin.flush()
        together += k.stdout.readline() == 'still\\n'
    except OSError:
        pass
print(together)
"""
#: Touches every page of ``mib`` MiB, then says so.
HOLDER = "b = bytearray({mib} * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('held')"
#: Starts up to 60 sleeps, prints how many it could start.
FORKS = (
    "import subprocess\nn = 0\nfor _ in range(60):\n    try:\n"
    "        subprocess.Popen(['sleep', '{m}']); n += 1\n    except OSError:\n        pass\nprint(n)"
)


@pytest.fixture
def without_cgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandboxes made here get no cgroup: the per-process limits, as before cgroups."""
    monkeypatch.setattr(
        cgroups, "cgroup_support", lambda: CgroupSupport(None, reason="switched off by the test")
    )
    monkeypatch.setattr(cgroups, "_noted", Once())


class Boxes(list[LocalSandbox]):
    """The sandboxes a test made (destroyed after it), all in one boundary mode."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode


@pytest.fixture(params=BOUNDARY_MODES)
def boxes(request: pytest.FixtureRequest) -> Iterator[Boxes]:
    """Each test in each boundary mode: the limits hold the same way in both."""
    made = Boxes(request.param)
    yield made
    for box in made:
        box.destroy()


def _box(boxes: Boxes, limits: Limits, **options: object) -> LocalSandbox:
    box = LocalSandbox(isolation=boxes.mode, limits=limits, **options)  # type: ignore[arg-type]
    boxes.append(box)
    return box


def _killed(boxes: Boxes, sig: int) -> int:
    """A command's exit code when signal ``sig`` killed it: bubblewrap reports ``128 + sig``,
    in landlock mode the command is the main process itself (``-sig``)."""
    return 128 + sig if boxes.mode == "namespace" else -sig


# -- memory and processes for the whole sandbox ------------------------------------------------


@needs_cgroup
def test_six_processes_cannot_together_hold_more_than_the_sandbox_memory(boxes: Boxes) -> None:
    limits = Limits(memory_bytes=256 * MiB)
    result = _box(boxes, limits).run(["python", "-c", SIX_HOLDERS], timeout=60)
    assert result.exit_code == 0, result
    assert int(result.stdout) <= 1, f"{result.stdout.strip()} x 160 MiB held under a 256 MiB sandbox"
    # The command itself survived; the model reads that the limit ended some of its children.
    assert result.memory_limit_kills is not None and result.memory_limit_kills >= 1, result
    answer = _for_model(result, 60)
    assert "killed_by" not in answer and "memory limit ended" in answer["memory_limit"], answer


@needs_cgroup
def test_a_command_past_the_sandbox_memory_reads_out_of_memory_and_a_cpu_kill_does_not(
    boxes: Boxes,
) -> None:
    box = _box(boxes, Limits(memory_bytes=128 * MiB, cpu_seconds=1))
    grab = box.run(["python", "-c", HOLDER.format(mib=300)], timeout=60)
    assert grab.exit_code == _killed(boxes, 9) and grab.memory_limit_kills == 1, grab
    assert _for_model(grab, 60)["killed_by"].startswith("killed (SIGKILL): out of memory")
    # Past the hard CPU limit is a SIGKILL too: the count tells it apart.
    spin = box.run(["python", "-c", CATCHES_SIGXCPU], timeout=30)
    assert spin.exit_code == _killed(boxes, 9) and spin.memory_limit_kills == 0, spin
    assert "not out of memory" in _for_model(spin, 30)["killed_by"]


def test_without_a_cgroup_six_processes_cannot_together_hold_more_than_the_sandbox_memory(
    boxes: Boxes, without_cgroups: None
) -> None:
    """No cgroup (an unprivileged pod): the sandbox counts its tree's memory itself and SIGKILLs
    its commands past the total, naming the limit; the control, a total above what they hold,
    lets all six hold (each stays under the per-process address-space limit)."""
    scope = TaskCancellation(budget=5.0)
    box = _box(boxes, Limits(memory_bytes=256 * MiB), scope=scope)
    assert box.cgroup is None
    result = box.run(["python", "-c", SIX_HOLDERS], timeout=60)
    assert result.stopped and result.limit_exceeded == "memory_bytes", result
    assert result.stdout == "", "the command finished: nothing stopped the six"
    assert "memory_bytes limit was exceeded" in _for_model(result, 60)["stopped"]
    assert any(k.reason.startswith("limit memory_bytes") for k in scope.killed), scope.killed
    control = _box(boxes, Limits(memory_bytes=2048 * MiB)).run(["python", "-c", SIX_HOLDERS], timeout=60)
    assert int(control.stdout) == 6 and control.limit_exceeded is None, control


#: Starts up to 400 sleeps as fast as it can, then waits for them.
STORM = (
    "import subprocess\nkids = [subprocess.Popen(['sleep', '{m}']) for _ in range(400)]\n"
    "print(len(kids))\n[k.wait() for k in kids]"
)


def test_without_a_cgroup_a_fork_storm_is_killed_at_the_sandbox_process_limit(
    boxes: Boxes, without_cgroups: None, marker: str
) -> None:
    scope = TaskCancellation(budget=5.0)
    box = _box(boxes, Limits(max_processes=32), scope=scope)
    result = box.run(["python", "-c", STORM.format(m=marker)], timeout=60)
    assert result.stdout == "", "all 400 started: the limit did not stop the storm"
    assert survivors(marker) == []
    if "Resource temporarily unavailable" in result.stderr:
        # Namespace mode runs commands as a uid of their own (root worker) or in a user namespace
        # of their own (non-root): RLIMIT_NPROC is then the sandbox's count, and the kernel
        # refuses the fork first. Landlock mode shares the worker's uid: only the count holds.
        assert boxes.mode == "namespace", result
        return
    assert result.stopped and result.limit_exceeded == "max_processes", result
    killed = [k for k in scope.killed if k.command_id == result.command_id]
    assert killed and all(k.reason.startswith("limit max_processes") for k in killed), killed


@pytest.mark.parametrize("limit", ["workdir_bytes", "tmp_bytes"])
def test_without_a_tmpfs_a_disk_fill_is_killed_at_the_sandbox_size(
    boxes: Boxes, limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot mount (not root): the workdir's and the private tmp's sizes are
    measured; past them the command is killed, and the limit named."""
    if limit == "tmp_bytes" and boxes.mode == "namespace":
        pytest.skip("namespace mode's /tmp is bubblewrap's tmpfs of tmp_bytes: the kernel bounds it")
    monkeypatch.setattr(provision, "mount_workdir", lambda folder, size: False)  # where a sandbox mounts
    box = _box(boxes, Limits(**{limit: 16 * MiB}))
    folder = "." if limit == "workdir_bytes" else "$TMPDIR"
    fill = f"for i in $(seq 64); do head -c 1048576 /dev/zero > {folder}/f$i; done; sleep 60"
    result = box.run(fill, timeout=60)
    assert result.stopped and result.limit_exceeded == limit, result
    assert not result.timed_out


@needs_cgroup
def test_a_fork_bomb_is_capped_by_the_sandbox_process_limit_across_commands(
    boxes: Boxes, marker: str
) -> None:
    limits = Limits(max_processes=40)
    box = _box(boxes, limits)
    box.start(f"i=0; while [ $i -lt 25 ]; do sleep {marker} & i=$((i+1)); done; wait")
    eventually(lambda: len(survivors(marker, name="sleep")) == 25)
    result = box.run(["python", "-c", FORKS.format(m=marker)], timeout=30)
    second = int(result.stdout)
    assert second < 40 - 25, f"the second command started {second} processes beside 25 others"
    assert box.cgroup is not None and box.cgroup.process_limit_hits() > 0
    assert result.process_limit_hits and "refused at the sandbox's process limit" in str(
        _for_model(result, 30)["process_limit"]
    )
    # The count is the sandbox's, not the machine's: another sandbox starts more.
    other = int(_box(boxes, limits).run(["python", "-c", FORKS.format(m=marker)], timeout=30).stdout)
    assert other > second


@needs_cgroup
def test_a_command_that_cannot_be_placed_in_the_cgroup_never_runs(boxes: Boxes) -> None:
    box = _box(boxes, Limits())
    assert box.cgroup is not None
    box.cgroup.remove()
    result = box.run("touch ran", timeout=30)
    assert result.exit_code == PLACEMENT_FAILED
    assert not (box.workdir / "ran").exists()


def test_without_a_cgroup_sandboxes_say_so_once_and_keep_the_per_process_limits(
    boxes: Boxes, without_cgroups: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(
        logging.WARNING, logger="cancellable_agents.toolsets.sandbox.local.boundary._cgroups"
    ):
        first, second = _box(boxes, Limits()), _box(boxes, Limits())
    notes = [r.getMessage() for r in caplog.records if "no cgroup per sandbox" in r.getMessage()]
    assert len(notes) == 1 and "switched off by the test" in notes[0]
    assert first.cgroup is None and second.cgroup is None
    assert first.run("ulimit -v", timeout=30).stdout.strip() == str(
        4 * 1024 * MiB // 1024
    )  # the default, in KiB


@needs_cgroup
def test_destroy_removes_the_sandbox_cgroup(boxes: Boxes) -> None:
    box = _box(boxes, Limits())
    assert box.cgroup is not None and all(path.is_dir() for path in box.cgroup.paths)
    box.run("sleep 0.1 & echo started", timeout=30)
    box.destroy()
    assert not any(path.exists() for path in box.cgroup.paths)


@needs_cgroup
def test_a_cgroup_a_killed_task_left_is_removed_by_the_next_sandbox_but_a_live_one_is_not(
    boxes: Boxes,
) -> None:
    live = _box(boxes, Limits())
    assert live.cgroup is not None
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid belongs to nobody now
    tag = f"{os.stat('/proc/self/ns/pid').st_ino}.{gone.pid}.1"
    left = [parent / f"cancellable-agents-{tag}-dead" for parent in {p.parent for p in live.cgroup.paths}]
    for path in left:
        path.mkdir()
    try:
        _box(boxes, Limits())
        assert not any(path.exists() for path in left)
        assert all(path.is_dir() for path in live.cgroup.paths)
        assert live.run("true", timeout=30).exit_code == 0
    finally:
        for path in left:
            if path.exists():
                path.rmdir()


# -- the workdir's total --------------------------------------------------------------------


@pytest.mark.parametrize("workdir_bytes", [2 * MiB, None])
def test_the_workdir_has_a_total_size_for_commands_and_file_tools(
    boxes: Boxes, workdir_bytes: int | None
) -> None:
    box = _box(boxes, Limits(workdir_bytes=workdir_bytes))
    if workdir_bytes is not None and not box.workdir.is_mount():
        pytest.skip("this worker cannot mount a tmpfs (not root)")
    writes = box.run("for f in a b c; do head -c 900000 /dev/zero > $f || exit 1; done", timeout=30)
    if workdir_bytes is None:
        assert writes.exit_code == 0
        box.write_file("d", "x" * 3 * MiB)
        return
    assert writes.exit_code == 1 and "No space left on device" in writes.stderr
    with pytest.raises(OSError, match="No space left"):
        box.write_file("d", "x" * 3 * MiB)


def test_a_workdir_the_author_passed_is_not_covered(boxes: Boxes, tmp_path: object) -> None:
    """A tmpfs on the author's own folder would hide what is in it."""
    box = _box(boxes, Limits(workdir_bytes=MiB), workdir=tmp_path)
    assert not box.workdir.is_mount()


# -- CPU ------------------------------------------------------------------------------------

CATCHES_SIGXCPU = (
    "import signal\nsignal.signal(signal.SIGXCPU, lambda *_: print('SIGXCPU', flush=True))\nwhile True: pass"
)


def test_the_cpu_limit_sends_sigxcpu_first_and_sigkill_a_grace_later(boxes: Boxes) -> None:
    box = _box(boxes, Limits(cpu_seconds=1))
    caught = box.run(["python", "-c", CATCHES_SIGXCPU], timeout=30)
    # SIGXCPU at the soft limit, once a CPU second up to the hard one, then SIGKILL.
    assert caught.stdout.splitlines()[0] == "SIGXCPU"
    assert 1 <= caught.stdout.count("SIGXCPU") <= CPU_KILL_GRACE + 1
    assert caught.exit_code == _killed(boxes, 9) and "SIGKILL" in _for_model(caught, 30)["killed_by"]
    plain = box.run(["python", "-c", "while True: pass"], timeout=30)
    assert plain.exit_code == _killed(boxes, 24) and "CPU" in _for_model(plain, 30)["killed_by"]


# -- a cancel at each limit -----------------------------------------------------------------

AT_THE_LIMIT = {
    # Holds all but 24 MiB of the sandbox's 128 MiB, then waits.
    "memory": (
        Limits(memory_bytes=128 * MiB),
        "import time\nb = bytearray(104 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
        "open('ready', 'w').close()\ntime.sleep({m})",
    ),
    # Forks sleeps until the process limit refuses one, then waits.
    "processes": (
        Limits(max_processes=30),
        "import subprocess, time\ntry:\n    while True: subprocess.Popen(['sleep', '{m}'])\n"
        "except OSError:\n    pass\nopen('ready', 'w').close()\ntime.sleep({m})",
    ),
    # Past its CPU soft limit, ignoring SIGXCPU and SIGTERM, spinning towards the hard one.
    "cpu": (
        Limits(cpu_seconds=1),
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGXCPU, lambda *_: open('ready', 'w').close())\nwhile True: pass",
    ),
}


@pytest.mark.parametrize("limit", list(AT_THE_LIMIT))
def test_a_kill_at_each_limit_unwinds_within_the_budget_and_is_recorded(
    boxes: Boxes, limit: str, marker: str
) -> None:
    limits, script = AT_THE_LIMIT[limit]
    scope = TaskCancellation("t", budget=3.0)
    box = _box(boxes, limits, scope=scope, stop_grace=0.5)
    if limit == "processes" and boxes.mode == "landlock" and box.cgroup is None:
        # Documented: without a cgroup (a non-root pod) landlock mode cannot count processes.
        pytest.skip(
            f"max_processes is not enforced in landlock mode without a cgroup: {cgroup_support().reason}"
        )
    command = box.start(["python", "-c", script.format(m=marker)])
    eventually(lambda: (box.workdir / "ready").exists(), timeout=20)
    started = time.monotonic()
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(scope.budget + 2)
    assert time.monotonic() - started <= scope.budget
    assert scope.stragglers == []
    assert box.wait(command, timeout=1).stopped
    assert [k for k in scope.killed if k.command_id == command], scope.killed
    assert survivors(marker) == []
    if box.cgroup is not None:
        assert not any(path.exists() for path in box.cgroup.paths)
