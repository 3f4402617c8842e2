"""Shell and Python commands for an agent, in a sandbox that is a boundary and that a kill stops.

Three floors, each importing only the ones below it:

- here, any backend: :mod:`.protocol` (the :class:`Sandbox` protocol, its result and errors),
  :mod:`.attach` (:func:`attach_sandbox`, the one way a backend is tied to a task's scope, with
  the one guard against a start racing a cancel) and :mod:`.toolset` (:class:`SandboxToolset`,
  the agent's tools on any backend);
- :mod:`.local`: the local backend, :class:`LocalSandbox`: process trees on this host, one
  command's tree (``command``), how it is spawned (``spawn``), the isolation mode (``isolation``),
  workdirs, race-free file access (``files``) and the environment allowlist (``env``);
- :mod:`.local.boundary`: what keeps a local command in: bubblewrap's profiles (``bwrap``), the
  seccomp filter, the egress allowlist (``egress_policy``, ``egress_proxy``, ``egress_request``),
  the cgroup per sandbox (``cgroups``) and :class:`Limits` with the rest of their enforcement
  (``limits``).

See ``docs/content/sandbox.md`` for what a sandboxed command can and cannot do in each mode.
This package imports no Airflow.
"""

from cancellable_agents.toolsets.sandbox.attach import SandboxAttachment, attach_sandbox
from cancellable_agents.toolsets.sandbox.local.boundary.bwrap import BwrapSupport, bwrap_support
from cancellable_agents.toolsets.sandbox.local.boundary.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.local.boundary.limits import Limits
from cancellable_agents.toolsets.sandbox.local.env import is_sensitive, scrubbed_environment
from cancellable_agents.toolsets.sandbox.local.sandbox import COMMAND_TAG, DEFAULT_OUTPUT_LIMIT, LocalSandbox
from cancellable_agents.toolsets.sandbox.protocol import (
    CommandResult,
    Sandbox,
    SandboxClosed,
    SandboxError,
    SandboxFiles,
    SandboxPathError,
    SandboxUnavailable,
    ScopedSandbox,
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
    "ScopedSandbox",
    "attach_sandbox",
    "bwrap_support",
    "is_sensitive",
    "scrubbed_environment",
]
