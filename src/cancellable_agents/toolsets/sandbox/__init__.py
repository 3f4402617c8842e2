"""Shell and Python commands for an agent, in a sandbox that is a boundary and that a kill stops.

Three floors, each importing only the ones below it:

- here, any backend: [`protocol`][cancellable_agents.toolsets.sandbox.protocol] (the [`Sandbox`][]
  protocol, its result and errors), the policies any backend may honour
  ([`egress_policy`][cancellable_agents.toolsets.sandbox.egress_policy]: [`EgressPolicy`][], the
  hosts a command may reach; [`limits`][cancellable_agents.toolsets.sandbox.limits]: [`Limits`][]),
  [`attach`][cancellable_agents.toolsets.sandbox._attach] ([`attach_sandbox`][], the one way a
  backend is tied to a task's scope, with the one guard against a start racing a cancel),
  [`sandbox_tools`][cancellable_agents.toolsets.sandbox.sandbox_tools] ([`SandboxTools`][], the
  agent's tools on any backend, a pydantic-ai toolset) and
  [`sandbox_toolset`][cancellable_agents.toolsets.sandbox.sandbox_toolset] ([`SandboxToolset`][],
  how a DAG file describes those tools: light, made when the task runs);
- [`local`][cancellable_agents.toolsets.sandbox.local]: the local backend, [`LocalSandbox`][]:
  process trees on this host, one command's tree (``command``), how it is spawned (``spawn``), the
  isolation mode (``isolation``), workdirs, race-free file access (``files``) and the environment
  allowlist (``env``);
- [`boundary`][cancellable_agents.toolsets.sandbox.local.boundary]: what keeps a local command in:
  bubblewrap's profiles (``bwrap``), the seccomp filter, the egress allowlist's proxy
  (``egress_proxy``, ``egress_request``), the cgroup per sandbox (``cgroups``) and the rest of the
  limits' enforcement (``quotas``).

See ``docs/content/sandbox.md`` for what a sandboxed command can and cannot do in each mode.
This package imports no Airflow, and its names load on first use: a DAG file that describes a
``SandboxToolset`` imports neither pydantic-ai nor the local backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cancellable_agents.core._lazy import lazy_exports

if TYPE_CHECKING:  # ``X as X``: explicit re-exports, for type checkers and linters alike
    from cancellable_agents.toolsets.sandbox._attach import SandboxAttachment as SandboxAttachment
    from cancellable_agents.toolsets.sandbox._attach import attach_sandbox as attach_sandbox
    from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy as EgressPolicy
    from cancellable_agents.toolsets.sandbox.limits import Limits as Limits
    from cancellable_agents.toolsets.sandbox.local._env import is_sensitive as is_sensitive
    from cancellable_agents.toolsets.sandbox.local._env import scrubbed_environment as scrubbed_environment
    from cancellable_agents.toolsets.sandbox.local._sandbox import COMMAND_TAG as COMMAND_TAG
    from cancellable_agents.toolsets.sandbox.local._sandbox import (
        DEFAULT_OUTPUT_LIMIT as DEFAULT_OUTPUT_LIMIT,
    )
    from cancellable_agents.toolsets.sandbox.local._sandbox import LocalSandbox as LocalSandbox
    from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import BwrapSupport as BwrapSupport
    from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import bwrap_support as bwrap_support
    from cancellable_agents.toolsets.sandbox.protocol import CommandResult as CommandResult
    from cancellable_agents.toolsets.sandbox.protocol import Sandbox as Sandbox
    from cancellable_agents.toolsets.sandbox.protocol import SandboxCapabilities as SandboxCapabilities
    from cancellable_agents.toolsets.sandbox.protocol import SandboxClosed as SandboxClosed
    from cancellable_agents.toolsets.sandbox.protocol import SandboxError as SandboxError
    from cancellable_agents.toolsets.sandbox.protocol import SandboxFiles as SandboxFiles
    from cancellable_agents.toolsets.sandbox.protocol import SandboxPathError as SandboxPathError
    from cancellable_agents.toolsets.sandbox.protocol import SandboxUnavailable as SandboxUnavailable
    from cancellable_agents.toolsets.sandbox.protocol import ScopedSandbox as ScopedSandbox
    from cancellable_agents.toolsets.sandbox.sandbox_tools import SandboxTools as SandboxTools
    from cancellable_agents.toolsets.sandbox.sandbox_toolset import SandboxToolset as SandboxToolset

_EXPORTS = {
    "COMMAND_TAG": "cancellable_agents.toolsets.sandbox.local._sandbox",
    "DEFAULT_OUTPUT_LIMIT": "cancellable_agents.toolsets.sandbox.local._sandbox",
    "LocalSandbox": "cancellable_agents.toolsets.sandbox.local._sandbox",
    "BwrapSupport": "cancellable_agents.toolsets.sandbox.local.boundary._bwrap",
    "bwrap_support": "cancellable_agents.toolsets.sandbox.local.boundary._bwrap",
    "CommandResult": "cancellable_agents.toolsets.sandbox.protocol",
    "Sandbox": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxCapabilities": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxClosed": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxError": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxFiles": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxPathError": "cancellable_agents.toolsets.sandbox.protocol",
    "SandboxUnavailable": "cancellable_agents.toolsets.sandbox.protocol",
    "ScopedSandbox": "cancellable_agents.toolsets.sandbox.protocol",
    "EgressPolicy": "cancellable_agents.toolsets.sandbox.egress_policy",
    "Limits": "cancellable_agents.toolsets.sandbox.limits",
    "is_sensitive": "cancellable_agents.toolsets.sandbox.local._env",
    "scrubbed_environment": "cancellable_agents.toolsets.sandbox.local._env",
    "SandboxAttachment": "cancellable_agents.toolsets.sandbox._attach",
    "attach_sandbox": "cancellable_agents.toolsets.sandbox._attach",
    "SandboxToolset": "cancellable_agents.toolsets.sandbox.sandbox_toolset",
    "SandboxTools": "cancellable_agents.toolsets.sandbox.sandbox_tools",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
