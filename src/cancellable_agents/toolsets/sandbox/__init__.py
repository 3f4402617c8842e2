"""Shell and Python commands for an agent, in a sandbox that is a boundary and that a kill stops.

- :mod:`.protocol`: the :class:`Sandbox` protocol any backend implements, its result and errors;
- :mod:`.attach`: :func:`attach_sandbox`, which ties any backend to a task's cancellation scope;
- :mod:`.local`: :class:`LocalSandbox`, process trees on this host (bubblewrap or process groups);
- :mod:`.command`: one command's process tree: watched, stopped whole, reaped, recorded;
- :mod:`.isolation`: which isolation mode a local sandbox gets here;
- :mod:`.bwrap`: bubblewrap's probe and the ``"boundary"`` / ``"host"`` profiles, :class:`Limits`;
- :mod:`.env`: the environment commands get (an allowlist);
- :mod:`.egress_policy`: :class:`EgressPolicy`, the hosts a command may reach;
- :mod:`.egress`: the proxy that enforces it, outside the sandbox, and its forwarder inside;
- :mod:`.egress_request`: the proxy's strict reading of a request head;
- :mod:`.seccomp`: the boundary profile's seccomp filter (what a command may not call);
- :mod:`.cgroups`: a cgroup per sandbox (memory and processes for the whole sandbox);
- :mod:`.workdir_size`: the workdir's total size (a tmpfs of its own);
- :mod:`.files`: the file tools' race-free access to the workdir (no symlink followed);
- :mod:`.toolset`: :class:`SandboxToolset`, the agent's tools on any backend.

See ``docs/content/sandbox.md`` for what a sandboxed command can and cannot do in each mode.
This package imports no Airflow.
"""

from cancellable_agents.toolsets.sandbox.attach import SandboxAttachment, attach_sandbox
from cancellable_agents.toolsets.sandbox.bwrap import BwrapSupport, Limits, bwrap_support
from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.env import is_sensitive, scrubbed_environment
from cancellable_agents.toolsets.sandbox.local import COMMAND_TAG, DEFAULT_OUTPUT_LIMIT, LocalSandbox
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    Sandbox,
    SandboxClosed,
    SandboxError,
    SandboxFiles,
    SandboxPathError,
    SandboxUnavailable,
)
from cancellable_agents.toolsets.sandbox.toolset import SandboxToolset

__all__ = [
    "COMMAND_TAG",
    "DEFAULT_OUTPUT_LIMIT",
    "BwrapSupport",
    "CommandResult",
    "EgressPolicy",
    "Limits",
    "LocalSandbox",
    "Sandbox",
    "SandboxAttachment",
    "SandboxClosed",
    "SandboxError",
    "SandboxFiles",
    "SandboxPathError",
    "SandboxToolset",
    "SandboxUnavailable",
    "attach_sandbox",
    "bwrap_support",
    "is_sensitive",
    "scrubbed_environment",
]
