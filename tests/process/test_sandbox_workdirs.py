"""A SIGKILLed task leaves its sandbox workdir behind; the next sandbox removes it, and only it.

The owner is a real process that creates a :class:`LocalSandbox`, writes a file into it and is
then SIGKILLed (nothing in it can clean up), or is left alive, or exits normally.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cancellable_agents.toolsets.sandbox import LocalSandbox
from cancellable_agents.toolsets.sandbox.local._workdirs import WORKDIR_PREFIX, remove_orphaned_workdirs
from tests.process.restricted_pod import POD_GID, POD_UID, pod_env, restricted_argv, unavailable_reason

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

Owner = tuple[subprocess.Popen[str], Path]

OWNER = (
    "import sys\n"
    "from cancellable_agents.toolsets.sandbox import LocalSandbox\n"
    "sandbox = LocalSandbox(isolation='process-group')\n"
    "(sandbox.workdir / 'build.log').write_bytes(b'x' * 100_000)\n"
    "print(sandbox.workdir, flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def owner() -> Iterator[Owner]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    workdir = Path(proc.stdout.readline().strip())
    assert (workdir / "build.log").exists()
    yield proc, workdir
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_the_next_sandbox_removes_the_workdir_of_a_sigkilled_task(owner: Owner) -> None:
    proc, workdir = owner
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert workdir.exists(), "a SIGKILLed process cannot clean up: the premise of this test"
    sandbox = LocalSandbox(isolation="process-group")
    try:
        assert not workdir.exists(), "the dead task's workdir outlived the next sandbox's start"
        assert sandbox.workdir.exists()
    finally:
        sandbox.destroy()


def test_a_live_tasks_workdir_is_kept_and_a_normal_exit_removes_its_own(owner: Owner) -> None:
    proc, workdir = owner
    LocalSandbox(isolation="process-group").destroy()
    assert (workdir / "build.log").exists(), "a running task's workdir was removed"
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(10) == 0
    assert not workdir.exists()


def test_directories_whose_owner_cannot_be_checked_are_left_alone(tmp_path: Path) -> None:
    dead_pid = _a_dead_pid()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    own_dead = tmp_path / f"{WORKDIR_PREFIX}{namespace}.{dead_pid}.1-abc"
    foreign = tmp_path / f"{WORKDIR_PREFIX}{namespace + 1}.{dead_pid}.1-abc"  # another pid namespace
    unnamed = tmp_path / f"{WORKDIR_PREFIX}q1w2e3"  # an older version's, or someone's own
    recycled = tmp_path / f"{WORKDIR_PREFIX}{namespace}.{os.getpid()}.1-abc"  # our pid, not our start
    for folder in (own_dead, foreign, unnamed, recycled):
        folder.mkdir()
    assert sorted(remove_orphaned_workdirs(tmp_path)) == sorted([own_dead, recycled])
    assert foreign.exists() and unnamed.exists()


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


SWEEP = (
    "import logging, sys\n"
    "logging.basicConfig()\n"
    "from cancellable_agents.toolsets.sandbox.local._workdirs import remove_orphaned_workdirs\n"
    "print([p.name for p in remove_orphaned_workdirs(sys.argv[1])])\n"
)


@pytest.mark.skipif(bool(unavailable_reason()), reason=str(unavailable_reason()))
def test_a_non_root_sweep_leaves_another_users_workdirs_alone() -> None:
    """A non-root worker beside a root one (one ``/tmp``): the root worker's orphan, with its
    tmpfs, is not the non-root sweep's to remove, and no failed unmount is logged for it."""
    shared = Path(tempfile.mkdtemp(prefix="cancellable-agents-shared-tmp-"))
    shared.chmod(0o1777)  # like /tmp
    dead, namespace = _a_dead_pid(), os.stat("/proc/self/ns/pid").st_ino
    roots = shared / f"{WORKDIR_PREFIX}{namespace}.{dead}.1-root"
    mine = shared / f"{WORKDIR_PREFIX}{namespace}.{dead}.1-pod"
    roots.mkdir()
    mine.mkdir()
    os.chown(mine, POD_UID, POD_GID)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(roots)], check=True, timeout=30)
    try:
        sweep = subprocess.run(
            restricted_argv([sys.executable, "-c", SWEEP, str(shared)], runtime_default=False),
            env=pod_env(shared),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert sweep.returncode == 0, sweep.stderr[-2000:]
        assert sweep.stdout.split("\n")[-2] == f"[{mine.name!r}]", sweep.stdout
        assert "could not be unmounted" not in sweep.stderr, sweep.stderr
        assert os.path.ismount(roots) and not mine.exists()
    finally:
        subprocess.run(["umount", "-l", str(roots)], check=False, timeout=30)
        shutil.rmtree(shared, ignore_errors=True)
