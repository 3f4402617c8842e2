"""The boundary profile against real commands: what it hides, its network switch, its limits, the
listed paths, and the process-group warning. Each check has a control that shows it could fail
(the ``"host"`` profile, ``network=True``, a limit lifted)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import Limits, LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import BoundaryProfile, boundary_argv
from cancellable_agents.toolsets.sandbox.sandbox_tools import _for_model
from tests.process._sandbox_task import Listener
from tests.process.trees import eventually

pytestmark = [
    pytest.mark.process,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not bwrap_support().boundary, reason=f"no boundary profile here: {bwrap_support().boundary_reason}"
    ),
]

NO_LIMITS = Limits(
    max_processes=None,
    memory_bytes=None,
    cpu_seconds=None,
    file_size_bytes=None,
    open_files=None,
    tmp_bytes=None,
)


@pytest.fixture
def outside() -> Iterator[Path]:
    """A folder outside /tmp (the private /tmp hides /tmp in every profile), readable by all."""
    root = Path(tempfile.mkdtemp(prefix="cancellable-agents-outside-", dir="/var/tmp"))
    root.chmod(0o755)
    (root / "airflow.cfg").write_text("sql_alchemy_conn = postgresql://secret\n")
    (root / "airflow.cfg").chmod(0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def listener() -> Iterator[Listener]:
    """A real TCP listener on loopback, counting the connections it accepted."""
    server = Listener()
    yield server
    server.sock.close()


def _run(command: str, **options: object) -> dict[str, object]:
    box = LocalSandbox(isolation="namespace", **options)  # type: ignore[arg-type]
    try:
        return _for_model(box.run(command, timeout=30), 30)
    finally:
        box.destroy()


def test_home_airflow_config_and_unlisted_paths_are_invisible_unless_listed_or_host(outside: Path) -> None:
    cat = f"cat {outside}/airflow.cfg; ls /home /root/.aws 2>&1; ls -d /var 2>&1"
    hidden = _run(cat)
    assert hidden["exit_code"] != 0 and "secret" not in str(hidden["stdout"])
    assert "No such file" in str(hidden["stderr"])
    assert "secret" in str(_run(cat, profile="host")["stdout"]), "control: the host profile shows it"
    assert "secret" in str(_run(cat, read_only_paths=[outside])["stdout"]), "a listed path is visible"
    denied = _run(f"echo x > {outside}/new", read_only_paths=[outside])
    assert denied["exit_code"] != 0 and "Read-only file system" in str(denied["stderr"])
    assert not (outside / "new").exists()


def test_writable_paths_are_writable_and_the_workdir_is_home(outside: Path) -> None:
    outside.chmod(0o777)  # a root worker's commands run as the sandbox's own uid
    result = _run(f"echo made > {outside}/new && echo $HOME && pwd", writable_paths=[outside])
    assert result["exit_code"] == 0, result
    home, cwd = str(result["stdout"]).split()
    assert home == cwd
    assert (outside / "new").read_text() == "made\n"


def test_no_network_by_default_and_network_true_opts_in(listener: Listener) -> None:
    address = (listener.host, listener.port)
    connect = f"python -c \"import socket; socket.create_connection({address!r}, 2); print('in')\""
    blocked = _run(connect)
    assert blocked["exit_code"] != 0 and listener.accepted == 0
    assert "Connection refused" in str(blocked["stderr"]) or "unreachable" in str(blocked["stderr"])
    opened = _run(connect, network=True)
    assert opened["stdout"] == "in\n", "control: network=True reaches the listener"
    eventually(lambda: listener.accepted == 1)  # the kernel accepted it; the listener's thread counts


def test_not_root_and_no_capabilities() -> None:
    result = _run("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = str(result["stdout"]).split("\n")
    assert lines[0] != "0"
    assert "CapEff:\t0000000000000000" in lines and "CapBnd:\t0000000000000000" in lines
    assert "NoNewPrivs:\t1" in lines


def test_process_limit_stops_forks_and_lifting_it_does_not() -> None:
    forks = (
        'python -c "import subprocess\nn = 0\nfor _ in range(60):\n    try:\n'
        "        subprocess.Popen(['sleep', '3']); n += 1\n    except OSError:\n        pass\nprint(n)\""
    )
    assert int(str(_run(forks, limits=Limits(max_processes=20))["stdout"])) < 20
    assert int(str(_run(forks, limits=Limits(max_processes=None))["stdout"])) == 60


def test_file_size_limit_kills_with_a_reason_the_model_reads_and_tmp_is_capped() -> None:
    small = Limits(file_size_bytes=1_000_000, tmp_bytes=2_000_000)
    big = _run("head -c 1500000 /dev/zero > big", limits=small)
    assert big["exit_code"] == 128 + 25
    assert "file size limit" in str(big["killed_by"])
    assert _run("head -c 1500000 /dev/zero > big", limits=NO_LIMITS)["exit_code"] == 0
    full = _run("head -c 900000 /dev/zero > /tmp/a && head -c 900000 /dev/zero > /tmp/b && "
                "head -c 900000 /dev/zero > /tmp/c", limits=small)  # fmt: skip
    assert full["exit_code"] != 0 and "No space left on device" in str(full["stderr"])


def test_memory_and_cpu_limits() -> None:
    grab = "python -c \"b = bytearray(300 * 1024 * 1024); print('got it')\""
    assert _run(grab, limits=Limits(memory_bytes=200 * 1024 * 1024))["exit_code"] != 0
    assert _run(grab, limits=Limits(memory_bytes=None))["stdout"] == "got it\n"
    spin = _run("python -c 'while True: pass'", limits=Limits(cpu_seconds=1))
    assert (spin["exit_code"] in (128 + 24, 128 + 9) and "CPU" in str(spin["killed_by"])) or "SIGKILL" in str(
        spin["killed_by"]
    )


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="max_processes"):
        Limits(max_processes=0)


def test_process_group_mode_warns_once_per_task_that_it_is_no_boundary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scope, other = TaskCancellation("a"), TaskCancellation("b")
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.toolsets.sandbox.local._isolation"):
        boxes = [LocalSandbox(isolation="process-group", scope=s) for s in (scope, scope, other)]
    warnings = [r.getMessage() for r in caplog.records if "NOT a security boundary" in r.getMessage()]
    assert len(warnings) == 2, warnings  # a once, b once
    assert "isolation='process-group'" in warnings[0] and "isolation='auto'" in warnings[0]
    for box in boxes:
        box.destroy()


def test_a_non_root_worker_gets_a_user_namespace_with_a_per_command_process_limit() -> None:
    """What a non-root worker runs (bubblewrap as that user, its own user namespace), here as
    ``nobody``: not root inside, no capabilities, no home folders, and the process limit holds."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command line as another user")
    support = replace(bwrap_support(), user_namespace=True, setpriv=None)
    workdir = Path(tempfile.mkdtemp(prefix="cancellable-agents-userns-"))
    os.chown(workdir, 65534, 65534)
    profile = BoundaryProfile(str(workdir), "/bin/sh", False, (), (), Limits(max_processes=20), uid=None)
    script = (
        "id -u; grep -E '^CapEff' /proc/self/status; ls /root 2>&1 | head -1; "
        "i=0; while [ $i -lt 60 ]; do sleep 3 & i=$((i+1)); done; echo forked=$i"
    )
    try:
        done = subprocess.run(
            [*boundary_argv(support, profile), "/bin/sh", "-c", script],
            user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=30, cwd=workdir,
        )  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if "setting up uid map" in done.stderr or "No permissions to create new namespace" in done.stderr:
        pytest.skip(f"unprivileged user namespaces are off here: {done.stderr.strip()}")
    lines = done.stdout.splitlines()
    assert lines[:2] == ["65534", "CapEff:\t0000000000000000"], (done.stdout, done.stderr)
    assert "No such file" in lines[2]
    assert "forked=60" not in done.stdout and "Cannot fork" in done.stderr, "the process limit did not hold"


def test_files_the_task_writes_stay_changeable_by_the_command() -> None:
    box = LocalSandbox(isolation="namespace")
    try:
        box.write_file("notes/a.txt", "x\n")
        result = box.run("echo y >> notes/a.txt && mkdir notes/more && cat notes/a.txt")
        assert (result.exit_code, result.stdout) == (0, "x\ny\n"), result.stderr
    finally:
        box.destroy()


@pytest.fixture
def unprobed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The bwrap module with its cached answer forgotten for this test (restored after)."""
    from cancellable_agents.toolsets.sandbox.local.boundary import _bwrap as bwrap

    monkeypatch.setattr(bwrap, "_bwrap_cache", None)
    return bwrap


def _bwrap_that_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, times: int) -> Path:
    """A ``bwrap`` first on PATH that SIGTERMs itself at the boundary probe, ``times`` times, then
    is the real one: what a run's descendant reaper does to a probe it finds running."""
    real = shutil.which("bwrap")
    assert real is not None
    count = tmp_path / "killed"
    wrapper = tmp_path / "bin" / "bwrap"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --unshare-net "*)\n'
        f"  n=$(cat {count} 2>/dev/null || echo 0)\n"
        f'  if [ "$n" -lt {times} ]; then echo $((n + 1)) > {count}; kill -TERM $$; fi;;\n'
        "esac\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    return count


def test_a_probe_killed_by_a_signal_is_probed_again_not_taken_as_the_machine_s_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unprobed: Any
) -> None:
    killed = _bwrap_that_is_killed(tmp_path, monkeypatch, times=1)
    support = bwrap_support()
    assert killed.read_text().strip() == "1", "the first boundary probe was killed"
    assert support.boundary and not support.interrupted, support
    assert bwrap_support() is support, "the second answer is cached"


def test_a_probe_killed_every_time_is_answered_for_now_and_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unprobed: Any
) -> None:
    killed = _bwrap_that_is_killed(tmp_path, monkeypatch, times=3)
    first = bwrap_support()
    assert first.interrupted and not first.boundary and "killed by signal 15" in first.boundary_reason
    assert unprobed._bwrap_cache is None
    assert "cut short by a signal" in unprobed.unavailable_message(first, "boundary")
    assert bwrap_support().boundary, "the third probe was not killed: probed again, and it works"
    assert killed.read_text().strip() == "3"


def test_a_probe_run_while_the_task_is_cancelled_is_not_cached(unprobed: Any) -> None:
    """The cancel's reaper may have killed the probe, or collected it so that it read as a success."""
    scope = TaskCancellation("task")
    with scope.activate():
        scope.cancel()
        assert bwrap_support().interrupted
    assert unprobed._bwrap_cache is None
    assert bwrap_support().boundary and unprobed._bwrap_cache is not None
