"""Which TaskFlow decorator ``@task.llm`` names, with and without common.ai installed.

common.ai registers ``llm`` and ``agent`` too; Airflow keeps the first registration and warns.
Installing this provider next to common.ai must not change what an existing DAG's ``@task.llm``
means, and ``@task.cancellable_llm`` / ``@task.cancellable_agent`` must always be ours. Each case
runs in a fresh interpreter, as a DAG parse does, so the providers manager starts empty.
``make compat-common-ai`` runs this file where common.ai is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

from cancellable_agents.get_provider_info import common_ai_installed

PARSE = """
import json
from airflow.sdk import DAG, task

with DAG("names", schedule=None):
    built = {}
    for name in ("llm", "agent", "cancellable_llm", "cancellable_agent"):
        kwargs = {"llm_conn_id": "c"} if name in ("llm", "agent") else {"model": "test"}
        def prompt() -> str:
            return "prompt"

        decorated = getattr(task, name)(task_id=name, **kwargs)(prompt)
        built[name] = type(decorated().operator).__module__
print("RESULT " + json.dumps(built))
"""


def _parse() -> tuple[dict[str, str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", PARSE], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stdout + proc.stderr


def test_decorator_names_resolve_without_a_clash() -> None:
    built, output = _parse()
    ours = "cancellable_agents.decorators"
    assert built["cancellable_llm"].startswith(ours)
    assert built["cancellable_agent"].startswith(ours)
    owner = "airflow.providers.common.ai" if common_ai_installed() else ours
    assert built["llm"].startswith(owner), built
    assert built["agent"].startswith(owner), built
    assert "already registered" not in output, output
