"""What a local sandbox makes at creation to hold its commands in: bubblewrap's boundary profile
(namespace mode), the private tmp (landlock mode) and the totals the kernel keeps (the workdir's
tmpfs, the cgroup per sandbox), with what is left for ``prlimit``.

A mixin of [`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox], apart
from its life (start, stop, destroy): each piece is made once, in ``__init__`` (the Landlock
ruleset's set-up, ``_landlock_boundary``, calls the tmp and the totals here), and a finalizer undoes
it for a sandbox nobody destroyed. This module imports no Airflow.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from cancellable_agents.toolsets.sandbox.limits import Limits
from cancellable_agents.toolsets.sandbox.local._isolation import Mode, Profile
from cancellable_agents.toolsets.sandbox.local._workdirs import new_workdir, remove_workdir
from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import (
    BoundaryProfile,
    bwrap_support,
    sandbox_uid,
)
from cancellable_agents.toolsets.sandbox.local.boundary._cgroups import SandboxCgroup
from cancellable_agents.toolsets.sandbox.local.boundary._quotas import mount_workdir
from cancellable_agents.toolsets.sandbox.local.boundary._seccomp import warn_if_missing

__all__ = ["BoundaryProvision", "absolute_path"]


class _Provisioned(Protocol):
    """What the boundary profile reads of its sandbox (and the two set-ups it calls)."""

    mode: Mode
    profile: Profile
    workdir: Path
    python: str
    network: bool

    def _sandbox_limits(self) -> Limits: ...

    def _egress_sockets(self) -> tuple[tuple[str, str], ...]: ...


class BoundaryProvision:
    """The boundary's set-up (mixed into ``LocalSandbox``): its profile, its tmp, its totals."""

    id: str
    workdir: Path
    limits: Limits
    cgroup: SandboxCgroup | None
    _owns_workdir: bool

    def _boundary_profile(
        self: _Provisioned,
        read_only: Iterable[str | os.PathLike[str]],
        writable: Iterable[str | os.PathLike[str]],
    ) -> BoundaryProfile | None:
        """Namespace mode's boundary profile (what bubblewrap shows and enforces), with the totals
        and the egress proxy set up for it; ``None`` in the other modes and profiles."""
        if self.mode != "namespace" or self.profile != "boundary":
            return None
        warn_if_missing()
        limits = self._sandbox_limits()
        uid = None if bwrap_support().user_namespace else sandbox_uid()
        if uid is not None:
            # A root worker's commands run as the sandbox's own uid: the workdir must be theirs.
            os.chown(self.workdir, uid, uid)
        return BoundaryProfile(
            workdir=str(self.workdir),
            python=self.python,
            network=self.network,
            read_only_paths=tuple(absolute_path(p) for p in read_only),
            writable_paths=tuple(absolute_path(p) for p in writable),
            limits=limits,
            uid=uid,
            sockets=self._egress_sockets(),
        )

    def _private_tmp(self) -> Path:
        """The sandbox's tmp (``TMPDIR``): named as a workdir, so the next sandbox removes it
        after a SIGKILL; a tmpfs of ``tmp_bytes`` on it where the worker may mount."""
        tmp = new_workdir()
        weakref.finalize(self, remove_workdir, tmp)
        if self.limits.tmp_bytes is not None:
            mount_workdir(tmp, self.limits.tmp_bytes)
        return tmp

    def _sandbox_limits(self) -> Limits:
        """Set up the totals (the workdir's tmpfs, the cgroup) and return what is left for
        ``prlimit``: memory and process count go to the cgroup where there is one (address space
        per process is the weaker stand-in), else stay per process."""
        if self._owns_workdir and self.limits.workdir_bytes is not None:
            mount_workdir(self.workdir, self.limits.workdir_bytes)
        self.cgroup = SandboxCgroup.create(
            self.id, memory_bytes=self.limits.memory_bytes, max_processes=self.limits.max_processes
        )
        if self.cgroup is None:
            return self.limits
        # A sandbox nobody destroyed does not leave its cgroup behind (if its commands are gone).
        weakref.finalize(self, self.cgroup.remove, 0.0)
        return replace(self.limits, memory_bytes=None, max_processes=None)


def absolute_path(path: str | os.PathLike[str]) -> str:
    """``path`` resolved; ``ValueError`` if nothing is there (a boundary cannot show it)."""
    resolved = Path(path).resolve()
    if not resolved.exists():
        raise ValueError(f"sandbox path {str(path)!r} does not exist")
    return str(resolved)
