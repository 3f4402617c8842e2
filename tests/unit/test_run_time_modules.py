"""What a running task loads of ours: only what it uses (issue: memory per running task).

A fresh interpreter runs a plain (not durable) ``AgentOperator`` task with one function tool and
lists the modules it loaded. The sandbox backend and its boundary (bubblewrap, Landlock, seccomp,
cgroups, the egress proxy), sub-agents, the durable journal and its stores, deferral triggers and
the MCP SDK load only for a task that uses them. A control child imports one of them eagerly and
must be caught, so the check cannot pass by looking at nothing. A task whose agent runs commands
on another sandbox backend loads the generic sandbox toolset and none of the local backend
(``LocalSandbox``, bubblewrap, seccomp, Landlock, cgroups).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.airflow_env import airflow_env

#: Module prefixes a task that uses none of these features must not load.
UNUSED = (
    "cancellable_agents.toolsets.sandbox",
    "cancellable_agents.toolsets.subagent_tools",
    "cancellable_agents.durable._journal",
    "cancellable_agents.durable._appender",
    "cancellable_agents.durable._stores",
    "cancellable_agents.durable._steps",
    "cancellable_agents.airflow.triggers",
    "mcp",
    "pyseccomp",
    "seccomp",
)

CHILD = r"""
import json, sys
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel
from cancellable_agents import AgentOperator

if sys.argv[1:]:
    __import__(sys.argv[1])  # the control: one feature loaded eagerly

agent = Agent(TestModel())

@agent.tool_plain
def work(n: int) -> str:
    return "ok"

op = AgentOperator(task_id="plain", prompt="go", agent=agent)
op.pre_execute({})
assert op.execute({}) == '{"work":"ok"}'
print(json.dumps(sorted(sys.modules)))
"""


#: A task whose agent calls ``run_shell`` once on a backend of its own: a real one, whose commands
#: are this child's subprocesses (as a container or remote backend's would be elsewhere).
OTHER_BACKEND_CHILD = r"""
import json, os, subprocess, sys
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel
from cancellable_agents import AgentOperator
from cancellable_agents.toolsets.sandbox import CommandResult, SandboxCapabilities, SandboxToolset

if sys.argv[1:]:
    __import__(sys.argv[1])  # the control: one feature loaded eagerly

class Subprocesses:
    capabilities = SandboxCapabilities()

    def __init__(self):
        self.procs = {}

    def start(self, command, *, timeout=None, stdin=None, env=None):
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env={**os.environ, **(env or {})}, text=True)
        self.procs[str(proc.pid)] = proc
        return str(proc.pid)

    def wait(self, command_id, timeout=None):
        proc = self.procs[command_id]
        out, _ = proc.communicate(timeout=timeout)
        return CommandResult(command_id, proc.returncode, out, "")

    def stop(self, command_id):
        self.procs[command_id].kill()

    def stop_all(self):
        for command_id in self.procs:
            self.stop(command_id)

    def destroy(self):
        self.stop_all()

def model(messages, info):
    returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if returns:
        return ModelResponse(parts=[TextPart(returns[0].content["stdout"])])
    return ModelResponse(parts=[ToolCallPart("run_shell", {"command": "echo ran"})])

agent = Agent(FunctionModel(model), toolsets=[SandboxToolset(Subprocesses())])
op = AgentOperator(task_id="other_backend", prompt="go", agent=agent)
op.pre_execute({})
assert op.execute({}) == "ran\n"
print(json.dumps(sorted(sys.modules)))
"""

#: The local backend and its boundary: what a task on another backend must not load.
LOCAL_BACKEND = ("cancellable_agents.toolsets.sandbox.local", "pyseccomp", "seccomp")


def _modules(tmp_path: Path, child: str, *extra: str) -> list[str]:
    """The modules a fresh child running ``child`` had loaded at its end."""
    out = subprocess.run(
        [sys.executable, "-c", child, *extra],
        env=airflow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    modules: list[str] = json.loads(out.strip().splitlines()[-1])
    return modules


def _among(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == u or m.startswith(u + ".") for u in prefixes)]


def _loaded(tmp_path: Path, *extra: str) -> list[str]:
    return _among(_modules(tmp_path, CHILD, *extra), UNUSED)


def test_a_plain_agent_task_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    assert _loaded(tmp_path) == []


def test_the_check_sees_a_feature_loaded_eagerly(tmp_path: Path) -> None:
    assert "cancellable_agents.toolsets.sandbox.local._sandbox" in _loaded(
        tmp_path, "cancellable_agents.toolsets.sandbox.local._sandbox"
    )


def test_a_task_on_another_backend_loads_no_local_sandbox_code(tmp_path: Path) -> None:
    modules = _modules(tmp_path, OTHER_BACKEND_CHILD)
    assert "cancellable_agents.toolsets.sandbox.sandbox_tools" in modules, "the sandbox toolset was not used"
    assert _among(modules, LOCAL_BACKEND) == []


def test_the_check_sees_the_local_backend_loaded_eagerly_beside_another(tmp_path: Path) -> None:
    modules = _modules(tmp_path, OTHER_BACKEND_CHILD, "cancellable_agents.toolsets.sandbox.local._sandbox")
    assert "cancellable_agents.toolsets.sandbox.local.boundary._bwrap" in _among(modules, LOCAL_BACKEND)


#: What a task process does with plugins: Airflow's Task SDK loads every plugin class (the
#: ``airflow.plugins`` entry points', the Cancellations view's among them) to integrate their macros.
PLUGINS_CHILD = r"""
import json, sys
from airflow.sdk.plugins_manager import integrate_macros_plugins
integrate_macros_plugins()
if sys.argv[1:]:
    __import__(sys.argv[1])  # the control: the view's app loaded eagerly
print(json.dumps(sorted(sys.modules)))
"""

#: The Cancellations view's app and pages, and what they import: the API server's, never a task's.
VIEW = (
    "cancellable_agents.airflow.cancellations_view._app",
    "cancellable_agents.airflow.cancellations_view._pages",
    "fastapi",
)


def _plugin_modules(tmp_path: Path, *extra: str) -> list[str]:
    env = {**airflow_env(tmp_path), "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": "False"}
    out = subprocess.run(
        [sys.executable, "-c", PLUGINS_CHILD, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    modules: list[str] = json.loads(out.strip().splitlines()[-1])
    return modules


def test_a_task_process_loads_the_view_plugin_class_but_not_its_app(tmp_path: Path) -> None:
    modules = _plugin_modules(tmp_path)
    assert "cancellable_agents.airflow.cancellations_view._plugin" in modules, "the plugin was not loaded"
    assert _among(modules, VIEW) == []


def test_the_check_sees_the_view_app_loaded_eagerly(tmp_path: Path) -> None:
    modules = _plugin_modules(tmp_path, "cancellable_agents.airflow.cancellations_view._app")
    assert "fastapi" in _among(modules, VIEW)
