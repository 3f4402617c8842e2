"""A throwaway Airflow for tests and benchmarks: the environment that gives child processes their
own ``AIRFLOW_HOME`` (no example DAGs, not in unit-test mode, INFO logs), and ``airflow db migrate``
into it. The benchmarks import this module; it imports nothing from them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

#: ``airflow`` run by this interpreter.
AIRFLOW = (sys.executable, "-m", "airflow")


def airflow_env(
    home: Path,
    overrides: Mapping[str, str] | None = None,
    *,
    dags_folder: Path | None = None,
    pythonpath: Path | None = None,
) -> dict[str, str]:
    """This process's environment plus an Airflow in ``home``, then ``overrides`` (which win).

    :param dags_folder: ``[core] dags_folder``; Airflow's default (``home/dags``) if not given.
    :param pythonpath: put in front of the inherited ``PYTHONPATH`` (the repository root, so a
        child can import ``tests`` and ``benchmarks``).
    """
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }
    if dags_folder is not None:
        env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags_folder)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
    return {**env, **(overrides or {})}


def migrate(env: dict[str, str], *, log: Path | None = None, timeout: float | None = 240) -> None:
    """``airflow db migrate`` with ``env`` (idempotent); a failure raises :class:`RuntimeError`
    with the output's last lines. The output goes to ``log`` if given, else is kept in memory."""
    command = [*AIRFLOW, "db", "migrate"]
    if log is None:
        done = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False
        )
        output = done.stdout.decode(errors="replace")
    else:
        with log.open("wb") as out:
            done = subprocess.run(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        output = log.read_text(errors="replace")
    if done.returncode != 0:
        last = "\n".join(output.splitlines()[-80:])
        raise RuntimeError(f"airflow db migrate failed ({done.returncode}):\n{last}")
