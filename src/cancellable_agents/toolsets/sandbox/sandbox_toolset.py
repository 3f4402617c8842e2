"""``SandboxToolset``: a sandbox's tools as a DAG file describes them, made when the task runs.

Describing costs a DAG file nothing: this module imports neither pydantic-ai nor the local
backend (bubblewrap, seccomp, cgroups), and no sandbox is made (no workdir, no probe) until the
task runs. The network setting is checked here, so a bad egress rule fails the DAG's parse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.toolsets._toolset_description import ToolsetDescription
from cancellable_agents.toolsets.sandbox.egress_policy import EgressPolicy
from cancellable_agents.toolsets.sandbox.protocol import require_sandbox

if TYPE_CHECKING:
    from cancellable_agents.toolsets.sandbox.limits import Limits
    from cancellable_agents.toolsets.sandbox.local._isolation import Isolation, Profile
    from cancellable_agents.toolsets.sandbox.protocol import Sandbox

__all__ = ["LOCAL_OPTIONS", "SandboxToolset", "refuse_local_options"]

#: The toolset's options that configure the ``LocalSandbox`` it makes, with their defaults: with
#: a backend passed in (``sandbox=``) they cannot apply.
LOCAL_OPTIONS: dict[str, object] = {
    "isolation": "auto",
    "profile": "boundary",
    "network": False,
    "limits": None,
    "output_limit": None,
    "workdir": None,
    "env": None,
}


class SandboxToolset(ToolsetDescription):
    """Shell, Python and file tools for an agent, run in a sandbox a kill stops.

    ``AgentOperator(..., toolsets=[SandboxToolset()])``; the task makes the pydantic-ai toolset
    ([`SandboxTools`][cancellable_agents.toolsets.sandbox.sandbox_tools.SandboxTools]) when it runs.
    ``Agent(model, toolsets=[SandboxToolset()])`` works too.

    :param sandbox: a backend of your own (any [`Sandbox`][]); it is yours: the toolset never
        destroys it (a kill does, as it destroys every backend attached to the task), and the
        options below that configure the local sandbox are refused with it (set them on your
        backend). Default: a
        [`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox] made on
        first use, destroyed on the toolset's exit.
    :param isolation: the local sandbox's isolation: ``"auto"`` (default), ``"namespace"``,
        ``"landlock"`` (a boundary without namespaces, for unprivileged pods) or ``"process-group"``.
    :param profile: ``"boundary"`` (default) or ``"host"``.
    :param network: ``False`` (default), ``True``, or an egress allowlist (``EgressPolicy`` or host
        rules such as ``["api.github.com", "*.pypi.org:443"]``).
    :param limits: the local sandbox's [`Limits`][] (memory, processes, CPU, file size ...).
    :param command_timeout: seconds a command may run (a tool call may ask for less). Default 60.
    :param output_limit: bytes of a command's output the model gets. Default: the sandbox's.
    :param id: the toolset's id (pydantic-ai durable execution needs one).
    :param workdir: the local sandbox's working directory (default: a temporary one, removed with
        the sandbox); ``LocalSandbox``'s ``workdir``.
    :param env: variables added to the commands' environment (``LocalSandbox``'s ``env``).
    """

    toolset_class = "cancellable_agents.toolsets.sandbox.sandbox_tools:SandboxTools"

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
        refuse_local_options(
            sandbox,
            isolation=isolation,
            profile=profile,
            network=network,
            limits=limits,
            output_limit=output_limit,
            workdir=workdir,
            env=env,
        )
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


def refuse_local_options(sandbox: object, **given: object) -> None:
    """With a backend passed in (``sandbox`` not ``None``), refuse every local-sandbox option that
    is not its default (``LOCAL_OPTIONS``): ignored, it would be a boundary the DAG author
    believes in and does not get. Also refuses a ``sandbox`` that is no [`Sandbox`][].
    Checked at the DAG's parse (the description) and again where the toolset is made."""
    if sandbox is None:
        return
    require_sandbox(sandbox)
    network = given.get("network", False)
    if network is not False and not isinstance(network, bool):
        network = EgressPolicy.coerce(network)  # type: ignore[arg-type]
    # An empty env= adds nothing to any sandbox: the same as not giving it.
    chosen = {**given, "network": network, "env": given.get("env") or None}
    refused = [f"{name}={value!r}" for name, value in chosen.items() if value != LOCAL_OPTIONS.get(name)]
    if refused:
        raise ConfigurationError(
            f"SandboxToolset(sandbox={type(sandbox).__name__}(...)) cannot apply {', '.join(refused)}: "
            "those configure the LocalSandbox the toolset makes when no sandbox is given, and a "
            "backend passed in keeps its own settings. Fix: set them on the backend you pass "
            "(e.g. LocalSandbox(isolation=..., limits=..., env=...)), or drop sandbox= to let the "
            "toolset make its own."
        )
