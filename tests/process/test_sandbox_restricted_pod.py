"""The sandbox in a process set up like an unprivileged Kubernetes pod (issue 28, item 3): uid
50000, no capabilities, ``no_new_privs``, the container runtime's default seccomp profile
(``tests/process/restricted_pod.py``). There bubblewrap cannot start, ``LocalSandbox()`` picks
landlock mode, and the sandbox's own tests (confinement, hardening, limits, kill paths, the
lifecycle) run again as that pod's process and pass: the same tests, parametrised over the modes,
with namespace mode skipped for the reason the pod gives. The same user without the pod's seccomp
profile (a non-root worker where user namespaces are allowed) gets namespace mode, and those
tests' namespace cases pass there. Real processes, real system calls."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.process.restricted_pod import (
    POD_GID,
    POD_UID,
    REPO,
    make_pod_dir,
    pod_env,
    restricted_argv,
    unavailable_reason,
)
from tests.process.trees import landlock_reason, landlock_usable

pytestmark = [
    pytest.mark.process,
    pytest.mark.timeout(300),
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"no restricted pod: {unavailable_reason()}"),
    pytest.mark.skipif(not landlock_usable(), reason=landlock_reason()),
]

#: The sandbox test files run again inside the pod (those with a landlock or process-group case).
INSIDE = [
    "test_sandbox_confinement.py",
    "test_sandbox_hardening.py",
    "test_sandbox_limits.py",
    "test_sandbox_kill.py",
    "test_sandbox_local.py",
    "test_sandbox_command.py",
    "test_sandbox_toolset.py",
    "test_sandbox_workdirs.py",
    "test_sandbox_leftovers.py",
    "test_sandbox_conformance.py",
]
#: Probe class -> the test that tries it (``test_sandbox_<file>.py``); each must pass in landlock
#: mode inside the pod (and its process-group control where it has one).
MUST_PASS: dict[str, tuple[str, str]] = {
    "secret by absolute path (a planted home), write outside": (
        "confinement",
        "test_a_secret_outside_the_workdir_is_neither_readable_nor_writable_by_absolute_path",
    ),
    "/proc of the task, /etc/shadow": (
        "confinement",
        "test_landlock_commands_see_no_proc_entry_of_the_task_and_no_etc_secret",
    ),
    "TCP to the worker's loopback": (
        "confinement",
        "test_a_tcp_listener_on_the_worker_s_loopback_is_unreachable",
    ),
    "UDP, raw, netlink, packet, vsock sockets": (
        "confinement",
        "test_landlock_commands_create_no_socket_but_unix_ones",
    ),
    "abstract unix socket": (
        "confinement",
        "test_an_abstract_unix_socket_outside_the_sandbox_is_unreachable",
    ),
    "signal the task and the test": (
        "confinement",
        "test_the_task_and_the_test_cannot_be_signalled",
    ),
    "nested namespaces": (
        "hardening",
        "test_nested_namespaces_are_denied_with_eperm_not_a_kill",
    ),
    "keyrings, ptrace, process_vm, io_uring": (
        "hardening",
        "test_keyrings_ptrace_process_vm_and_io_uring_are_denied_with_eperm",
    ),
    "vsock in every network mode": (
        "hardening",
        "test_vsock_sockets_are_denied_with_eperm_in_every_boundary_mode",
    ),
    "environment by allowlist": (
        "hardening",
        "test_commands_get_the_environment_by_allowlist",
    ),
    "symlink races against the file tools": (
        "hardening",
        "test_file_tools_racing_a_command_that_swaps_folders_and_symlinks_never_leave_the_workdir",
    ),
    "Airflow secrets in the environment": (
        "local",
        "test_commands_do_not_see_airflow_secrets_unless_passed_explicitly",
    ),
    "memory limit for the whole sandbox (counted, no cgroup)": (
        "limits",
        "test_without_a_cgroup_six_processes_cannot_together_hold_more_than_the_sandbox_memory",
    ),
    "a fork storm past the sandbox's process count": (
        "limits",
        "test_without_a_cgroup_a_fork_storm_is_killed_at_the_sandbox_process_limit",
    ),
    "a disk fill past the workdir's and the tmp's size": (
        "limits",
        "test_without_a_tmpfs_a_disk_fill_is_killed_at_the_sandbox_size",
    ),
    "CPU limit": (
        "limits",
        "test_the_cpu_limit_sends_sigxcpu_first_and_sigkill_a_grace_later",
    ),
    "a kill at the memory and CPU limits": (
        "limits",
        "test_a_kill_at_each_limit_unwinds_within_the_budget_and_is_recorded",
    ),
    "output caps": (
        "command",
        "test_output_is_capped_with_a_marker_and_huge_output_does_not_hang",
    ),
    "the hostile-command table, then a SIGTERM to the task during them": (
        "kill",
        "test_hostile_commands_are_contained_and_a_sigterm_during_them_unwinds",
    ),
    "SIGTERM to the task kills the tree": (
        "kill",
        "test_sigterm_to_the_task_pid_kills_the_sandboxed_tree",
    ),
    "SIGKILL of the task leaves nothing running": (
        "kill",
        "test_sigkill_of_a_landlock_task_leaves_nothing_running",
    ),
    "a detached, renamed, environment-less daemon after the command's exit": (
        "leftovers",
        "test_detached_renamed_daemons_without_environment_die_with_their_command",
    ),
    "the same daemon after destroy()": ("leftovers", "test_destroy_leaves_no_daemon_of_a_running_command"),
    "the same daemon after a SIGKILL of the task": (
        "leftovers",
        "test_a_sigkill_of_the_task_leaves_no_daemon_running",
    ),
    "a named unix socket of the worker's user": (
        "leftovers",
        "test_a_named_unix_socket_of_the_worker_s_user_is_refused",
    ),
    "a workdir with chmod 000 folders": (
        "leftovers",
        "test_destroy_removes_a_workdir_with_locked_folders_and_follows_no_symlink",
    ),
}


#: Calls an unprivileged process may make, answered by the pod's filter: ``sysfs(3)`` (how many
#: filesystem types the kernel knows; in no runtime's allowlist) and ``getppid``.
ALLOWLIST_PROBE = r"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
sysfs = libc.syscall(139, 3)
print(json.dumps({"sysfs": sysfs if sysfs >= 0 else -ctypes.get_errno(), "getppid": libc.getppid() > 0}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe's syscall number is x86_64's")
def test_the_pod_s_seccomp_profile_is_the_runtime_s_allowlist(pod_dir: Path) -> None:
    """The runtime's profile as it ships: what it does not list is refused (EPERM), where the
    same user without it (the control) gets the kernel's answer."""
    seen = {}
    for runtime_default in (True, False):
        proc = subprocess.run(
            restricted_argv([sys.executable, "-c", ALLOWLIST_PROBE], runtime_default=runtime_default),
            env=pod_env(pod_dir), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        seen[runtime_default] = json.loads(proc.stdout)
    assert seen[True] == {"sysfs": -errno.EPERM, "getppid": True}, seen
    assert seen[False]["sysfs"] > 0, seen


def _expected_skip(message: str) -> bool:
    """What landlock mode does not hold in such a pod, as documented: an egress allowlist, a
    process count without a cgroup."""
    return "egress allowlist" in message or "max_processes is not enforced" in message


@pytest.fixture
def pod_dir() -> Iterator[Path]:
    root = make_pod_dir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


#: As the pod's process: what it is, whether it may make namespaces, what ``LocalSandbox()``
#: picks, and hostile commands against the pod's own home, a listener it opens, and itself, in
#: the mode ``auto`` picked and (the control) in process-group mode.
PROBE = r"""
import json, os, socket, subprocess, sys
from cancellable_agents.toolsets.sandbox import LocalSandbox, bwrap_support
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
seen = {name: status[name].strip() for name in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")}
seen["uid"], seen["gid"] = os.getuid(), os.getgid()
seen["unshare"] = subprocess.run(["unshare", "-r", "true"], capture_output=True, text=True).stderr
seen["bwrap"] = bwrap_support().reason
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), 5); print('connected')"
hostile = f'cat $POD_HOME/.aws/credentials; kill -0 {os.getpid()} && echo signalled; python -c "{connect}"'

for name, options in (("auto", {}), ("control", {"isolation": "process-group"})):
    box = LocalSandbox(env={"POD_HOME": os.environ["HOME"]}, **options)
    result = box.run(hostile, timeout=30)
    seen[name] = {"mode": box.mode, "stdout": result.stdout, "stderr": result.stderr}
    box.destroy()
print(json.dumps(seen))
"""


def _probe(pod_dir: Path, *, runtime_default: bool) -> dict[str, Any]:
    proc = subprocess.run(
        restricted_argv([sys.executable, "-c", PROBE], runtime_default=runtime_default),
        env=pod_env(pod_dir), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen: dict[str, Any] = json.loads(proc.stdout)
    return seen


def test_in_a_restricted_pod_auto_picks_landlock_and_hostile_commands_are_refused(pod_dir: Path) -> None:
    seen = _probe(pod_dir, runtime_default=True)
    # The pod: uid 50000, no capability in any set, no_new_privs, a seccomp filter.
    assert (seen["uid"], seen["gid"]) == (POD_UID, POD_GID), seen
    assert {seen[k] for k in ("CapEff", "CapPrm", "CapBnd")} == {"0000000000000000"}, seen
    assert (seen["NoNewPrivs"], seen["Seccomp"]) == ("1", "2"), seen
    assert "Operation not permitted" in seen["unshare"], seen
    assert "No permissions to create new namespace" in seen["bwrap"], seen
    # LocalSandbox() picks landlock there, and it holds.
    auto, control = seen["auto"], seen["control"]
    assert auto["mode"] == "landlock", auto
    assert "pod-secret" not in auto["stdout"] and "Permission denied" in auto["stderr"], auto
    assert "signalled" not in auto["stdout"] and "connected" not in auto["stdout"], auto
    # Control: without the boundary the same command reads the secret, signals, connects.
    assert control["mode"] == "process-group"
    assert control["stdout"].split() == [
        "aws_secret_access_key",
        "=",
        "pod-secret",
        "signalled",
        "connected",
    ], control


def _run_inside(pod_dir: Path, *, runtime_default: bool, select: str = "") -> dict[str, tuple[str, str]]:
    """The sandbox tests (``INSIDE``, ``-k select``) run as the pod's process: each test id's
    outcome (passed, skipped, failed) and message; asserts none failed."""
    report = pod_dir / "report.xml"
    argv = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        f"--basetemp={pod_dir / 'pytest'}", f"--junitxml={report}", "-rs",
        *(["-k", select] if select else []), *(f"tests/process/{name}" for name in INSIDE),
    ]  # fmt: skip
    proc = subprocess.run(
        restricted_argv(argv, runtime_default=runtime_default), env=pod_env(pod_dir), cwd=REPO,
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert report.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            # The message is the exception's first lines; the traceback's tail says where.
            outcomes[test_id] = ("failed", f"{failed.get('message', '')}\n{(failed.text or '')[-3000:]}")
        elif skipped is not None:
            outcomes[test_id] = ("skipped", skipped.get("message", ""))
        else:
            outcomes[test_id] = ("passed", "")
    failures = "\n\n".join(f"{k}: {v[1]}" for k, v in outcomes.items() if v[0] == "failed")
    assert proc.returncode == 0 and not failures, f"{failures}\n\n{proc.stdout[-6000:]}"
    return outcomes


def test_the_sandbox_tests_pass_in_landlock_mode_inside_a_restricted_pod(pod_dir: Path) -> None:
    outcomes = _run_inside(pod_dir, runtime_default=True)
    # Namespace mode is skipped (bubblewrap cannot start there), never run nor silently replaced.
    namespace = {k: v for k, v in outcomes.items() if "[namespace" in k}
    assert namespace and all(v[0] == "skipped" for v in namespace.values()), namespace
    assert any("No permissions to create new namespace" in v[1] for v in namespace.values()), namespace
    # Every probe class ran in landlock mode, inside the pod, and held.
    for probe, (module, name) in MUST_PASS.items():
        test = f"test_sandbox_{module}::{name}"
        ran = {k: v for k, v in outcomes.items() if k == test or k.startswith(f"{test}[")}
        landlock = {k: v for k, v in ran.items() if "landlock" in k or "[" not in k}
        assert any(v[0] == "passed" for v in landlock.values()), (
            f"{probe}: {test} did not pass in landlock mode"
        )
        unexpected = {k: v for k, v in landlock.items() if v[0] == "skipped" and not _expected_skip(v[1])}
        assert not unexpected, (probe, unexpected)


needs_userns = pytest.mark.skipif(
    subprocess.run(["unshare", "-Ur", "true"], capture_output=True, timeout=30, check=False).returncode != 0,
    reason="this kernel refuses unprivileged user namespaces",
)


@needs_userns
def test_as_a_non_root_worker_with_user_namespaces_auto_picks_namespace_mode(pod_dir: Path) -> None:
    """The same user, no capabilities, no_new_privs, without the pod's seccomp profile: bubblewrap
    starts unprivileged, and the same hostile command is refused there too."""
    seen = _probe(pod_dir, runtime_default=False)
    assert (seen["uid"], seen["CapEff"], seen["NoNewPrivs"], seen["Seccomp"]) == (POD_UID, "0" * 16, "1", "0")
    assert seen["unshare"] == "" and seen["bwrap"] == "", seen
    auto, control = seen["auto"], seen["control"]
    assert auto["mode"] == "namespace", auto
    assert "pod-secret" not in auto["stdout"] and "No such file or directory" in auto["stderr"], auto
    assert "signalled" not in auto["stdout"] and "connected" not in auto["stdout"], auto
    assert control["stdout"].split() == [
        "aws_secret_access_key",
        "=",
        "pod-secret",
        "signalled",
        "connected",
    ], control


@needs_userns
def test_the_namespace_cases_pass_as_a_non_root_worker_with_user_namespaces(pod_dir: Path) -> None:
    """The same tests' namespace cases, as uid 50000 without capabilities where bubblewrap starts."""
    outcomes = _run_inside(pod_dir, runtime_default=False, select="namespace")
    namespace = {k: v for k, v in outcomes.items() if "[namespace" in k}
    passed = {k for k, v in namespace.items() if v[0] == "passed"}
    for probe, (module, name) in MUST_PASS.items():
        test = f"test_sandbox_{module}::{name}"
        cases = {k for k in namespace if k.startswith(f"{test}[")}
        assert not cases or cases & passed, f"{probe}: {test} did not pass in namespace mode as non-root"
    assert len(passed) >= 20, namespace
