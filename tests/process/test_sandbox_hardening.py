"""The boundary profile against a hostile command (issue 21, items 1-3): the seccomp filter
(nested namespaces, keyrings, ptrace, process_vm_*, io_uring denied with EPERM, not a kill),
file tools a command racing them cannot redirect, and the environment by allowlist, in each
boundary mode (namespace, landlock). Each check has a control that shows it could fail (the
``"host"`` profile beside namespace mode, process-group mode beside landlock mode, the filter
missing, a forced fallback)."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents.core._once import Once
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support
from cancellable_agents.toolsets.sandbox.local._files import WorkdirFiles, openat2_supported
from cancellable_agents.toolsets.sandbox.local.boundary import _seccomp as seccomp_module
from cancellable_agents.toolsets.sandbox.protocol import SandboxPathError
from tests.process.trees import BOUNDARY_MODES, LANDLOCK, NAMESPACE_BOUNDARY

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

needs_namespace = pytest.mark.skipif(
    not bwrap_support().boundary,
    reason=f"no boundary profile here: {bwrap_support().boundary_reason or bwrap_support().reason}",
)
#: What shows a probe could succeed without the boundary: the host profile beside namespace
#: mode, process-group mode beside landlock mode.
CONTROL: dict[str, dict[str, Any]] = {
    "namespace": {"isolation": "namespace", "profile": "host"},
    "landlock": {"isolation": "process-group"},
}

needs_filter = pytest.mark.skipif(
    seccomp_module.seccomp_filter().program is None, reason=seccomp_module.seccomp_filter().reason
)


def _run(command: str | list[str], **options: Any) -> tuple[int | None, str, str]:
    box = LocalSandbox(**{"isolation": "namespace", **options})
    try:
        result = box.run(command, timeout=30)
        return result.exit_code, result.stdout, result.stderr
    finally:
        box.destroy()


# -- the seccomp filter ---------------------------------------------------------------------

NESTED = (
    "unshare -r id -u; echo unshare=$?; "
    "bwrap --unshare-user --ro-bind / / --dev /dev true; echo bwrap=$?; echo alive"
)


def _worker_can_unshare() -> bool:
    """Whether the test process itself may make a user namespace (not in a restricted pod,
    whose own seccomp profile refuses it: there the control cannot succeed either)."""
    return (
        subprocess.run(["unshare", "-r", "true"], capture_output=True, timeout=30, check=False).returncode
        == 0
    )


@needs_filter
@pytest.mark.parametrize("mode", BOUNDARY_MODES)
def test_nested_namespaces_are_denied_with_eperm_not_a_kill(mode: str) -> None:
    code, out, err = _run(NESTED, isolation=mode)
    assert code == 0 and out.endswith("alive\n"), (out, err)
    assert "unshare=0" not in out and "bwrap=0" not in out, (out, err)
    assert "Operation not permitted" in err, err
    if not _worker_can_unshare():
        return  # a restricted pod: the worker's own profile refuses them; no control to show
    # Control: the same command where the filter is not applied (the host profile) does it.
    code, out, err = _run(NESTED, **CONTROL[mode])
    assert "unshare=0" in out and "bwrap=0" in out, (out, err)


#: Syscalls a probe inside the sandbox makes: name -> arguments after the number. Unfiltered, each
#: can succeed (a read of the key, PTRACE_TRACEME, an empty process_vm_readv of itself, a ring).
PROBE = """
import ctypes, json, os, sys
numbers, key = json.loads(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf, params = ctypes.create_string_buffer(64), ctypes.create_string_buffer(120)
calls = {
    "keyctl": (11, key, buf, 64),              # KEYCTL_READ
    "ptrace": (0, 0, 0, 0),                    # PTRACE_TRACEME
    "process_vm_readv": (os.getpid(), 0, 0, 0, 0, 0),
    "io_uring_setup": (1, params),
}
seen = {}
for name, args in calls.items():
    ctypes.set_errno(0)
    # Each argument as a long: syscall(2) reads longs, and an int passed through its varargs on
    # the stack (process_vm_readv's flags, the seventh) may carry garbage in its upper half,
    # which the kernel refuses with EINVAL (one machine did, every time).
    longs = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long(numbers[name]), *longs)
    seen[name] = [result, ctypes.get_errno()]
seen["key"] = buf.value.decode()
print(json.dumps(seen))
"""


def _syscall_numbers() -> dict[str, int]:
    import pyseccomp

    names = ("keyctl", "ptrace", "process_vm_readv", "io_uring_setup", "add_key")
    return {name: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) for name in names}


#: The task: a session keyring of its own with a key in it (where its own seccomp profile lets
#: it: a restricted pod's refuses keyrings to the task too), then the probe in the mode and in its
#: control.
TASK = """
import ctypes, json, sys
from cancellable_agents.toolsets.sandbox import LocalSandbox
numbers, probe, runs = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall(numbers["keyctl"], 1, None)  # KEYCTL_JOIN_SESSION_KEYRING: a fresh one
key = libc.syscall(numbers["add_key"], b"user", b"cancellable-agents-test", b"task-secret", 11, -3)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
seen = {"task_has_a_keyring": key > 0, "task_seccomp": status["Seccomp"].strip()}
for name, options in runs.items():
    box = LocalSandbox(**options)
    result = box.run([sys.executable, "-c", probe, sys.argv[1], str(key)], timeout=30)
    box.destroy()
    seen[name] = json.loads(result.stdout) if result.exit_code == 0 else result.stderr
print(json.dumps(seen))
"""


@needs_filter
@pytest.mark.parametrize("mode", BOUNDARY_MODES)
def test_keyrings_ptrace_process_vm_and_io_uring_are_denied_with_eperm(mode: str) -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    runs = json.dumps({"boundary": {"isolation": mode}, "control": CONTROL[mode]})
    task = subprocess.run(
        [sys.executable, "-c", TASK, json.dumps(_syscall_numbers()), PROBE, runs],
        capture_output=True, text=True, timeout=90, env=env, check=False,
    )  # fmt: skip
    assert task.returncode == 0, task.stderr
    seen = json.loads(task.stdout)
    filtered, unfiltered = seen["boundary"], seen["control"]
    for name in ("keyctl", "ptrace", "process_vm_readv", "io_uring_setup"):
        assert filtered[name] == [-1, errno.EPERM], (name, filtered)
    assert filtered["key"] == ""
    # Control: unfiltered, the key in the task's session keyring is readable and the calls work
    # (io_uring: unless the task's own runtime profile refuses it, as a restricted pod's does).
    assert unfiltered["process_vm_readv"][0] == 0, unfiltered
    if seen["task_seccomp"] == "0":
        assert unfiltered["io_uring_setup"][0] >= 0, unfiltered
    if seen["task_has_a_keyring"]:  # not in a restricted pod, whose profile refuses keyrings
        assert unfiltered["key"] == "task-secret", unfiltered


#: socket() by syscall number, so the family can carry bits above 32 (the kernel reads an int:
#: 0x1_0000_0028 is AF_VSOCK too). Each family's outcome: "created" or the errno's name.
SOCKETS = """
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
number = ctypes.c_long(int(sys.argv[1]))
seen = {}
for name, family in (("vsock", 40), ("vsock_high_bits", (1 << 32) | 40), ("inet", 2), ("unix", 1)):
    ctypes.set_errno(0)
    fd = libc.syscall(number, ctypes.c_long(family), ctypes.c_long(1), ctypes.c_long(0))  # SOCK_STREAM
    seen[name] = "created" if fd >= 0 else errno.errorcode[ctypes.get_errno()]
    if fd >= 0:
        libc.close(fd)
print(json.dumps(seen))
"""


@needs_filter
@pytest.mark.parametrize("mode", BOUNDARY_MODES)
@pytest.mark.parametrize(
    "network", [False, True, ["pypi.org"]], ids=["no-network", "host-network", "allowlist"]
)
def test_vsock_sockets_are_denied_with_eperm_in_every_boundary_mode(mode: str, network: Any) -> None:
    """AF_VSOCK reaches the hypervisor, and no network namespace confines it: refused whatever
    ``network`` is, also with the family's upper 32 bits set; other families still work (in
    landlock mode without a network, every family but unix is refused, and unix sockets are
    refused in landlock mode unless ``unix_sockets=True``: test_sandbox_leftovers.py)."""
    import pyseccomp

    if mode == "landlock" and isinstance(network, list):
        pytest.skip("landlock mode refuses an egress allowlist (test_sandbox_confinement.py)")
    number = str(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "socket"))
    code, out, err = _run([sys.executable, "-c", SOCKETS, number], isolation=mode, network=network)
    assert code == 0, err
    seen = json.loads(out)
    inet = "EPERM" if mode == "landlock" and network is False else "created"
    unix = "EPERM" if mode == "landlock" else "created"
    assert seen == {"vsock": "EPERM", "vsock_high_bits": "EPERM", "inet": inet, "unix": unix}, seen
    # Control: unfiltered, the call reaches the kernel: a socket where it has
    # vsock (a VM), EAFNOSUPPORT where not; never the filter's EPERM.
    code, out, err = _run([sys.executable, "-c", SOCKETS, number], **CONTROL[mode])
    assert code == 0, err
    unfiltered = json.loads(out)
    assert unfiltered["vsock"] != "EPERM" and unfiltered["vsock_high_bits"] == unfiltered["vsock"], unfiltered


@pytest.fixture
def no_libseccomp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """libseccomp (its binding) missing: the filter and the once-only warning start afresh."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # the import raises ImportError
    monkeypatch.setattr(seccomp_module, "_warned", Once())
    seccomp_module.seccomp_filter.cache_clear()
    yield
    seccomp_module.seccomp_filter.cache_clear()


@needs_namespace
def test_without_libseccomp_the_sandbox_says_once_which_protections_are_off(
    no_libseccomp: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(
        logging.WARNING, logger="cancellable_agents.toolsets.sandbox.local.boundary._seccomp"
    ):
        first = _run(NESTED)
        second = _run("true")
    warnings = [r.getMessage() for r in caplog.records if "WITHOUT the seccomp filter" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "libseccomp is not available" in warnings[0]
    for protection in ("nested namespaces", "keyrings", "ptrace", "io_uring", "mount"):
        assert protection in warnings[0]
    assert second[0] == 0
    assert "unshare=0" in first[1], "the message is true: nested namespaces work without the filter"


# -- the environment ------------------------------------------------------------------------

ENV_NAMES = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]


@pytest.mark.parametrize("isolation", [NAMESPACE_BOUNDARY, LANDLOCK, "process-group"])
def test_commands_get_the_environment_by_allowlist(isolation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    leaked = {
        "DATABASE_URL": "postgres://u:pw@db/x",
        "MYSQL_PWD": "pw",
        "SENTRY_DSN": "https://k@sentry/1",
        "REDIS_URL": "redis://:pw@r:6379",
    }
    for name, value in {**leaked, "LANG": "C.UTF-8", "LC_TIME": "C", "TZ": "UTC", "TERM": "dumb"}.items():
        monkeypatch.setenv(name, value)
    box = LocalSandbox(isolation=isolation, env={"GIVEN_URL": "explicit"})  # type: ignore[arg-type]
    try:
        env = json.loads(box.run(ENV_NAMES, timeout=30).stdout)
    finally:
        box.destroy()
    assert not set(leaked) & set(env)
    # Set by the sandbox: PWD by bwrap's --chdir (or the cgroup placement's sh); landlock mode's
    # private tmp and its owner tag (the next task kills what a SIGKILLed one left).
    by_mode = {"namespace": {"PWD"}, "landlock": {"PWD", "TMPDIR", "CANCELLABLE_AGENTS_OWNER"}}
    sandbox_sets = by_mode.get(isolation, set())
    assert "TMPDIR" in env or isolation != "landlock"
    assert set(env) - sandbox_sets == {
        "PATH",
        "LANG",
        "LC_TIME",
        "TZ",
        "TERM",
        "HOME",
        "GIVEN_URL",
        "CANCELLABLE_AGENTS_COMMAND",
    }
    assert env["HOME"] == str(box.workdir) and env["GIVEN_URL"] == "explicit" and env["LANG"] == "C.UTF-8"


# -- file tools racing a command ------------------------------------------------------------

#: Swaps the folder ``d`` and the symlink ``l`` (to a host folder) as fast as it can, atomically
#: (renameat2 RENAME_EXCHANGE): at any instant ``d`` is the workdir's folder or the host's.
RACER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.mkdir("d")
with open("d/f.txt", "w") as f:
    f.write("inside")
os.symlink(sys.argv[1], "l")
open("ready", "w").close()
while True:
    if libc.renameat2(-100, b"d", -100, b"l", 2) != 0:
        raise SystemExit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""
ROUNDS = 3000


@pytest.fixture
def host_folder() -> Iterator[Path]:
    """A host folder outside the workdir (and outside /tmp, which the sandbox hides)."""
    root = Path(tempfile.mkdtemp(prefix="cancellable-agents-host-", dir="/var/tmp"))
    (root / "f.txt").write_text("HOST-SECRET")
    (root / "host-only").write_text("")
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout}s"
        threading.Event().wait(0.01)


@pytest.mark.parametrize("mode", BOUNDARY_MODES)
@pytest.mark.parametrize("resolver", ["sandbox", "openat2", "walk"])
def test_file_tools_racing_a_command_that_swaps_folders_and_symlinks_never_leave_the_workdir(
    resolver: str, host_folder: Path, mode: str
) -> None:
    if resolver == "openat2" and not openat2_supported():
        pytest.skip("this kernel has no openat2")
    box = LocalSandbox(isolation=mode)  # type: ignore[arg-type]
    files: Any = box
    if resolver != "sandbox":
        owner = box.workdir.stat().st_uid if os.geteuid() == 0 else None
        files = WorkdirFiles(box.workdir, output_limit=1024, owner=owner, use_openat2=resolver == "openat2")
    racer = box.start([sys.executable, "-c", RACER, str(host_folder)], timeout=60)
    outcomes = {"inside": 0, "refused": 0, "host": 0}
    try:
        _wait_for(box.workdir / "ready", 30)
        for i in range(ROUNDS):
            for action in (
                functools.partial(files.read_file, "d/f.txt"),
                functools.partial(files.write_file, f"d/w{i % 20}.txt", "written"),
                functools.partial(files.list_files, "d"),
            ):
                try:
                    seen = action()
                except (SandboxPathError, OSError):
                    outcomes["refused"] += 1
                    continue
                host = seen == "HOST-SECRET" or (isinstance(seen, list) and "host-only" in seen)
                outcomes["host" if host else "inside"] += 1
        with pytest.raises(TimeoutError):
            box.wait(racer, 0)  # the racer was swapping all along, not dead of an error
    finally:
        box.stop(racer)
        box.destroy()
    assert sorted(p.name for p in host_folder.iterdir()) == ["f.txt", "host-only"], "a write left the workdir"
    assert outcomes["host"] == 0, outcomes
    assert outcomes["inside"] > 0 and outcomes["refused"] > 0, f"the race did not happen: {outcomes}"


# -- file tools, the plain cases ------------------------------------------------------------


@pytest.mark.parametrize("use_openat2", [True, False])
def test_file_tools_follow_no_symlink_and_keep_their_messages(tmp_path: Path, use_openat2: bool) -> None:
    if use_openat2 and not openat2_supported():
        pytest.skip("this kernel has no openat2")
    files = WorkdirFiles(tmp_path, output_limit=5, use_openat2=use_openat2)
    assert files.write_file("sub/deeper/a.txt", "hello world") == 11
    assert files.read_file("sub/deeper/../deeper/a.txt") == "hello\n[... truncated after 5 bytes ...]"
    assert files.list_files() == ["sub/"] and files.list_files("sub/deeper") == ["a.txt"]
    (tmp_path / "inner").symlink_to("sub")
    os.mkfifo(tmp_path / "pipe")
    for escape in ("../x", "/etc/passwd", "sub/../../x"):
        with pytest.raises(SandboxPathError, match="outside the sandbox working directory"):
            files.read_file(escape)
    for through_link in ("inner/deeper/a.txt", "inner"):
        with pytest.raises(SandboxPathError, match="symbolic link"):
            files.read_file(through_link)
    with pytest.raises(SandboxPathError, match="symbolic link"):
        files.write_file("inner/new.txt", "x")
    assert not (tmp_path / "sub" / "new.txt").exists()
    with pytest.raises(SandboxPathError, match="not a regular file"):
        files.read_file("pipe")  # a FIFO nobody writes to: refused, not a hang
    with pytest.raises(FileNotFoundError) as missing:
        files.read_file("sub/nope.txt")
    assert missing.value.filename == "sub/nope.txt"
    with pytest.raises(IsADirectoryError):
        files.read_file("sub")


@needs_namespace
def test_files_written_for_a_root_worker_s_sandbox_are_its_uid_s_by_descriptor() -> None:
    if os.geteuid() != 0:
        pytest.skip("only a root worker's sandbox runs as a uid of its own")
    box = LocalSandbox(isolation="namespace")
    try:
        box.write_file("made/here/a.txt", "x")
        uid = box.workdir.stat().st_uid
        assert uid != 0
        for path in ("made", "made/here", "made/here/a.txt"):
            assert (box.workdir / path).stat().st_uid == uid, path
    finally:
        box.destroy()
