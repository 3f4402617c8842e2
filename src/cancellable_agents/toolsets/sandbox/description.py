"""``SandboxToolset``: a sandbox's tools as a DAG file describes them, made when the task runs.

Describing costs a DAG file nothing: this module imports neither pydantic-ai nor the local
backend (bubblewrap, seccomp, cgroups), and no sandbox is made (no workdir, no probe) until the
task runs. The network setting is checked here, so a bad egress rule fails the DAG's parse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cancellable_agents.toolsets.sandbox.local.boundary.egress_policy import EgressPolicy
from cancellable_agents.toolsets.toolset_description import ToolsetDescription

if TYPE_CHECKING:
    from cancellable_agents.toolsets.sandbox.local.boundary.limits import Limits
    from cancellable_agents.toolsets.sandbox.local.isolation import Isolation, Profile
    from cancellable_agents.toolsets.sandbox.protocol import Sandbox

__all__ = ["SandboxToolset"]


class SandboxToolset(ToolsetDescription):
    """Shell, Python and file tools for an agent, run in a sandbox a kill stops.

    ``AgentOperator(..., toolsets=[SandboxToolset()])``; the task makes the pydantic-ai toolset
    (:class:`~cancellable_agents.toolsets.sandbox.toolset.SandboxTools`) when it runs.
    ``Agent(model, toolsets=[SandboxToolset()])`` works too.

    :param sandbox: a backend of your own (any :class:`Sandbox`); it is yours and never destroyed
        here. Default: a :class:`LocalSandbox` made on first use, destroyed on the toolset's exit.
    :param isolation: the local sandbox's isolation: ``"auto"`` (default), ``"namespace"``,
        ``"landlock"`` (a boundary without namespaces, for unprivileged pods) or ``"process-group"``.
    :param profile: ``"boundary"`` (default) or ``"host"``.
    :param network: ``False`` (default), ``True``, or an egress allowlist (``EgressPolicy`` or host
        rules such as ``["api.github.com", "*.pypi.org:443"]``).
    :param limits: the local sandbox's :class:`Limits` (memory, processes, CPU, file size ...).
    :param command_timeout: seconds a command may run (a tool call may ask for less). Default 60.
    :param output_limit: bytes of a command's output the model gets. Default: the sandbox's.
    :param id: the toolset's id (pydantic-ai durable execution needs one).
    :param workdir: the local sandbox's working directory (default: a temporary one, removed with
        the sandbox); ``LocalSandbox``'s ``workdir``.
    :param env: variables added to the commands' environment (``LocalSandbox``'s ``env``).
    """

    toolset_class = "cancellable_agents.toolsets.sandbox.toolset:SandboxTools"

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        isolation: Isolation = "auto",
        profile: Profile = "boundary",
        network: bool | EgressPolicy | Sequence[str] = False,
        limits: Limits | None = None,
        command_timeout: float = 60,
        output_limit: int | None = None,
        id: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {
            "isolation": isolation,
            "profile": profile,
            "network": EgressPolicy.coerce(network),
            "limits": limits,
            "command_timeout": command_timeout,
            "id": id,
            "workdir": workdir,
            "env": env,
        }
        if output_limit is not None:
            kwargs["output_limit"] = output_limit
        super().__init__(sandbox, **kwargs)
