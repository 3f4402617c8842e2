"""The demo's DAG: an agent whose sandbox runs a process tree, waiting to be killed.

The model is the provider's local scripted server (connection ``demo_model``): it asks for one
``run_shell`` call, and the command runs for minutes, so the demo can kill the task mid-run.
"""

from __future__ import annotations

import json
import urllib.parse
from datetime import datetime, timezone

from airflow.sdk import DAG

from cancellable_agents import AgentOperator, SandboxToolset

#: Fractional seconds make the demo's processes easy to find, and nobody else's.
MARKER = "300.4242"
COMMAND = f"sleep {MARKER} & sleep {MARKER} & wait"
MODEL = "openai:tool?" + urllib.parse.urlencode(
    {"name": "run_shell", "args": json.dumps({"command": COMMAND}), "then": "done"}
)

with DAG("kill_me_demo", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    AgentOperator(
        task_id="research",
        llm_conn_id="demo_model",
        model=MODEL,
        prompt="Investigate the data set, take your time.",
        stream=True,
        toolsets=[SandboxToolset(command_timeout=600)],
    )

if __name__ == "__main__":
    dag.test()
