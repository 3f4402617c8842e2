"""What a running task loads of ours: only what it uses (issue: memory per running task).

A fresh interpreter runs a plain (not durable) ``AgentOperator`` task with one function tool and
lists the modules it loaded. The sandbox backend and its boundary (bubblewrap, Landlock, seccomp,
cgroups, the egress proxy), sub-agents, the durable journal and its stores, deferral triggers and
the MCP SDK load only for a task that uses them. A control child imports one of them eagerly and
must be caught, so the check cannot pass by looking at nothing.
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
    "cancellable_agents.toolsets.subagents",
    "cancellable_agents.durable.journal",
    "cancellable_agents.durable.appender",
    "cancellable_agents.durable.stores",
    "cancellable_agents.durable.steps",
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


def _loaded(tmp_path: Path, *extra: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *extra],
        env=airflow_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    modules: list[str] = json.loads(out.strip().splitlines()[-1])
    return [m for m in modules if any(m == u or m.startswith(u + ".") for u in UNUSED)]


def test_a_plain_agent_task_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    assert _loaded(tmp_path) == []


def test_the_check_sees_a_feature_loaded_eagerly(tmp_path: Path) -> None:
    assert "cancellable_agents.toolsets.sandbox.local.sandbox" in _loaded(
        tmp_path, "cancellable_agents.toolsets.sandbox.local.sandbox"
    )
