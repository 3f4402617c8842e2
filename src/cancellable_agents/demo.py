"""``python -m cancellable_agents.demo``: kill a running agent task and show the unwind.

No API key, no Airflow services: the provider's local OpenAI-compatible server plays the
model, and the task runs through Airflow's own Task SDK (``dag.test()``) in a child process.
Mid-run, while the agent's sandbox runs a process tree, the demo sends the task process a real
SIGTERM (what a worker eviction sends) and prints the cancellation timeline the task logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from cancellable_agents.airflow.kill_record.document import parse_records
from cancellable_agents.demo_dags import kill_me_demo
from cancellable_agents.testing.openai_server import ScriptedModelServer

DAGS = Path(kill_me_demo.__file__).parent


def main() -> int:
    with (
        tempfile.TemporaryDirectory(prefix="cancellable-agents-demo-") as home,
        ScriptedModelServer() as model,
    ):
        env = _airflow_env(Path(home), model.base_url)
        _say("Preparing a throwaway Airflow home (SQLite) ...")
        subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True
        )
        log_path = Path(home) / "task.log"
        with log_path.open("wb") as log:
            task = subprocess.Popen(
                [sys.executable, kill_me_demo.__file__], env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                return _kill_and_report(task, log_path)
            finally:
                if task.poll() is None:
                    task.kill()


def _kill_and_report(task: subprocess.Popen[bytes], log_path: Path) -> int:
    _say(f"Task process {task.pid} started; waiting for the agent's sandbox command to run ...")
    tree = _wait_for_marker(timeout=90)
    if not tree:
        _say("The sandbox command never started; task log tail:\n" + _tail(log_path))
        return 1
    _say(f"The agent's sandbox runs `{kill_me_demo.COMMAND}`: {len(tree)} processes {sorted(tree)}")
    _say(f"Sending SIGTERM to the task process {task.pid} only (what a worker eviction sends) ...")
    sent = time.monotonic()
    os.kill(task.pid, signal.SIGTERM)
    task.wait(timeout=30)
    exited_ms = (time.monotonic() - sent) * 1000
    record = _find_record(log_path.read_text(errors="replace"))
    if record is None:
        _say("No cancellation record in the task log; tail:\n" + _tail(log_path))
        return 1
    survivors = _wait_for_marker(timeout=0)
    _print_record(record, exited_ms, survivors)
    return 0 if not survivors and record["outcome"] == "cancelled" else 1


def _airflow_env(home: Path, base_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_CONN_DEMO_MODEL": json.dumps({"conn_type": "cancellable_agents_model", "host": base_url}),
    }


def _wait_for_marker(timeout: float) -> set[int]:
    """Pids of the demo command's ``sleep`` processes, polled until some appear or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = {
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if kill_me_demo.MARKER in (p.info["cmdline"] or [])
        }
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _find_record(text: str) -> dict[str, Any] | None:
    records = parse_records(text)
    return records[-1] if records else None


def _print_record(record: dict[str, Any], exited_ms: float, survivors: set[int]) -> None:
    print("\nCancellation timeline (ms since the kill reached the task):")
    for event in record["timeline"]:
        extra = {k: v for k, v in event.items() if k not in ("event", "ms")}
        details = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"  {event['ms']:>9.1f}  {event['event']:<20} {details}")
    unwound = next((e["ms"] for e in record["timeline"] if e["event"] == "run_unwound"), None)
    budget_ms = record["budget_s"] * 1000
    print(f"\ncause: {record['cause']} ({record['detail']})   outcome: {record['outcome']}")
    print(f"processes killed: {len(record['killed'])}   left running: {len(survivors)}")
    if unwound is not None:
        print(f"run unwound {unwound:.1f} ms after the kill (budget {budget_ms:.0f} ms); ", end="")
    print(f"task process exited {exited_ms:.0f} ms after SIGTERM (Airflow's grace: 5000 ms)")


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
