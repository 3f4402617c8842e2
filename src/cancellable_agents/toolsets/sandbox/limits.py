"""A sandbox's resource limits, [`Limits`][]: a policy any backend may honour.

The values say what a sandbox's commands may use (memory, processes, CPU time, file sizes, open
files, the sizes of ``/tmp`` and the workdir), whatever enforces them: the local backend enforces
them with a cgroup, ``prlimit`` and tmpfs sizes
([`quotas`][cancellable_agents.toolsets.sandbox.local.boundary._quotas]); another backend may map
them onto a pod's resources or a service's quotas. This module imports nothing of a backend.
"""

from __future__ import annotations

from dataclasses import dataclass

from cancellable_agents.core.exceptions import ConfigurationError

__all__ = ["CPU_KILL_GRACE", "GiB", "Limits", "MiB"]

MiB = 1024 * 1024
GiB = 1024 * MiB

#: CPU seconds between ``Limits.cpu_seconds`` (SIGXCPU, once a second) and the SIGKILL.
CPU_KILL_GRACE = 2


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox's commands (``None``: unlimited); they bind the command and
    everything it starts, not the task.

    ``memory_bytes`` and ``max_processes`` are totals for the whole sandbox (all its commands, their
    ``/tmp``, bubblewrap's two processes per command) where the worker can create a cgroup per
    sandbox ([`cgroups`][cancellable_agents.toolsets.sandbox.local.boundary._cgroups]); the kernel's
    OOM killer ends a process of a sandbox at its memory total (SIGKILL), a fork past the count
    fails (``EAGAIN``). Elsewhere (logged once) they bind each process: address space
    (``RLIMIT_AS``; a runtime reserving much more than it uses, the JVM or Go, needs more) and
    ``RLIMIT_NPROC`` (per sandbox on a root worker, its own uid; per command otherwise).
    ``cpu_seconds`` is CPU time per process: SIGXCPU at it (a command may catch it to wrap up),
    SIGKILL ``CPU_KILL_GRACE`` CPU seconds later. ``file_size_bytes`` caps each file (SIGXFSZ),
    ``workdir_bytes`` the workdir's total (a tmpfs, on a workdir the sandbox created, where the
    worker is root; see
    [`mount_workdir`][cancellable_agents.toolsets.sandbox.local.boundary._quotas.mount_workdir]),
    ``tmp_bytes`` the private ``/tmp`` (a tmpfs per command): writes past them fail with ``ENOSPC``.
    Output is capped separately (``output_limit``).
    """

    max_processes: int | None = 256
    memory_bytes: int | None = 4 * GiB
    cpu_seconds: int | None = 600
    file_size_bytes: int | None = 1 * GiB
    open_files: int | None = 1024
    tmp_bytes: int | None = 512 * MiB
    workdir_bytes: int | None = 1 * GiB

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigurationError(f"Limits.{name} must be a positive int or None, got {value!r}")
