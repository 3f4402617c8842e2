"""What the Makefile's CI lanes assume about the tests they split.

The supported floor (Airflow 3.1, pydantic-ai 2.58) skips ``VERSION_FREE_PROCESS``: tests whose
code imports neither Airflow nor pydantic-ai run there exactly as on 3.3. That holds only while
their imports say so, so it is checked here, in a fresh interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make_list(name: str) -> list[str]:
    """The words of the Makefile variable ``name`` (``:=``, continued lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name}\s*:=(.*)$", text, re.MULTILINE)
    assert match, f"no {name} in the Makefile"
    return match.group(1).split()


def test_version_free_process_tests_import_neither_airflow_nor_pydantic_ai() -> None:
    paths = _make_list("VERSION_FREE_PROCESS")
    assert paths and all((ROOT / p).is_file() for p in paths), paths
    modules = [p.removesuffix(".py").replace("/", ".") for p in paths]
    probe = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'airflow', 'pydantic_ai'})))"
    )
    child = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    imported = json.loads(child.stdout.strip().splitlines()[-1])
    assert imported == [], "these tests need the floor: take them out of VERSION_FREE_PROCESS"
