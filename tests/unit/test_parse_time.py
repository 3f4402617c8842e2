"""What a DAG file using the operators costs the dag-processor: nothing heavy loads at parse time.

The dag-processor imports a file's ``airflow.*`` imports once in its parent and forks a child per
parse; everything else is imported again in every child (docs/content/architecture.md,
"Import cost"). A fresh interpreter here
does the same: it pre-imports what Airflow's ``iter_airflow_imports`` finds in the file, then runs
the file and lists the heavy modules the run added. ``make bench-parse`` measures the CPU.

``SandboxToolset`` and ``SubagentToolset`` are light descriptions (made into their pydantic-ai
toolsets when the task runs), and so is a ``Subagent`` described by its instructions and toolsets:
the file builds them too. (A DAG file that builds a pydantic-ai ``Agent`` has chosen that import.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.airflow_env import airflow_env

#: What must not load while a DAG file is parsed (those Airflow itself loads in the parent, such
#: as httpx, psutil and OpenTelemetry, are in the parent already and so not counted).
HEAVY = (
    "pydantic_ai",
    "pydantic_graph",
    "httpx",
    "openai",
    "anthropic",
    "opentelemetry",
    "psutil",
    "pyseccomp",
)

#: Ours, and needed only once a task runs (or only on the API server): the scope and its unwind,
#: process watching, the kill record (and its stored copy), the Cancellations view's app,
#: metrics, the supervisor watch, the durable stores and journal (and its rooms), the model hook.
RUN_TIME_ONLY = (
    "cancellable_agents.core.scope",
    "cancellable_agents.airflow.kill_record._stored",
    # The Cancellations view's app: the API server's alone (the plugin class is light).
    "cancellable_agents.airflow.cancellations_view._app",
    "cancellable_agents.airflow.cancellations_view._pages",
    "cancellable_agents.airflow.kill_record.document",
    "cancellable_agents.procs",
    "cancellable_agents.run",
    "cancellable_agents.airflow.kill_record._task_log",
    "cancellable_agents.airflow._metrics",
    "cancellable_agents.airflow._supervisor",
    "cancellable_agents.airflow._server_stop",
    "cancellable_agents.durable._stores",
    "cancellable_agents.durable._journal",
    "cancellable_agents.durable._appender",
    "cancellable_agents.durable._resume_plan",
    "cancellable_agents.durable._run_arguments",
    "cancellable_agents.durable._steps",
    "cancellable_agents.hooks.model",
    "cancellable_agents.toolsets.sandbox.sandbox_tools",
    "cancellable_agents.toolsets.subagent_tools",
    "cancellable_agents.toolsets.sandbox.local._sandbox",
    "cancellable_agents.toolsets.sandbox.local.boundary._bwrap",
    "cancellable_agents.toolsets.sandbox.local.boundary._seccomp",
    "cancellable_agents.toolsets.sandbox.local.boundary._landlock",
    "cancellable_agents.toolsets.sandbox.local.boundary._cgroups",
    "cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy",
)

DAG_FILE = '''
from datetime import datetime, timedelta

from airflow.sdk import DAG, task

from cancellable_agents import (
    AgentOperator, CancellationAwareRetryPolicy, DurableOptions, EgressPolicy, Limits, LLMOperator,
    SandboxToolset, Subagent, SubagentToolset,
)


def lookup(order_id: str) -> str:
    """A plain function tool."""
    return order_id


with DAG(dag_id="parse_light", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
    policy = CancellationAwareRetryPolicy()
    LLMOperator(
        task_id="llm", prompt="hi", model="test", retries=2, retry_policy=policy,
        execution_timeout=timedelta(minutes=5), wind_down=20,
    )
    AgentOperator(
        task_id="agent", prompt="hi", llm_conn_id="openai_default", tools=[lookup],
        durable=DurableOptions(flush_after=0), execution_timeout=timedelta(minutes=5), stream=True,
        toolsets=[
            SandboxToolset(network=EgressPolicy(["api.github.com"]), limits=Limits(max_processes=64)),
            SubagentToolset([Subagent("helper", instructions="Help.", toolsets=[SandboxToolset()])]),
        ],
    )

    @task.llm(model="test")
    def haiku() -> str:
        return "Write a haiku."

    @task.agent(model="test", tools=[lookup], toolsets=[SandboxToolset(network=["*.pypi.org:443"])])
    def investigate() -> str:
        return "Look it up."

    haiku()
    investigate()
'''

PARSE = """
import importlib, json, runpy, sys
from airflow.utils.file import iter_airflow_imports

path = sys.argv[1]
for module in iter_airflow_imports(path):  # the dag-processor's parent: _pre_import_airflow_modules
    importlib.import_module(module)
before = set(sys.modules)
namespace = runpy.run_path(path)
added = set(sys.modules) - before
print(json.dumps({
    "tasks": sorted(namespace["dag"].task_ids),
    "added": sorted(added),
}))
"""


def _parse(tmp_path: Path) -> dict[str, object]:
    dag_file = tmp_path / "agents_dag.py"
    dag_file.write_text(DAG_FILE)
    done = subprocess.run(
        [sys.executable, "-c", PARSE, str(dag_file)],
        env=airflow_env(tmp_path / "airflow_home"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_dag_file_with_every_operator_and_decorator_loads_nothing_heavy(tmp_path: Path) -> None:
    parsed = _parse(tmp_path)
    assert parsed["tasks"] == ["agent", "haiku", "investigate", "llm"], parsed["tasks"]
    added = parsed["added"]
    assert isinstance(added, list)
    heavy = sorted({name.split(".")[0] for name in added} & set(HEAVY))
    assert heavy == [], f"parsing the DAG file loaded {heavy}: the dag-processor pays that on every parse"
    # A module or its submodules, never a longer name it prefixes (``sandbox_tools`` is run time,
    # ``sandbox_toolset`` the light description a DAG file uses).
    early = sorted(
        name for name in added if any(name == m or name.startswith(m + ".") for m in RUN_TIME_ONLY)
    )
    assert early == [], f"parsing the DAG file loaded {early}, which only a running task needs"
    assert any(name.startswith("cancellable_agents.operators") for name in added), "the file used ours"
