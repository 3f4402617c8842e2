"""A hostile command against each boundary mode (namespace, landlock; issue 28, item 1): it
cannot read or write outside its workdir and tmp, reach the network (TCP to a listener the test
starts, UDP, netlink, raw, vsock sockets), signal the task or the test, read their ``/proc``
entries, or reach an abstract unix socket the test listens on; it can still run ``sh`` and
``python`` and use its workdir and tmp. Each probe has a control, process-group mode (no
boundary), that shows it could succeed. Real processes, real system calls."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox
from cancellable_agents.toolsets.sandbox.local.boundary import _landlock as landlock
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import interpreter_paths
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import (
    BOUNDARY_FAILED,
    LandlockRuleset,
    LandlockSupport,
    init_argv,
    landlock_support,
)
from tests.process.trees import BOUNDARY_MODES, NAMESPACE_BOUNDARY, landlock_reason, landlock_usable

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

CONFINED = BOUNDARY_MODES
needs_landlock = pytest.mark.skipif(not landlock_usable(), reason=landlock_reason())
needs_scoping = pytest.mark.skipif(
    landlock_support().abi < 6, reason="signal/abstract-socket scoping needs ABI 6"
)


@contextlib.contextmanager
def _sandbox(mode: str, **options: Any) -> Iterator[LocalSandbox]:
    box = LocalSandbox(isolation=mode, stop_grace=0.5, **options)
    try:
        yield box
    finally:
        box.destroy()


def _run(mode: str, command: str | list[str], **options: Any) -> tuple[int | None, str, str]:
    with _sandbox(mode, **options) as box:
        result = box.run(command, timeout=30)
        return result.exit_code, result.stdout, result.stderr


def _python(mode: str, script: str, *args: str) -> Any:
    """Run ``script`` with the sandbox's python; its stdout is JSON."""
    code, out, err = _run(mode, [sys.executable, "-c", script, *args])
    assert code == 0, (code, out, err)
    return json.loads(out)


# -- files ------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A "home" outside every sandbox's workdir, with a secret in it."""
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "secret").write_text("task-secret\n")
    return folder


@pytest.mark.parametrize("mode", [*CONFINED, "process-group"])
def test_a_secret_outside_the_workdir_is_neither_readable_nor_writable_by_absolute_path(
    mode: str, home: Path
) -> None:
    command = f"cat {home}/secret; echo planted > {home}/planted; echo done"
    code, out, err = _run(mode, command)
    assert code == 0 and out.endswith("done\n"), (out, err)
    confined = mode != "process-group"
    assert ("task-secret" in out) is not confined, out
    assert (home / "planted").exists() is not confined  # process-group: the control


@pytest.mark.parametrize("mode", CONFINED)
def test_sh_python_the_workdir_and_the_tmp_still_work(mode: str) -> None:
    """Also the signals a shell pipeline relies on: ``yes`` dies of SIGPIPE, quietly."""
    script = (
        "import json, os, tempfile; open('w.txt', 'w').write('x');"
        "f = tempfile.NamedTemporaryFile(); f.write(b'y'); f.flush();"
        "print(json.dumps([open('w.txt').read(), os.path.dirname(f.name) == tempfile.gettempdir()]))"
    )
    with _sandbox(mode) as box:
        command = 'python -c "$0" && cat w.txt && echo && ls /usr/bin/env && yes | head -c0'
        result = box.run(["/bin/sh", "-c", command, script], timeout=30)
        assert result.exit_code == 0 and result.stderr == "", result
        assert result.stdout.splitlines() == ['["x", true]', "x", "/usr/bin/env"], result.stdout
        assert (box.workdir / "w.txt").read_text() == "x"


@needs_landlock
def test_landlock_commands_see_no_proc_entry_of_the_task_and_no_etc_secret() -> None:
    """No ``/proc/<pid>`` at all (a rule is on an inode: ``/proc/self`` would be the task's) and
    not the files the namespace profile hides; ``/etc/passwd`` and the global ``/proc`` files stay."""
    command = (
        f"cat /proc/{os.getpid()}/environ >/dev/null && echo environ;"
        f"cat /proc/{os.getpid()}/mounts >/dev/null && echo mounts;"
        "cat /etc/shadow >/dev/null && echo shadow; head -c 8 /etc/passwd; echo;"
        "grep -c processor /proc/cpuinfo >/dev/null && echo cpuinfo"
    )
    _, out, err = _run("landlock", command)
    assert out.splitlines() == ["root:x:0", "cpuinfo"], (out, err)
    assert "Permission denied" in err, err


# -- network ----------------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener on 127.0.0.1 (the worker's loopback)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


CONNECT = """
import json, socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    print(json.dumps("connected"))
except OSError as exc:
    print(json.dumps(exc.__class__.__name__))
"""


@pytest.mark.parametrize("mode", [*CONFINED, "process-group"])
def test_a_tcp_listener_on_the_worker_s_loopback_is_unreachable(mode: str, listener: socket.socket) -> None:
    seen = _python(mode, CONNECT, str(listener.getsockname()[1]))
    # Namespace mode: its own loopback, where nothing listens; landlock mode: socket() refused.
    expected = {"namespace": "ConnectionRefusedError", "landlock": "PermissionError"}
    assert seen == expected.get(mode, "connected"), seen


@needs_landlock
@pytest.mark.skipif(landlock_support().abi < 4, reason="Landlock's TCP rules need ABI 4")
def test_landlock_refuses_tcp_connect_even_without_the_seccomp_filter(listener: socket.socket) -> None:
    """The second layer alone: the ruleset applied by the helper with no seccomp program."""
    ruleset = LandlockRuleset.build(
        landlock_support(),
        readable=landlock.readable_paths(interpreter_paths(sys.executable), []),
        writable=[],
        network=False,
    )
    try:
        argv = [*init_argv(sys.executable, ruleset, None), sys.executable, "-I", "-c", CONNECT]
        port = str(listener.getsockname()[1])
        proc = subprocess.run(
            [*argv, port], capture_output=True, timeout=30, pass_fds=(ruleset.fd,), check=False
        )
    finally:
        ruleset.close()
    assert proc.stdout and json.loads(proc.stdout) == "PermissionError", proc


SOCKETS = """
import json, socket
families = {
    "udp": (socket.AF_INET, socket.SOCK_DGRAM), "udp6": (socket.AF_INET6, socket.SOCK_DGRAM),
    "tcp": (socket.AF_INET, socket.SOCK_STREAM), "raw": (socket.AF_INET, socket.SOCK_RAW),
    "netlink": (socket.AF_NETLINK, socket.SOCK_RAW), "packet": (socket.AF_PACKET, socket.SOCK_RAW),
    "vsock": (40, socket.SOCK_STREAM), "unix": (socket.AF_UNIX, socket.SOCK_STREAM),
}
seen = {}
for name, (family, kind) in families.items():
    try:
        socket.socket(family, kind).close()
        seen[name] = "created"
    except OSError as exc:
        seen[name] = exc.__class__.__name__
try:
    socket.socketpair(socket.AF_INET)
    seen["pair-inet"] = "created"
except OSError as exc:
    seen["pair-inet"] = exc.__class__.__name__
print(json.dumps(seen))
"""


@needs_landlock
@pytest.mark.parametrize("unix_sockets", [False, True])
def test_landlock_commands_create_no_socket_but_unix_ones(unix_sockets: bool) -> None:
    """Not covered by Landlock's TCP rules: the seccomp filter refuses every family but AF_UNIX,
    and AF_UNIX too unless the author opted in (named sockets: test_sandbox_leftovers.py)."""
    code, out, err = _run("landlock", [sys.executable, "-c", SOCKETS], unix_sockets=unix_sockets)
    assert code == 0, (code, out, err)
    refused = {
        name: "PermissionError" for name in ("udp", "udp6", "tcp", "raw", "netlink", "packet", "vsock")
    }
    unix = "created" if unix_sockets else "PermissionError"
    assert json.loads(out) == {**refused, "unix": unix, "pair-inet": "PermissionError"}, out


@needs_landlock
def test_landlock_with_network_true_has_the_host_s_network_but_still_no_vsock(
    listener: socket.socket,
) -> None:
    with _sandbox("landlock", network=True) as box:
        connected = box.run([sys.executable, "-c", CONNECT, str(listener.getsockname()[1])], timeout=30)
        result = box.run([sys.executable, "-c", SOCKETS], timeout=30)
    assert json.loads(connected.stdout) == "connected", connected
    seen = json.loads(result.stdout)
    assert seen["udp"] == "created" and seen["vsock"] == "PermissionError", seen


# -- processes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", [NAMESPACE_BOUNDARY, pytest.param("landlock", marks=needs_scoping), "process-group"]
)
def test_the_task_and_the_test_cannot_be_signalled(mode: str) -> None:
    """``kill -0``: the command's parent (the task process, or bwrap's init) and the test."""
    _, out, err = _run(mode, f"kill -0 $PPID; echo parent=$?; kill -0 {os.getpid()}; echo test=$?")
    # Namespace mode: the parent is bubblewrap's init, the test is not in its namespace. On a root
    # worker the command runs as a uid of its own (EPERM for the init); on a non-root one it shares
    # the init's uid in its own user namespace, so may signal it: that ends only the sandbox itself.
    parent = "0" if mode == "process-group" or (mode == "namespace" and os.geteuid() != 0) else "1"
    expected = "parent=0\ntest=0\n" if mode == "process-group" else f"parent={parent}\ntest=1\n"
    assert out == expected, (out, err)


ABSTRACT = """
import json, socket, sys
try:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(b"\\0" + sys.argv[1].encode())
    print(json.dumps("connected"))
except OSError as exc:
    print(json.dumps(exc.__class__.__name__))
"""


@pytest.mark.parametrize(
    "mode", [NAMESPACE_BOUNDARY, pytest.param("landlock", marks=needs_scoping), "process-group"]
)
def test_an_abstract_unix_socket_outside_the_sandbox_is_unreachable(mode: str) -> None:
    name = f"cancellable-agents-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(b"\0" + name.encode())
        server.listen(1)
        seen = _python(mode, ABSTRACT, name)
        if mode == "landlock":
            # socket(AF_UNIX) is refused by default; with it allowed, the scoping still holds.
            code, out, err = _run(mode, [sys.executable, "-c", ABSTRACT, name], unix_sockets=True)
            assert (code, json.loads(out)) == (0, "PermissionError"), (code, out, err)
    # Namespace mode: abstract names are per network namespace; landlock mode: scoped (ABI 6).
    expected = {"namespace": "ConnectionRefusedError", "landlock": "PermissionError"}
    assert seen == expected.get(mode, "connected"), seen


# -- the record, older ABIs, refusals ---------------------------------------------------------


@needs_landlock
def test_the_log_and_the_record_name_the_mode_the_abi_and_what_is_missing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scope = TaskCancellation(budget=5.0)
    with caplog.at_level(logging.INFO), _sandbox("landlock", scope=scope):
        pass
    attached = [e.detail for e in scope.timeline if e.event == "sandbox_attached"]
    abi = landlock_support().abi
    assert attached[0]["mode"] == "landlock" and attached[0]["landlock_abi"] == abi, attached
    assert attached[0]["missing_protections"] == list(LandlockSupport(abi).missing())
    assert "isolation=landlock" in caplog.text and f"Landlock ABI {abi}" in caplog.text, caplog.text


@needs_landlock
def test_on_an_older_abi_what_it_has_is_applied_and_what_it_lacks_is_said(
    monkeypatch: pytest.MonkeyPatch, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ABI 3 (the kernel enforces that ruleset): files still confined, signals not scoped."""
    old = LandlockSupport(3)
    monkeypatch.setattr(landlock, "landlock_support", lambda: old)
    monkeypatch.setattr(landlock, "_warned", landlock.Once())
    with caplog.at_level(logging.WARNING):
        _, out, err = _run("landlock", f"cat {home}/secret; kill -0 $PPID && echo signalled")
    assert "task-secret" not in out and "signalled" in out, (out, err)
    assert "signals and abstract unix sockets" in caplog.text and "Landlock ABI 3" in caplog.text
    assert old.missing() and LandlockSupport(6).missing() == ()


@needs_landlock
def test_landlock_mode_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ConfigurationError, match="egress allowlist"):
        LocalSandbox(isolation="landlock", network=["pypi.org"])
    with pytest.raises(ConfigurationError, match="boundary profile"):
        LocalSandbox(isolation="landlock", profile="host")


@needs_landlock
def test_a_helper_that_cannot_restrict_itself_never_runs_the_command(tmp_path: Path) -> None:
    """A ruleset descriptor that is not one: exit BOUNDARY_FAILED, the command never ran."""
    ruleset = LandlockRuleset(os.open(tmp_path, os.O_RDONLY), landlock_support())
    try:
        argv = [*init_argv(sys.executable, ruleset, None), "/bin/sh", "-c", f"touch {tmp_path}/ran"]
        proc = subprocess.run(argv, capture_output=True, timeout=30, pass_fds=(ruleset.fd,), check=False)
    finally:
        ruleset.close()
    assert proc.returncode == BOUNDARY_FAILED and b"landlock_restrict_self" in proc.stderr, proc
    assert not (tmp_path / "ran").exists()
