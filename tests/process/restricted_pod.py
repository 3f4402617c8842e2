"""A process set up like an unprivileged Kubernetes pod (issues 28 and 39): the official Airflow
image's user (uid 50000, group 0), no capabilities (effective, permitted, inheritable, ambient
and bounding sets empty, as ``capabilities: drop: [ALL]``), ``no_new_privs``, and a container
runtime's default seccomp profile as it ships: the allowlist of ``/usr/share/containers/seccomp.json``
(Debian's golang-github-containers-common, the profile CRI-O and podman load; the Makefile's
``system-deps`` unpacks it to ``.cache/``) for a container without capabilities, every other call
refused with ``EPERM`` as containerd and Docker answer; stacked on it, the calls containerd's and
Docker's profiles grant only with ``CAP_SYS_ADMIN``: ``unshare``, ``mount``, ``umount2``,
``pivot_root``, ``setns``, ``keyctl``, ``add_key``, ``request_key`` and ``clone`` with any
``CLONE_NEW*`` flag fail with ``EPERM``, ``clone3`` with ``ENOSYS``. There user namespaces cannot
be made, so bubblewrap cannot start; Landlock and seccomp need no privilege. A missing profile
fails the pod's start with the fix (``RESTRICTED_POD_PROFILE=denylist`` loads only the stacked
part, the harness of before).

:func:`restricted_argv` turns a command into one that runs that way (from a root process):

1. ``unshare --mount``: a private mount namespace, only so that the interpreter is reachable by
   uid 50000 where it lies under a folder only root may enter (pyenv's ``/root/.pyenv``): a
   755 tmpfs on that folder with the interpreter's tree bound back into it. Nothing else of the
   view changes, and nothing in the host's;
2. ``setpriv``: uid 50000, gid 0, no supplementary groups, every capability set cleared,
   ``no_new_privs``;
3. this file as a script, as uid 50000: loads the filter above (libseccomp through pyseccomp,
   as the sandbox builds its own), then ``exec``s the command, which inherits it for good.

The PID namespace stays the host's: a command can name the test's processes, as a pod's
commands can name the task's.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The official Airflow image's user and group.
POD_UID = 50000
POD_GID = 0
#: Refused with EPERM by the RuntimeDefault profiles (for a container without CAP_SYS_ADMIN).
RUNTIME_DEFAULT_DENIED = (
    "unshare",
    "mount",
    "umount2",
    "pivot_root",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
)
#: ``clone`` flags Docker's profile refuses without CAP_SYS_ADMIN (``CLONE_NEWNS`` .. ``CLONE_NEWNET``,
#: ``CLONE_NEWCGROUP``: mask ``0x7E020000``).
CLONE_NAMESPACE_MASK = 0x7E020000
HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


def unavailable_reason() -> str | None:
    """Why a restricted pod cannot be made here (``None``: it can)."""
    if sys.platform != "linux":
        return "Linux only"
    if os.geteuid() != 0:
        return "setting up a pod's user and mount view needs root (the test process is not)"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        return f"libseccomp is not available ({exc})"
    for path in (REPO, Path(sys.prefix)):
        hidden = _hidden_ancestor(path)
        if hidden is not None:
            return f"{path} is under {hidden}, which uid {POD_UID} cannot enter"
    return None


def _hidden_ancestor(path: Path) -> Path | None:
    """The first folder on ``path`` that others may not enter (``None``: none)."""
    for folder in [*reversed(path.parents), path]:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def _mount_script(binds: dict[str, str]) -> str:
    """Shell that makes the interpreter's real installation reachable in the mount namespace,
    and binds each ``binds`` source on its target."""
    lines = ["set -e"]
    lines += [f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for src, dst in binds.items()]
    interpreter = Path(os.path.realpath(sys.executable)).parent.parent
    hidden = _hidden_ancestor(interpreter)
    if hidden is not None:
        keep = hidden / interpreter.relative_to(hidden).parts[0]
        stage = f"/tmp/.restricted-pod-{os.getpid()}-{os.urandom(4).hex()}"
        lines += [
            f"mkdir -m 700 {stage}",
            f"mount --bind {shlex.quote(str(keep))} {stage}",
            f"mount -t tmpfs -o mode=755,size=1m restricted-pod {shlex.quote(str(hidden))}",
            f"mkdir -p {shlex.quote(str(keep))}",
            f"mount --move {stage} {shlex.quote(str(keep))}",
            f"rmdir {stage}",
        ]
    return "\n".join(lines)


def restricted_argv(
    argv: list[str], *, runtime_default: bool = True, binds: dict[str, str] | None = None
) -> list[str]:
    """``argv`` run as an unprivileged pod's process (see the module docstring). The caller is
    root; the environment passes through unchanged (give it a ``HOME`` uid 50000 owns).

    ``runtime_default=False``: the same user without the seccomp filter, i.e. a non-root worker
    where unprivileged user namespaces are allowed (a VM's ``airflow`` user, or a pod whose
    seccomp profile is ``Unconfined``): there bubblewrap starts.

    ``binds``: folders shown at another path in the pod's mount namespace (source -> an existing
    target), for a folder under one uid 50000 may not enter (pytest's ``/tmp/pytest-of-root``)."""
    setpriv = [
        "setpriv",
        f"--reuid={POD_UID}",
        f"--regid={POD_GID}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        sys.executable,
        str(HERE),
        "--runtime-default" if runtime_default else "--no-filter",
        *argv,
    ]
    script = f"{_mount_script(binds or {})}\nexec {shlex.join(setpriv)}"
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]


def make_pod_dir() -> Path:
    """A folder the pod's user owns (remove it with ``shutil.rmtree``): ``home`` (its ``HOME``,
    with a secret planted in ``.aws/credentials``) and room for temporary files."""
    root = Path(tempfile.mkdtemp(prefix="cancellable-agents-pod-"))
    root.chmod(0o755)
    (root / "home" / ".aws").mkdir(parents=True)
    (root / "home" / ".aws" / "credentials").write_text("aws_secret_access_key = pod-secret\n")
    for path in [root, *root.rglob("*")]:
        os.chown(path, POD_UID, POD_GID)
    return root


def pod_env(pod_dir: Path) -> dict[str, str]:
    """A pod's environment: what the image sets, no more (nothing of the test runner's)."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(pod_dir / "home"),
        "USER": "airflow",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
        "TMPDIR": "/tmp",
    }


#: The container runtime's default profile as it ships (the Makefile's ``system-deps`` unpacks it).
RUNTIME_PROFILE = REPO / ".cache" / "runtime-seccomp.json"
#: ``RESTRICTED_POD_PROFILE=denylist``: only the capability gates below, as the harness was before.
PROFILE_CHOICE = "RESTRICTED_POD_PROFILE"


def profile_reason() -> str | None:
    """Why the runtime's allowlist cannot be loaded (``None``: it can, or the denylist was chosen)."""
    if os.environ.get(PROFILE_CHOICE) == "denylist" or RUNTIME_PROFILE.is_file():
        return None
    return f"{RUNTIME_PROFILE} is missing: `make system-deps` unpacks it from golang-github-containers-common"


def _load_runtime_allowlist(pyseccomp: Any) -> int:
    """The runtime's profile as it ships: every call it allows (for a container without
    capabilities: rules that ``include`` a capability are left out, those that ``exclude`` one
    kept), everything else refused with EPERM, as containerd's and Docker's default answer.
    Returns how many rules were loaded."""
    profile = json.loads(RUNTIME_PROFILE.read_text())
    rules = pyseccomp.SyscallFilter(pyseccomp.ERRNO(errno.EPERM))
    loaded = 0
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    for entry in profile["syscalls"]:
        includes, excludes = entry.get("includes") or {}, entry.get("excludes") or {}
        if includes.get("caps") or arch in (excludes.get("arches") or []):
            continue  # granted only to a container with that capability, or not on this arch
        if includes.get("arches") and arch not in includes["arches"]:
            continue
        action = (
            pyseccomp.ALLOW
            if entry["action"] == "SCMP_ACT_ALLOW"
            else pyseccomp.ERRNO(entry.get("errnoRet") or errno.EPERM)
        )
        conditions = [
            pyseccomp.Arg(arg["index"], getattr(pyseccomp, arg["op"].removeprefix("SCMP_CMP_")), arg["value"],
                          arg.get("valueTwo", 0))
            for arg in entry.get("args") or []
        ]  # fmt: skip
        for name in entry["names"]:
            if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) < 0:
                continue  # another architecture's call
            try:
                rules.add_rule(action, name, *conditions)
                loaded += 1
            except OSError:
                continue  # a rule libseccomp cannot express beside another (as runc skips it)
    rules.load()
    return loaded


def _load_runtime_default_filter() -> None:
    import pyseccomp

    if os.environ.get(PROFILE_CHOICE) != "denylist":
        _load_runtime_allowlist(pyseccomp)
    # containerd's and Docker's profiles grant these only with CAP_SYS_ADMIN (a pod has none); the
    # shipped profile of CRI-O and podman leaves them to the missing capabilities instead. Filters
    # stack: the stricter answer wins.
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    eperm = pyseccomp.ERRNO(errno.EPERM)
    for name in RUNTIME_DEFAULT_DENIED:
        rules.add_rule(eperm, name)
    for bit in range(64):  # a default-allow filter: one rule per flag (a masked "!= 0" is no operator)
        flag = 1 << bit
        if CLONE_NAMESPACE_MASK & flag:
            rules.add_rule(eperm, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()


def main(argv: list[str]) -> None:
    if argv[:1] not in (["--runtime-default"], ["--no-filter"]) or len(argv) < 2 or os.getuid() == 0:
        raise SystemExit(
            "usage (from restricted_argv only): restricted_pod.py --runtime-default|--no-filter COMMAND..."
        )
    if argv[0] == "--runtime-default":
        missing = profile_reason()
        if missing is not None:
            raise SystemExit(f"restricted pod: {missing} (or set {PROFILE_CHOICE}=denylist)")
        _load_runtime_default_filter()
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
