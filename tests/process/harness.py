"""Start a scenario task process (``dags/task_scenarios.py``) on the one task-process harness,
:class:`tests.taskproc.TaskChild`: events, signals, the log's tail."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.taskproc import TaskChild

DAGS_FOLDER = Path(__file__).with_name("dags")
SCENARIOS = DAGS_FOLDER / "task_scenarios.py"


class TaskProcess(TaskChild):
    """A child running ``script SCENARIO`` (``task_scenarios.py`` by default) under ``dag.test()``."""

    def __init__(self, scenario: str, env: dict[str, str], log_dir: Path, script: Path = SCENARIOS) -> None:
        super().__init__(
            [sys.executable, str(script)],
            {
                **env,
                "SCENARIO": scenario,
                # dag.test() parses the script's whole folder: one scenario file per folder.
                "AIRFLOW__CORE__DAGS_FOLDER": str(script.parent),
            },
            log_dir / f"{scenario}.log",
            events_env="SCENARIO_EVENTS_FD",
        )
