"""Bubblewrap: whether it works here (probed once) and the command line of each profile.

Two profiles in namespace mode:

``"boundary"`` (default)
    A new root with only ``/usr``, ``/bin``, ``/sbin``, ``/lib*``, ``/etc`` (minus the secrets in
    ``HIDDEN_ETC``), the interpreter's installation, ``/dev``, a fresh ``/proc``, a private
    size-capped ``/tmp``, the paths the author listed and the workdir (read-write). New PID, IPC,
    UTS and (unless ``network=True``) network namespaces, no new privileges, no capabilities,
    and the [`Limits`][cancellable_agents.toolsets.sandbox.limits.Limits] (memory
    and processes in the sandbox's cgroup where it has one, the rest set with ``prlimit`` just
    before the command runs). Not root: a
    non-root worker gets its own user namespace; a root worker cannot (a user namespace made by
    root maps to host root, which ``RLIMIT_NPROC`` exempts), so each sandbox switches to a uid of
    its own (``setpriv``) after bubblewrap has mounted everything.
``"host"``
    The pre-boundary behaviour, for commands that must see the host: ``/`` read-only, the
    workdir writable, a private ``/tmp``, a PID namespace; host network, user and IPC, no limits.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cancellable_agents.core.scope import TaskCancellation, current_cancellation
from cancellable_agents.procs._proc import IS_LINUX
from cancellable_agents.toolsets.sandbox.limits import Limits
from cancellable_agents.toolsets.sandbox.local.boundary._quotas import limits_prefix, prlimit_path

__all__ = ["HIDDEN_ETC", "SYSTEM_DIRS", "BwrapSupport", "bwrap_support", "interpreter_paths", "sandbox_uid"]

#: Files and folders under /etc a command never sees (masked with an empty file or folder).
HIDDEN_ETC: tuple[str, ...] = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/security/opasswd",
    "/etc/airflow",
)
#: System folders the boundary profile shows (read-only); a symlink stays a symlink.
SYSTEM_DIRS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: Root workers run each sandbox as ``SANDBOX_UID_BASE + random``: a uid nobody else uses, so
#: ``RLIMIT_NPROC`` (counted per uid) counts this sandbox's processes only.
SANDBOX_UID_BASE = 1_900_000_000
#: A non-root worker's commands: their own user namespace (where RLIMIT_NPROC counts from zero),
#: no nested user namespaces, no capabilities in it. (--disable-userns needs bubblewrap 0.8+.)
USERNS_ARGS = ("--unshare-user", "--disable-userns", "--cap-drop", "ALL")
SANDBOX_UID_SPAN = 100_000_000


@dataclass(frozen=True)
class BwrapSupport:
    """What bubblewrap can do here (probed once per process)."""

    usable: bool
    """A PID namespace works (namespace mode with the ``"host"`` profile)."""
    path: str | None = None
    new_session: bool = False
    reason: str = ""
    interrupted: bool = False
    """A probe was killed by a signal, or ran while the task was cancelled: no verdict, so it
    is not cached (the next sandbox probes again)."""
    boundary: bool = False
    """The ``"boundary"`` profile works: user-or-uid switch, IPC, UTS and network namespaces."""
    boundary_reason: str = ""
    user_namespace: bool = False
    """Commands get their own user namespace (non-root worker); else a uid switch (root)."""
    prlimit: str | None = None
    setpriv: str | None = None


_HOST_PROBE: tuple[str, ...] = ("--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/")
_HOST_PROBE += ("--dev", "/dev", "--proc", "/proc")
_bwrap_lock = threading.Lock()
_bwrap_cache: BwrapSupport | None = None


def bwrap_support() -> BwrapSupport:
    """Probe bubblewrap once per process (thread-safe) and cache the answer."""
    global _bwrap_cache
    with _bwrap_lock:
        if _bwrap_cache is not None:
            return _bwrap_cache
        # A cancel reaps the task's descendants, probes included, and a probe whose zombie the
        # reaper collected before its Popen did reads as exit 0: a probe cut short by a signal, or
        # run while the task was cancelled, says nothing about this machine and is not cached.
        scope = current_cancellation()
        support = _probe()
        if support.interrupted and not _cancelled(scope):
            support = _probe()  # something else signalled it: once more
        if _cancelled(scope):
            support = replace(support, interrupted=True)
        if not support.interrupted:
            _bwrap_cache = support
        return support


def _cancelled(scope: TaskCancellation | None) -> bool:
    return scope is not None and scope.cancelled


def _probe() -> BwrapSupport:
    if not IS_LINUX:
        return BwrapSupport(False, reason="PID namespaces need Linux")
    path = shutil.which("bwrap")
    if path is None:
        return BwrapSupport(False, reason="bwrap is not installed")
    works, error = _runs_ok([path, *_HOST_PROBE, "true"])
    if not works:
        return BwrapSupport(
            False,
            path,
            reason=f"bwrap cannot create a PID namespace here ({error})",
            interrupted=_interrupted(error),
        )
    new_session, session_error = _runs_ok([path, *_HOST_PROBE, "--new-session", "true"])
    prlimit, setpriv = prlimit_path(), shutil.which("setpriv")
    boundary, why, userns = _probe_boundary(path, setpriv)
    return BwrapSupport(
        True,
        path,
        new_session=new_session,
        interrupted=(not new_session and _interrupted(session_error)) or (not boundary and _interrupted(why)),
        boundary=boundary,
        boundary_reason=why,
        user_namespace=userns,
        prlimit=prlimit,
        setpriv=setpriv,
    )


def _interrupted(error: str) -> bool:
    return "killed by signal" in error


def _probe_boundary(path: str, setpriv: str | None) -> tuple[bool, str, bool]:
    """Whether the boundary profile's namespaces work; and whether with a user namespace."""
    namespaces = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--die-with-parent"]
    view = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    if os.geteuid() != 0:
        works, error = _runs_ok([path, *namespaces, *USERNS_ARGS, *view, "true"])
        return works, "" if works else f"bwrap cannot create user/network namespaces here ({error})", works
    if setpriv is None:
        return False, "setpriv (util-linux) is missing: a root worker needs it to drop root", False
    switch = [setpriv, *_setpriv_args(sandbox_uid()), "true"]
    works, error = _runs_ok([path, *namespaces, *view, "--", *switch])
    return (
        works,
        "" if works else f"bwrap cannot create network namespaces or drop root here ({error})",
        False,
    )


def _runs_ok(argv: list[str]) -> tuple[bool, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if proc.returncode < 0:
        return False, f"killed by signal {-proc.returncode}"
    return proc.returncode == 0, proc.stderr.decode("utf-8", "replace").strip() or f"exit {proc.returncode}"


def sandbox_uid() -> int:
    """A fresh uid for one sandbox of a root worker (unused by anyone else, in practice)."""
    return SANDBOX_UID_BASE + random.randrange(SANDBOX_UID_SPAN)


def _setpriv_args(uid: int) -> list[str]:
    return [
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def unavailable_message(support: BwrapSupport, profile: str) -> str:
    reason = support.reason if not support.usable else support.boundary_reason
    if support.interrupted:
        reason += (
            " - the probe was cut short by a signal (was the task being stopped?); it runs again next time"
        )
    return (
        f"isolation='namespace' (profile={profile!r}) needs a working bubblewrap, but {reason}. Fix: "
        "install it (`apt-get install bubblewrap`, or `make system-deps`) and, if the worker is not "
        "root, allow unprivileged user namespaces (`sysctl kernel.unprivileged_userns_clone=1`; on "
        "Ubuntu 24.04+ also `kernel.apparmor_restrict_unprivileged_userns=0`), or pass "
        "isolation='process-group' (cleanup only, no boundary)."
    )


# -- command lines --------------------------------------------------------------------------


def host_argv(support: BwrapSupport, workdir: str, python: str) -> list[str]:
    """The ``"host"`` profile: the whole host read-only (the behaviour before the boundary)."""
    assert support.path is not None
    argv = [support.path, "--unshare-pid", "--die-with-parent"]
    if support.new_session:
        argv.append("--new-session")
    # /tmp's tmpfs goes before the workdir bind, or a workdir under /tmp would be hidden.
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in interpreter_paths(python, under_tmp_only=True):
        argv += ["--ro-bind", path, path]
    return [*argv, "--bind", workdir, workdir, "--chdir", workdir, "--"]


@dataclass(frozen=True)
class BoundaryProfile:
    """Everything the boundary profile's command line depends on, fixed at sandbox creation."""

    workdir: str
    python: str
    network: bool
    read_only_paths: tuple[str, ...]
    writable_paths: tuple[str, ...]
    limits: Limits
    uid: int | None
    """The uid a root worker's commands run as (``None``: a user namespace instead)."""
    sockets: tuple[tuple[str, str], ...] = ()
    """Unix sockets of the host shown inside, ``(host path, path inside)`` (the egress proxy's)."""


def boundary_argv(
    support: BwrapSupport, profile: BoundaryProfile, *, seccomp_fd: int | None = None
) -> list[str]:
    """The boundary profile's command line, up to the command. ``seccomp_fd``: a descriptor the
    child inherits holding the seccomp filter
    ([`seccomp`][cancellable_agents.toolsets.sandbox.local.boundary._seccomp]), which bubblewrap loads
    last, right before the command runs."""
    assert support.path is not None
    argv = [support.path, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
    argv += ["--hostname", "sandbox"]
    if not profile.network:
        argv.append("--unshare-net")
    if support.user_namespace:
        argv += USERNS_ARGS
    if support.new_session:
        argv.append("--new-session")
    for path in SYSTEM_DIRS:
        argv += _show(path, writable=False)
    for path in HIDDEN_ETC:
        argv += _hide(path)
    argv += ["--dev", "/dev", "--proc", "/proc"]
    if profile.limits.tmp_bytes is not None:
        argv += ["--size", str(profile.limits.tmp_bytes)]
    argv += ["--perms", "1777", "--tmpfs", "/tmp"]
    shown = [*interpreter_paths(profile.python), *profile.read_only_paths]
    writable = [*profile.writable_paths, profile.workdir]
    for path in _ancestors([*shown, *writable]):
        # Folders bubblewrap creates on the way to a bind copy the host's mode (/root is 0700):
        # make them traversable, or a command running as another uid cannot reach its workdir.
        argv += ["--perms", "0755", "--dir", path]
    for path in shown:
        argv += _show(path, writable=False)
    for path in writable:
        argv += _show(path, writable=True)
    for path in _ancestors([inside for _, inside in profile.sockets]):
        argv += ["--perms", "0755", "--dir", path]
    for host_path, inside in profile.sockets:
        argv += ["--ro-bind", host_path, inside]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--chdir", profile.workdir, "--"]
    if profile.uid is not None:
        assert support.setpriv is not None
        argv += [support.setpriv, *_setpriv_args(profile.uid)]
    return argv + limits_prefix(support.prlimit, profile.limits)


def _show(path: str, *, writable: bool) -> list[str]:
    if os.path.islink(path) and path in SYSTEM_DIRS:
        return ["--symlink", os.readlink(path), path]
    if not os.path.exists(path):
        return []
    return ["--bind" if writable else "--ro-bind", path, path]


def _hide(path: str) -> list[str]:
    if os.path.isdir(path) and not os.path.islink(path):
        return ["--tmpfs", path]
    if os.path.lexists(path):
        return ["--ro-bind", "/dev/null", path]
    return []


def _ancestors(paths: Sequence[str]) -> list[str]:
    """Folders above ``paths`` that the sandbox's root does not already have, shortest first."""
    covered = ("/usr", "/etc", "/dev", "/proc")
    found: set[str] = set()
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", "") and not parent.startswith(covered):
            if parent == "/tmp":
                break
            found.add(parent)
            parent = os.path.dirname(parent)
    return sorted(found, key=lambda p: (p.count("/"), p))


def interpreter_paths(python: str, *, under_tmp_only: bool = False) -> list[str]:
    """The installations ``python`` needs (its prefix, a venv's base): bound read-only, unless
    the system folders already show them. ``under_tmp_only``: those the private /tmp would hide
    (a venv or checkout under /tmp, as CI clones often are)."""
    roots = {os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(python), os.path.realpath(python))}
    candidates = set(roots)
    if sys.executable and os.path.realpath(python) == os.path.realpath(sys.executable):
        candidates |= {sys.prefix, sys.base_prefix}  # the task's own interpreter and its venv
    if under_tmp_only:
        kept = sorted(p for p in candidates if p == "/tmp" or p.startswith("/tmp/"))
    else:
        system = tuple(d + "/" for d in SYSTEM_DIRS)
        kept = sorted(p for p in candidates if p not in ("/", *SYSTEM_DIRS) and not p.startswith(system))
    return [p for p in kept if not any(p != q and p.startswith(q + "/") for q in kept)]
