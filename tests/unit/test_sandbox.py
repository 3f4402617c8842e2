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
from typing import Any

import pytest

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import (
    CommandResult,
    Limits,
    LocalSandbox,
    Sandbox,
    SandboxCapabilities,
    SandboxClosed,
    SandboxFiles,
    SandboxPathError,
    SandboxTools,
    SandboxToolset,
    attach_sandbox,
    scrubbed_environment,
)
from cancellable_agents.toolsets.sandbox.local._files import LIST_LIMIT, WorkdirFiles, shown_name
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import landlock_support
from cancellable_agents.toolsets.sandbox.protocol import command_env

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


def test_list_files_is_capped_and_says_how_many_names_it_left_out(tmp_path: Path) -> None:
    """A command can make a folder of 50,001 names (9 MiB as a list): the model gets the first
    LIST_LIMIT names, sorted, and one last entry with the count left out."""
    box = LocalSandbox(tmp_path / "wd", isolation="process-group")
    try:
        many = box.workdir / "many"
        many.mkdir()
        for i in range(LIST_LIMIT + 1500):
            (many / f"f{i:05d}").touch()
        listed = box.list_files("many")
        assert listed[:-1] == [f"f{i:05d}" for i in range(LIST_LIMIT)]
        assert listed[-1].startswith("[... 1500 more names not listed (") and "/" in listed[-1]
        # Exactly at the cap: nothing is left out, so no marker.
        for i in range(LIST_LIMIT, LIST_LIMIT + 1500):
            (many / f"f{i:05d}").unlink()
        assert box.list_files("many") == [f"f{i:05d}" for i in range(LIST_LIMIT)]
    finally:
        box.destroy()


def test_list_files_caps_its_bytes_at_the_output_limit(tmp_path: Path) -> None:
    names = [f"{i:02d}-" + "x" * 97 for i in range(30)]  # 100 bytes each
    for name in names:
        (tmp_path / name).touch()
    listed = WorkdirFiles(tmp_path, output_limit=1000).list_files()
    assert listed[:-1] == names[:10]
    assert listed[-1] == "[... 20 more names not listed (a listing stops at 1000 names / 1000 bytes) ...]"
    assert WorkdirFiles(tmp_path, output_limit=1000, list_limit=3).list_files()[:-1] == names[:3]


def test_list_files_shows_control_characters_in_names_escaped(tmp_path: Path) -> None:
    """Names are the command's: a terminal sequence, a line break or a bidi override in one must
    not reach the model raw. Escaped repr-style (so a backslash is doubled), bytes that are not
    UTF-8 as \\xNN; folders still end with '/'."""
    for name in (
        "\x1b[2J",
        "a\rb",
        "c\nd",
        "tab\there",
        "del\x7f",
        "back\\slash",
        "\u202eevil.txt",
        "plain.txt",
    ):
        (tmp_path / name).touch()
    (tmp_path / "dir\x1b]0;x\x07").mkdir()
    os.close(os.open(os.fsencode(tmp_path) + b"/raw\xff.bin", os.O_CREAT | os.O_WRONLY, 0o644))
    listed = WorkdirFiles(tmp_path, output_limit=65536).list_files()
    assert sorted(listed) == sorted(
        [
            "\\x1b[2J",
            "a\\rb",
            "c\\nd",
            "tab\\there",
            "del\\x7f",
            "back\\\\slash",
            "\\u202eevil.txt",
            "plain.txt",
            "dir\\x1b]0;x\\x07/",
            "raw\\xff.bin",
        ]
    )
    assert all(char.isprintable() for name in listed for char in name)
    assert shown_name("plain.txt") == "plain.txt"


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


#: Without bubblewrap on PATH: what ``isolation="auto"`` gives, and what ``"namespace"`` says.
#: ``argv[1] == "no-landlock"``: first a seccomp filter refusing ``landlock_create_ruleset`` with
#: EPERM, as a container runtime's default profile without Landlock does.
WITHOUT_BUBBLEWRAP = """
import errno, sys
if sys.argv[1] == "no-landlock":
    import pyseccomp
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "landlock_create_ruleset")
    rules.load()
from cancellable_agents.toolsets.sandbox import LocalSandbox, SandboxUnavailable
for isolation in ("auto", "namespace", "process-group"):
    try:
        box = LocalSandbox(isolation=isolation)
        print(box.mode)
        box.destroy()
    except SandboxUnavailable as exc:
        print(exc)
"""


def _without_bubblewrap(landlock: str) -> list[str]:
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(SRC)}
    argv = [sys.executable, "-c", WITHOUT_BUBBLEWRAP, landlock]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.skipif(not landlock_support().usable, reason=landlock_support().reason)
def test_without_bubblewrap_auto_is_landlock_mode_and_namespace_says_how_to_fix_it() -> None:
    auto, namespace, process_group = _without_bubblewrap("landlock")
    assert auto == "landlock" and process_group == "process-group"
    assert "apt-get install bubblewrap" in namespace and "user namespaces" in namespace


def test_without_any_boundary_auto_refuses_naming_what_is_missing_and_the_fixes() -> None:
    """No silent fall back to process-group mode (no boundary): asked for by name only."""
    auto, namespace, process_group = _without_bubblewrap("no-landlock")
    assert "found no boundary" in auto and "bwrap is not installed" in auto, auto
    assert "seccomp profile refuses the landlock_* system calls" in auto, auto
    assert "securityContext" in auto and "isolation='process-group'" in auto, auto
    assert "apt-get install bubblewrap" in namespace and process_group == "process-group"


def test_command_result_ok_means_exit_0_and_not_stopped() -> None:
    assert CommandResult("c", 0, "", "").ok
    assert not CommandResult("c", 0, "", "", stopped=True).ok


# -- the seam: what a backend passed in cannot take, what a backend must be -----------------


class _Remote:
    """A backend the toolset is handed (its commands never run here: only its arguments matter)."""

    capabilities = SandboxCapabilities()

    def start(self, command: Any, *, timeout: Any = None, stdin: Any = None, env: Any = None) -> str:
        raise AssertionError("not started in these tests")

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult:
        raise AssertionError("not waited in these tests")

    def stop(self, command_id: str) -> None: ...

    def stop_all(self) -> None: ...

    def destroy(self) -> None: ...


@pytest.mark.parametrize("make", [SandboxToolset, SandboxTools], ids=["description", "toolset"])
@pytest.mark.parametrize(
    "option",
    [
        {"isolation": "namespace"},
        {"profile": "host"},
        {"network": True},
        {"network": ["pypi.org"]},
        {"limits": Limits(max_processes=8)},
        {"output_limit": 1000},
        {"workdir": "/tmp"},
        {"env": {"A": "1"}},
    ],
    ids=lambda option: next(iter(option)),
)
def test_local_options_with_a_backend_passed_in_are_refused_naming_the_fix(
    make: Any, option: dict[str, Any]
) -> None:
    """Each would configure the LocalSandbox the toolset makes without ``sandbox=``; ignored with a
    backend of the caller's, it would be a boundary the DAG author believes in and does not get."""
    name = next(iter(option))
    with pytest.raises(ConfigurationError, match=rf"cannot apply {name}=.*Fix: set them on the backend"):
        make(_Remote(), **option)


def test_options_that_apply_to_any_backend_are_taken_with_one() -> None:
    toolset = SandboxTools(_Remote(), command_timeout=5, id="remote", isolation="auto", network=False, env={})
    assert toolset.command_timeout == 5 and toolset.id == "remote"


def test_what_is_no_sandbox_backend_is_refused_naming_what_is_missing() -> None:
    class Old:  # a backend of before capabilities= and env= were declared
        def start(self, command: Any, *, timeout: Any = None, stdin: Any = None) -> str:
            return "c1"

    with pytest.raises(
        ConfigurationError, match=r"missing: capabilities, wait, stop, stop_all, destroy.*Fix:"
    ):
        SandboxToolset(Old())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not a Sandbox backend"):
        attach_sandbox(Old(), TaskCancellation("t"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "wrong"),
    [({"": "x"}, "names must be non-empty"), ({"A=B": "x"}, "without '='"), ({"A": 1}, "must be a string")],
)
def test_a_commands_env_is_checked_naming_the_fix(env: dict[str, Any], wrong: str) -> None:
    with pytest.raises(ConfigurationError, match=wrong):
        command_env(env)
