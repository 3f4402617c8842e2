"""LocalSandbox without its commands: the scrubbed environment, file access, the workdir, the
protocols, the message when bubblewrap is missing.

Commands for real are process tests: ``tests/process/test_sandbox_local.py`` (the sandbox),
``test_sandbox_command.py`` (one command's tree), ``test_sandbox_toolset.py`` (the agent's tools).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cancellable_agents.toolsets.sandbox import (
    CommandResult,
    LocalSandbox,
    Sandbox,
    SandboxClosed,
    SandboxFiles,
    SandboxPathError,
    scrubbed_environment,
)

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).parents[2] / "src"


# -- environment ----------------------------------------------------------------------------


def test_scrubbed_environment_rules() -> None:
    base = {
        "PATH": "/bin",
        "HOME": "/root",
        "LANG": "C",
        "AIRFLOW__CORE__FERNET_KEY": "k",
        "AIRFLOW_CONN_X": "c",
        "AIRFLOW_VAR_Y": "v",
        "GITHUB_TOKEN": "t",
        "db_password": "p",
        "MY_SECRET_THING": "s",
        "ANTHROPIC_API_KEY": "a",
        "AIRFLOW_HOME": "/opt/airflow",
    }
    # An allowlist: AIRFLOW_HOME and the real HOME are not on it; HOME is the workdir when given.
    assert scrubbed_environment(base) == {"PATH": "/bin", "LANG": "C"}
    assert scrubbed_environment(base, home="/wd")["HOME"] == "/wd"
    given = scrubbed_environment(base, {"GITHUB_TOKEN": "given", "HOME": "/mine"}, home="/wd")
    assert (given["GITHUB_TOKEN"], given["HOME"]) == ("given", "/mine")


# -- files and workdir ----------------------------------------------------------------------


def test_file_access_is_confined_to_the_workdir(tmp_path: Path) -> None:
    box = LocalSandbox(tmp_path / "wd", isolation="process-group")
    assert box.write_file("sub/a.txt", "hello") == 5
    assert box.read_file("sub/a.txt") == "hello"
    assert box.list_files() == ["sub/"]
    assert box.list_files("sub") == ["a.txt"]
    (box.workdir / "link").symlink_to("/etc")
    for escape in ("../outside.txt", "/etc/passwd", "link/passwd", "sub/../../x"):
        with pytest.raises(SandboxPathError, match="outside the sandbox working directory"):
            box.resolve(escape)
    box.destroy()


def test_workdir_is_removed_only_if_the_sandbox_created_it(tmp_path: Path) -> None:
    existing = tmp_path / "mine"
    existing.mkdir()
    LocalSandbox(existing, isolation="process-group").destroy()
    assert existing.exists()
    temp = LocalSandbox(isolation="process-group")
    assert temp.workdir.is_dir()
    temp.destroy()
    temp.destroy()
    assert not temp.workdir.exists()
    with pytest.raises(SandboxClosed):
        temp.start("true")


def test_local_sandbox_satisfies_the_protocols() -> None:
    box = LocalSandbox(isolation="process-group")
    assert isinstance(box, Sandbox) and isinstance(box, SandboxFiles)
    box.destroy()


def test_namespace_mode_without_bubblewrap_says_how_to_fix_it() -> None:
    code = (
        "from cancellable_agents.toolsets.sandbox import LocalSandbox, SandboxUnavailable\n"
        "box = LocalSandbox(isolation='auto')\nprint(box.mode)\nbox.destroy()\n"
        "try:\n    LocalSandbox(isolation='namespace')\n"
        "except SandboxUnavailable as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mode, message = out.stdout.split("\n", 1)
    assert mode == "process-group"
    assert "apt-get install bubblewrap" in message and "user namespaces" in message


def test_command_result_ok_means_exit_0_and_not_stopped() -> None:
    assert CommandResult("c", 0, "", "").ok
    assert not CommandResult("c", 0, "", "", stopped=True).ok
