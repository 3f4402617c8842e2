"""What one parse of a DAG file costs Airflow's dag-processor: an agent DAG against a BashOperator DAG.

The dag-processor is a long-lived parent that forks a child for every parse of a file. Before
forking it pre-imports the file's ``airflow.*`` imports (``_pre_import_airflow_modules``, Airflow
3.3's ``airflow/dag_processing/processor.py``), so those are paid once; everything else the file
imports (``cancellable_agents``, and through it pydantic-ai) is imported again in every child.
This benchmark runs that machinery itself, not a copy of it: for each DAG file of
``benchmarks/parse_dags/`` a fresh worker interpreter becomes the parent (the imports of
``airflow dag-processor``, the providers' configuration its CLI loads, the manager's
``_AIRFLOW_PROCESS_CONTEXT`` and ``gc.freeze()``) and starts ``DagFileProcessorProcess.start``
``--reps`` times (after one unmeasured warm-up), serviced as the manager does until the child is
gone. ``start`` runs the pre-import and forks; the child runs the processor's own entrypoint
(stability check, ``BundleDagBag``, serialization, the result sent back) in Airflow's fork wrapper.

**CPU per parse** is the child's user+sys time, from ``getrusage(RUSAGE_CHILDREN)`` before ``start``
and after the child is reaped (one child at a time, so the difference is that child's). That is
everything the kernel charged the child, fork to exit: copy-on-write faults, the imports, the parse,
the serialization and the exit; ``time.process_time`` inside the child would miss the fork's and
exit's share, and wall time on a busy 2-core machine measures the other load. A parse counts only
if the child exited 0, with no import error, and its result holds the file's DAG; otherwise the
row prints the error instead of a time. The child also reports, over a pipe, how many modules it
imported beyond its parent's and which of ``WATCHED`` are in its ``sys.modules`` (imported by the
child, or inherited from the parent).

common.ai's row runs under ``.venv-common-ai/bin/python`` (common.ai registers ``@task.agent`` and
``@task.llm`` too, so it has a venv of its own; built with ``make .venv-common-ai/.installed`` if its
stamp is missing); every other row under this interpreter. Each worker gets a throwaway
``AIRFLOW_HOME`` (``tests/airflow_env.py``); parsing needs no metadata database.

``make bench-parse`` = ``.venv/bin/python -m benchmarks.parse_cost [--reps 7] [--only FILE ...]``:
prints a markdown table; about a minute on 2 cores. Not part of CI. ``src/`` is compiled first, as
a provider installed from a wheel is.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DAGS = Path(__file__).resolve().with_name("parse_dags")
COMMON_AI_VENV = REPO / ".venv-common-ai"
#: Top-level packages whose presence in the child's ``sys.modules`` is reported.
WATCHED = ("pydantic_ai", "httpx", "openai", "anthropic", "opentelemetry", "psutil")


@dataclass(frozen=True)
class Row:
    """One DAG file of ``parse_dags/`` and the DAG it must produce."""

    label: str
    file: str
    dag_id: str
    common_ai: bool = False


ROWS = (
    Row("BashOperator", "bash_operator.py", "parse_cost_bash"),
    Row("ours: AgentOperator + SandboxToolset", "agent_operator.py", "parse_cost_agent"),
    Row("ours: LLMOperator", "llm_operator.py", "parse_cost_llm"),
    Row("TaskFlow: two plain @task", "taskflow.py", "parse_cost_taskflow"),
    Row("ours: @task.agent + @task.llm", "task_decorators.py", "parse_cost_decorators"),
    Row("common.ai: AgentOperator", "common_ai_agent.py", "parse_cost_common_ai_agent", common_ai=True),
)


def _report_to_parent(report_fd: int, parent_modules: frozenset[str]) -> None:
    """The parse child's target: the dag-processor's own entrypoint, then what the child imported
    beyond its parent, written to ``report_fd`` (even when the entrypoint raised)."""
    from airflow.dag_processing.processor import _parse_file_entrypoint

    try:
        _parse_file_entrypoint()
    finally:
        new = set(sys.modules) - parent_modules
        watched = {name: "child" if name in new else "parent" for name in WATCHED if name in sys.modules}
        os.write(report_fd, json.dumps({"new_modules": len(new), "watched": watched}).encode())


def measure(file: Path, dag_id: str, reps: int) -> dict[str, Any]:
    """Be the dag-processor's parent for ``file``: one warm-up parse, then ``reps`` measured ones.

    Returns ``{"cpu_s": [...], "new_modules": [...], "watched": {...}}``, or ``{"error": ...}`` for
    the first parse that did not produce ``dag_id`` cleanly.
    """
    import gc
    import selectors

    import airflow.cli.commands.dag_processor_command  # noqa: F401  (what `airflow dag-processor` imports)
    import structlog
    from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI
    from airflow.dag_processing.processor import DagFileProcessorProcess
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk.api.client import Client
    from airflow.sdk.log import logging_processors
    from uuid6 import uuid7

    # As the CLI (@providers_configuration_loaded) and DagFileProcessorManager set the parent up.
    ProvidersManager().initialize_providers_configuration()
    os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
    client = Client(base_url=None, token="", dry_run=True, transport=InProcessExecutionAPI().transport)
    client.base_url = "http://in-process.invalid./"
    log_file = open(os.devnull, "ab")  # noqa: SIM115  (the manager's per-file log; kept open, as there)
    logger = structlog.wrap_logger(
        structlog.BytesLogger(log_file),
        processors=logging_processors(json_output=True),
        logger_name="processor",
    ).bind()
    gc.freeze()

    def parse_once() -> dict[str, Any]:
        read_fd, write_fd = os.pipe()
        target = functools.partial(_report_to_parent, write_fd, frozenset(sys.modules))
        selector = selectors.DefaultSelector()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = DagFileProcessorProcess.start(
            id=uuid7(),
            path=file,
            bundle_path=file.parent,
            bundle_name="parse-cost",
            dag_file_rel_path=file.name,
            callbacks=[],
            selector=selector,
            logger=logger,
            logger_filehandle=log_file,
            client=client,
            target=target,
        )
        os.close(write_fd)
        while not proc.is_ready:
            proc._service_subprocess(max_wait_time=1.0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        selector.close()
        with os.fdopen(read_fd, "rb") as pipe:
            report: dict[str, Any] = json.loads(pipe.read() or b"{}")
        result = proc.parsing_result
        error = None
        if proc._exit_code != 0:
            error = f"the parse child exited {proc._exit_code}"
        elif result is None:
            error = "the parse child sent no result"
        elif result.import_errors:
            error = "import error: " + next(iter(result.import_errors.values())).strip().splitlines()[-1]
        elif dag_id not in {dag.dag_id for dag in result.serialized_dags}:
            error = f"no DAG {dag_id!r} in the result"
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return {**report, "cpu_s": cpu, "error": error}

    parses = []
    for _ in range(reps + 1):
        parses.append(parse_once())
        if parses[-1]["error"]:
            return {"error": parses[-1]["error"]}
    measured = parses[1:]
    return {
        "cpu_s": [p["cpu_s"] for p in measured],
        "new_modules": [p["new_modules"] for p in measured],
        "watched": measured[-1]["watched"],
    }


def _common_ai_python() -> tuple[str | None, str]:
    """The common.ai venv's interpreter (built with the Makefile's recipe if its stamp is missing),
    or ``None`` and why not."""
    if not (COMMON_AI_VENV / ".installed").exists():
        print("building .venv-common-ai (make .venv-common-ai/.installed) ...", file=sys.stderr)
        try:
            built = subprocess.run(
                ["make", "--no-print-directory", ".venv-common-ai/.installed"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"could not build .venv-common-ai: {e}"
        if built.returncode != 0:
            last = (built.stderr or built.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"make .venv-common-ai/.installed failed: {last[0]}"
    return str(COMMON_AI_VENV / "bin" / "python"), ""


def _run_worker(python: str, row: Row, reps: int, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """``measure`` for ``row`` in a fresh ``python`` (its output goes to a log in ``tmp``)."""
    out, log = tmp / f"{row.dag_id}.json", tmp / f"{row.dag_id}.log"
    command = [python, "-m", "benchmarks.parse_cost", "--worker", str(DAGS / row.file)]
    command += ["--dag-id", row.dag_id, "--reps", str(reps), "--out", str(out)]
    try:
        with log.open("wb") as sink:
            done = subprocess.run(
                command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=300 + 60 * reps
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"worker failed: {e}"}
    if done.returncode != 0 or not out.exists():
        last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker exited {done.returncode}: {last[0]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]


def table(results: list[tuple[Row, dict[str, Any]]], reps: int) -> str:
    """The markdown table: CPU per parse, ratio to the BashOperator row, what the child imported."""
    base = results[0][1]
    base_median = statistics.median(base["cpu_s"]) if "cpu_s" in base else None
    lines = [
        f"CPU time (user+sys) of the dag-processor's parse child, {reps} parses per file after a "
        "warm-up; * = in the parent's sys.modules already (inherited by fork)",
        "",
        "| DAG file | CPU/parse median | p90 | vs BashOperator | modules the child imported | "
        f"of {', '.join(WATCHED)} in the child |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row, result in results:
        if "error" in result:
            error = str(result["error"]).replace("|", "\\|")
            lines.append(f"| {row.label} | {error} | | | | |")
            continue
        median = statistics.median(result["cpu_s"])
        ratio = f"{median / base_median:.1f}x" if base_median else "n/a"
        watched = ", ".join(n + ("*" if where == "parent" else "") for n, where in result["watched"].items())
        lines.append(
            f"| {row.label} | {median * 1000:.0f} ms | {_p90(result['cpu_s']) * 1000:.0f} ms | {ratio} | "
            f"{statistics.median(result['new_modules']):.0f} | {watched or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=7, help="measured parses per DAG file (default 7)")
    parser.add_argument(
        "--only", nargs="+", metavar="FILE", help="parse only these files of parse_dags/ (default: every row)"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dag-id", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.worker is not None:
        args.out.write_text(json.dumps(measure(args.worker, args.dag_id, args.reps)))
        return

    from tests.airflow_env import airflow_env

    # A provider installed from a wheel has its bytecode (pip compiles at install); this checkout's
    # src/ has none where PYTHONDONTWRITEBYTECODE is set, and compiling it in every parse child
    # would be counted as our parse cost (measured: half of it).
    compileall.compile_dir(REPO / "src", quiet=1)
    results: list[tuple[Row, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="parse-cost-") as tmp:
        env = airflow_env(Path(tmp) / "airflow-home", pythonpath=REPO)
        common_ai_python, why = _common_ai_python()
        for row in ROWS:
            if args.only and row.file not in args.only:
                continue
            python = common_ai_python if row.common_ai else sys.executable
            if python is None:
                results.append((row, {"error": f"unavailable: {why}"}))
                continue
            print(f"parsing {row.file} ({python}) ...", file=sys.stderr)
            results.append((row, _run_worker(python, row, args.reps, env, Path(tmp))))
    print(table(results, args.reps))


if __name__ == "__main__":
    main()
