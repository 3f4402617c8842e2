"""Start a scenario task process (``dags/task_scenarios.py``) on the one task-process harness,
:class:`tests.taskproc.TaskChild`: events, signals, the log's tail."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.taskproc import TaskChild

if TYPE_CHECKING:
    from tests.process.zygote import ScenarioZygote

DAGS_FOLDER = Path(__file__).with_name("dags")
SCENARIOS = DAGS_FOLDER / "task_scenarios.py"


class TaskProcess(TaskChild):
    """A child running ``script SCENARIO`` (``task_scenarios.py`` by default) under ``dag.test()``.

    With ``zygote`` the child is forked from that fork server (``tests/process/zygote.py``), which
    imported what the script imports, instead of started cold: the same script, signals and
    ``dag.test()``, seconds sooner.
    """

    def __init__(
        self,
        scenario: str,
        env: dict[str, str],
        log_dir: Path,
        script: Path = SCENARIOS,
        zygote: ScenarioZygote | None = None,
    ) -> None:
        self._zygote = zygote
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

    def _start(self, argv: list[str], env: dict[str, str], events_env: str, write_fd: int) -> Any:
        if self._zygote is None:
            return super()._start(argv, env, events_env, write_fd)
        return self._zygote.start(argv, env, self._log.fileno(), events=(events_env, write_fd))
