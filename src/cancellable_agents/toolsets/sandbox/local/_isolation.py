"""Which isolation a
[`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox] gets here.

``isolation="auto"`` gets a boundary or nothing: ``"namespace"`` when bubblewrap can give the
chosen profile on this host, else ``"landlock"`` (boundary profile) where the kernel has
Landlock, else [`SandboxUnavailable`][] naming what is missing and the fix. Never, silently,
``"process-group"``, which stops commands but is no boundary: a DAG author asks for it by name,
and it is still said once per task, loudly. This module imports no Airflow.

Isolation modes (``isolation=``):

``"namespace"`` (Linux with a working bubblewrap)
    Each command runs under bubblewrap in its own PID namespace: nothing it starts (``setsid``,
    double forks, daemons) can leave it, when the namespace's init dies the kernel kills every
    process in it, and ``--die-with-parent`` ends it even when the task process is SIGKILLed.
    With the default ``profile="boundary"`` it is also a boundary (see
    [`bwrap`][cancellable_agents.toolsets.sandbox.local.boundary._bwrap]): no home folders, no
    Airflow config, no network, not root, limits. ``profile="host"`` shows the whole host read-only instead.
``"landlock"`` (Linux 5.13+, no privilege, no namespaces)
    Each command restricts itself before it runs (Landlock, ``no_new_privs``, the seccomp filter
    with ``AF_UNIX`` sockets only unless ``network=True``): it reads the system folders and the
    interpreter, reads and writes only its workdir and a private tmp, has no network, and (ABI
    6+) signals nothing outside itself; see
    [`landlock`][cancellable_agents.toolsets.sandbox.local.boundary._landlock]. Processes are tracked and
    stopped as in process-group mode. For unprivileged pods, where bubblewrap has no namespaces.
``"process-group"`` (any POSIX; only when asked for by name)
    Each command starts a new session. A watcher thread records the pid and start time of every
    descendant every ~20 ms, so processes that later ``setsid`` or are reparented stay known.
    A stop signals the process group, every tracked process (start time checked, so a recycled
    pid is never hit) and every process that still carries the command's environment tag
    (``CANCELLABLE_AGENTS_COMMAND``). Cleanup only, **not a boundary**: the command sees what the
    task's user sees, and a SIGKILL of the task leaves commands running. Warned once per task.
``"auto"`` (default)
    Namespace mode when bubblewrap can give the chosen profile here, else landlock mode (the
    boundary profile only), else [`SandboxUnavailable`][].
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Literal

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import bwrap_support, unavailable_message
from cancellable_agents.toolsets.sandbox.local.boundary._landlock import landlock_support
from cancellable_agents.toolsets.sandbox.local.boundary._seccomp import SocketRule, seccomp_filter
from cancellable_agents.toolsets.sandbox.protocol import SandboxUnavailable

__all__ = ["Isolation", "Mode", "Profile", "choose_mode", "enforceable_egress", "warn_no_boundary"]

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespace", "landlock", "process-group"]
#: The isolation a sandbox got: what [`Isolation`][] resolves to here.
Mode = Literal["namespace", "landlock", "process-group"]
Profile = Literal["boundary", "host"]


def choose_mode(isolation: str, profile: str) -> Mode:
    """The mode for ``isolation`` and ``profile``; [`SandboxUnavailable`][] (saying how to
    fix it) if the mode required, or for ``"auto"`` any boundary, cannot be had;
    ``ConfigurationError`` (a ``ValueError``) for nonsense."""
    if isolation not in ("auto", "namespace", "landlock", "process-group"):
        raise ConfigurationError(
            f"isolation must be 'auto', 'namespace', 'landlock' or 'process-group', got {isolation!r}"
        )
    if profile not in ("boundary", "host"):
        raise ConfigurationError(f"profile must be 'boundary' or 'host', got {profile!r}")
    if isolation == "process-group":
        return "process-group"
    if isolation == "landlock":
        return _landlock(profile)
    support = bwrap_support()
    if support.usable and (profile == "host" or support.boundary):
        return "namespace"
    if isolation == "namespace":
        raise SandboxUnavailable(unavailable_message(support, profile))
    why_not = _landlock_missing() if profile == "boundary" else "it has the boundary profile only"
    if why_not is None:
        log.info(
            "LocalSandbox: no namespace sandbox (%s); using landlock isolation",
            support.reason or support.boundary_reason,
        )
        return "landlock"
    raise SandboxUnavailable(
        f"isolation='auto' found no boundary here (profile={profile!r}): no namespace mode, since "
        f"{support.reason or support.boundary_reason}; no landlock mode, since {why_not}. Fix: "
        "install bubblewrap and allow unprivileged user namespaces (in Kubernetes: a "
        "securityContext and seccomp profile that allow unshare/clone(CLONE_NEWUSER)), or a "
        "kernel with Landlock (5.13+; 6.12+ for all of it) and libseccomp (`apt-get install "
        "libseccomp2`), or pass isolation='process-group' to accept no boundary (cleanup only)."
    )


def _landlock(profile: str) -> Mode:
    """Landlock mode, or [`SandboxUnavailable`][] naming what is missing and the fix."""
    if profile != "boundary":
        raise ConfigurationError("isolation='landlock' has the boundary profile only (not 'host')")
    why_not = _landlock_missing()
    if why_not is not None:
        raise SandboxUnavailable(
            f"isolation='landlock' cannot be had: {why_not}. Fix: a kernel 5.13+ with Landlock "
            "enabled (6.12+ for signal and abstract-socket scoping), a container seccomp profile "
            "that allows landlock_* (RuntimeDefault does on current runtimes), libseccomp "
            "(`apt-get install libseccomp2`), or isolation='process-group' (cleanup only, no boundary)."
        )
    return "landlock"


def _landlock_missing() -> str | None:
    """Why landlock mode cannot be had here (``None``: it can)."""
    support = landlock_support()
    if not support.usable:
        return support.reason
    seccomp = seccomp_filter(SocketRule.UNIX_ONLY)
    if seccomp.program is None:
        # Without it the network is open to UDP, raw and netlink sockets, and nested namespaces,
        # keyrings and io_uring to the command: the boundary asked for cannot be had.
        return f"the seccomp filter is missing ({seccomp.reason})"
    return None


_warned_lock = threading.Lock()
_warned: weakref.WeakSet[TaskCancellation] = weakref.WeakSet()  # guarded by _warned_lock
_warned_unscoped = False  # guarded by _warned_lock


def warn_no_boundary(scope: TaskCancellation | None) -> None:
    """Once per task (scope): process-group mode is cleanup, not a boundary."""
    global _warned_unscoped
    with _warned_lock:
        if scope is None:
            if _warned_unscoped:
                return
            _warned_unscoped = True
        else:
            if scope in _warned:
                return
            _warned.add(scope)
    log.warning(
        "LocalSandbox runs commands in process-group mode (isolation='process-group'): this stops "
        "them on a kill but is NOT a security boundary (commands see the task's files and network "
        "and run as its user, with no limits). For a boundary pass isolation='auto' (namespace "
        "mode with bubblewrap, else landlock mode)."
    )


def enforceable_egress(policy: bool | EgressPolicy, mode: Mode, profile: Profile) -> EgressPolicy | None:
    """The allowlist, where the boundary profile can enforce it. The host profile has the host's
    network (a contradiction: refused); process-group mode has no boundary at all (warned)."""
    if not isinstance(policy, EgressPolicy):
        return None
    if profile == "host":
        raise ConfigurationError(
            "an egress allowlist needs profile='boundary' ('host' has the host's network)"
        )
    if mode == "landlock":
        # The proxy's forwarder listens on loopback, which only a network namespace makes private.
        raise ConfigurationError(
            "an egress allowlist needs isolation='namespace' for now; in Landlock mode pass "
            "network=False (no network) or network=True (the host's network)"
        )
    if mode != "namespace":
        log.warning("LocalSandbox: process-group mode has the host's network: no egress allowlist")
        return None
    return policy
