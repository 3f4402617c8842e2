"""Renamed public modules: the old path imports the same objects with one warning naming the new
path and the version that removes it, and no module file is left at the old path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cancellable_agents
from cancellable_agents.core.exceptions import CancellableAgentsDeprecationWarning

SRC = Path(cancellable_agents.__file__).parent
OLD_PATHS = sorted(cancellable_agents._RENAMED_MODULES)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_is_no_file(old: str) -> None:
    relative = Path(*old.split(".")[1:])
    assert not (SRC / relative).exists() and not (SRC / relative.with_suffix(".py")).exists()


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_warns_once_and_gives_the_new_modules_objects(old: str) -> None:
    new = cancellable_agents._RENAMED_MODULES[old]
    # A fresh interpreter: the warning is per process, and this one may have imported it already.
    script = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        f"    import {old}\n"
        f"    import {old}\n"
        f"old, new = sys.modules[{old!r}], importlib.import_module({new!r})\n"
        "public = [n for n in vars(new) if not n.startswith('_')]\n"
        "assert public and all(getattr(old, n) is getattr(new, n) for n in public)\n"
        "for w in caught:\n"
        "    print(w.category.__name__, w.filename == '<string>', w.message)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        f"CancellableAgentsDeprecationWarning True {old} was renamed {new}; import it from there"
        " (the old path goes away in 0.3.0)"
    ]


def test_the_deprecation_policy_lists_each_renamed_path() -> None:
    policy = (SRC.parents[1] / "docs" / "content" / "versioning.md").read_text()
    for old, new in cancellable_agents._RENAMED_MODULES.items():
        assert f"| `{old}` | `{new}` | 0.2.0 | 0.3.0 |" in policy


def test_the_warning_is_a_deprecation_warning() -> None:
    assert issubclass(CancellableAgentsDeprecationWarning, DeprecationWarning)


def test_a_name_never_renamed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        __import__("cancellable_agents.core.no_such_module")
