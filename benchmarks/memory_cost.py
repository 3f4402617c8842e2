"""What the provider adds to a task process's memory, beside what pydantic-ai itself costs.

The fleet benchmark measures an agent task against a bare ``@task`` (``benchmarks/fleet.py``,
memory phase); the difference holds pydantic-ai's import and first run, which are not ours. Here,
in fresh interpreters side by side (``--reps`` rounds, the variants interleaved), each starting
from ``import airflow.sdk``:

- **plain**: a pydantic-ai agent (OpenAI model, one tool) runs a 3-step job against the local
  model server with ``Agent.run_sync``: pydantic-ai's import and first-run cost;
- **ours**: the same job through :func:`run_agent_in_scope` with a durable journal, the provider's
  operators imported: the plain cost plus the provider's;
- **operator**: the same agent as an ``AgentOperator`` task, not durable: its ``pre_execute`` and
  ``execute`` (the try, the descendant reaper, the guard, the kill log's and metrics' modules as
  a task loads them).

Prints the RSS added over ``airflow.sdk`` alone (median of the rounds) and the differences.
``.venv/bin/python -m benchmarks.memory_cost``; not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys
import psutil
import airflow.sdk

def rss():
    return psutil.Process().memory_info().rss / 2**20

base = rss()
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from cancellable_agents.testing.openai_server import ScriptedModelServer

server = ScriptedModelServer()
server.start()
provider = OpenAIProvider(base_url=server.base_url, api_key="x")
agent = Agent(OpenAIChatModel("steps?name=work&count=3&then=done", provider=provider))

@agent.tool_plain
def work(n: int) -> str:
    return "ok"

if sys.argv[1] == "operator":
    from cancellable_agents import AgentOperator

    op = AgentOperator(task_id="memory", prompt="go", agent=agent)
    op.render_template_fields({})
    op.pre_execute({})
    op.execute({})
elif sys.argv[1] == "ours":
    import cancellable_agents.operators  # noqa: F401
    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.durable import Journal, MemoryStore
    from cancellable_agents.run.runner import run_agent_in_scope

    scope = TaskCancellation("memory")
    with scope.activate():
        run_agent_in_scope(scope, agent, "go", journal=Journal(MemoryStore(), try_number=1, scope=scope))
else:
    agent.run_sync("go")
server.stop()
print(json.dumps({"added_mib": rss() - base}))
"""


def measure(variant: str, src: str | None = None) -> float:
    """RSS added by ``variant`` in a fresh interpreter; ``src``: another tree's ``src/`` first on
    the path (an earlier commit, to compare side by side)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["added_mib"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--before",
        help="another tree's src/ (e.g. `git worktree add /tmp/b OLD`: /tmp/b/src), measured interleaved",
    )
    args = parser.parse_args()
    trees = {"now": None, **({"before": args.before} if args.before else {})}
    added: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for variant in ("plain", "ours", "operator"):
            for tree, src in trees.items():
                added.setdefault((tree, variant), []).append(measure(variant, src))
    median = {key: statistics.median(values) for key, values in added.items()}
    print(f"RSS added over `import airflow.sdk`, median of {args.reps}, variants and trees interleaved")
    print("| variant | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    rows = [
        ("pydantic-ai agent, `run_sync`", lambda t: median[(t, "plain")]),
        ("the same through the provider, durable", lambda t: median[(t, "ours")]),
        ("the provider's own (durable run)", lambda t: median[(t, "ours")] - median[(t, "plain")]),
        ("the same agent as an `AgentOperator` task", lambda t: median[(t, "operator")]),
        ("the provider's own (operator task)", lambda t: median[(t, "operator")] - median[(t, "plain")]),
    ]
    for label, value in rows:
        print(f"| {label} | " + " | ".join(f"{value(t):+.1f} MiB" for t in trees) + " |")


if __name__ == "__main__":
    main()
