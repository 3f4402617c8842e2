"""``tests/README.md`` tells the truth about where each module is tested: every module of the
package has a test file of its name or a row in the README's table, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_layers import ROOT, modules

TESTS = Path(__file__).resolve().parents[1]
README = TESTS / "README.md"


def named_test_files(tests: Path) -> set[str]:
    """The test files a module can be named by: ``test_*.py`` under ``unit/`` and ``process/``."""
    return {path.stem for folder in ("unit", "process") for path in (tests / folder).glob("test_*.py")}


def has_a_file_of_its_name(relative: Path, names: set[str]) -> bool:
    """``test_<name>.py``, or ``test_<package>_<name>.py`` for a package the module is in (a private
    module's leading underscore is not part of its name here: ``_journal.py`` -> ``test_journal.py``)."""
    stem = relative.stem.lstrip("_")
    return bool({f"test_{stem}", *(f"test_{package}_{stem}" for package in relative.parts[:-1])} & names)


def table_rows(readme: str) -> dict[str, list[str]]:
    """The README's "where each module is tested" table: module path -> the test files it names."""
    section = readme.split("## Where each module is tested", 1)[1]
    rows = re.findall(r"^\| `([\w/]+\.py)` \| (.+) \|$", section, flags=re.MULTILINE)
    return {module: re.findall(r"`((?:unit|process)/test_\w+\.py)`", tested_in) for module, tested_in in rows}


def unplaced(root: Path, tests: Path, readme: str) -> list[str]:
    """Modules with neither a test file of their name nor a row in the table."""
    names, rows = named_test_files(tests), table_rows(readme)
    relatives = (path.relative_to(root) for path in modules(root).values() if path.name != "__init__.py")
    return [
        relative.as_posix()
        for relative in relatives
        if not has_a_file_of_its_name(relative, names) and relative.as_posix() not in rows
    ]


def test_every_module_is_placed() -> None:
    missing = unplaced(ROOT, TESTS, README.read_text())
    assert missing == [], f"give each a row in tests/README.md's 'Where each module is tested': {missing}"


def test_every_file_the_table_names_exists() -> None:
    rows = table_rows(README.read_text())
    assert rows, "the table was not found"
    assert [f for files in rows.values() for f in files if not (TESTS / f).exists()] == []
    assert [m for m in rows if not (ROOT / m).exists()] == []


def test_a_module_without_a_file_or_a_row_is_found(tmp_path: Path) -> None:
    root = tmp_path / "cancellable_agents"
    (root / "core").mkdir(parents=True)
    for name in ("__init__.py", "core/__init__.py", "core/scope.py", "core/_once.py", "core/_lazy.py"):
        (root / name).touch()
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_scope.py").touch()
    readme = "## Where each module is tested\n\n| module | tested in |\n|---|---|\n| `core/_once.py` | x |\n"
    assert unplaced(root, tmp_path, readme) == ["core/_lazy.py"]
