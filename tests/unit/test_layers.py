"""The package's layers and module map, as ``docs/content/architecture.md`` draws them ("Layers",
"What the layer test enforces", "Module map"), checked from the source (AST, no import).

Lowest first; a module imports only its own layer and those below it, lazy imports (inside a
function) included, because a lazy import is still an arrow: it only hides it from the reader.
``if TYPE_CHECKING:`` imports count for the layers (they are still knowledge of the other
room) but not for cycles (they never run). Nothing below ``airflow/`` imports Airflow.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "cancellable_agents"
ROOT = Path(__file__).resolve().parents[2] / "src" / PACKAGE
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "content" / "architecture.md"

#: The first part of a module's name under the package -> its layer. Leaf modules that import
#: nothing of the package (the provider-info entry point) sit at 0; the test kit (``testing``:
#: the scripted model server, the sandbox conformance suite, which drives ``toolsets``) sits
#: above what it tests, beside ``demo``, which uses it.
LAYERS = {
    "core": 0,
    "get_provider_info": 0,
    "procs": 1,
    "durable": 2,
    "run": 3,
    "toolsets": 4,
    "airflow": 5,
    "common_ai": 6,
    "operators": 6,
    "decorators": 6,
    "hooks": 6,
    "demo_dags": 7,
    "demo": 7,
    "testing": 7,
    "__init__": 8,  # the package root exports names lazily, by string
}
#: Below this layer no module may import Airflow.
AIRFLOW_LAYER = LAYERS["airflow"]


@dataclass(frozen=True)
class Arrow:
    """One import: ``source`` imports ``target`` (a module of the package, or ``airflow...``)."""

    source: str
    target: str
    line: int
    runtime: bool  # False inside ``if TYPE_CHECKING:``


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def arrows(root: Path) -> Iterator[Arrow]:
    known = modules(root)
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, runtime in _imports(tree):
            for target in _targets(node, name, is_package, known):
                yield Arrow(name, target, node.lineno, runtime)


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, anywhere (functions included), and whether it runs."""

    def walk(node: ast.AST, runtime: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, runtime
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), runtime)
            else:
                yield from walk(child, runtime)

    yield from walk(tree, True)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(
    node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [_interesting(alias.name, known) for alias in node.names if _interesting(alias.name, known)]
    base = node.module or ""
    if node.level:
        anchor = source.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = _interesting(submodule if submodule in known else base, known)
        if target:
            found.append(target)
    return found


def _interesting(module: str, known: dict[str, Path]) -> str:
    """The package module (its nearest known parent) or ``airflow``, else ``""``."""
    if module == "airflow" or module.startswith("airflow."):
        return module
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module if module.startswith(PACKAGE + ".") or module == PACKAGE else ""


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def violations(root: Path) -> list[str]:
    """What breaks the layers, one line each (empty when the layout holds)."""
    found = []
    for arrow in arrows(root):
        where = f"{arrow.source}:{arrow.line}"
        if not arrow.target.startswith(PACKAGE):
            if layer_of(arrow.source) < AIRFLOW_LAYER:
                found.append(f"{where} imports Airflow ({arrow.target}) below airflow/")
            continue
        if layer_of(arrow.target) > layer_of(arrow.source):
            found.append(f"{where} imports {arrow.target}, a layer above it")
    found.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(root))
    return found


def cycles(root: Path) -> list[list[str]]:
    """Groups of package modules that import each other at run time (Tarjan's SCC)."""
    graph: dict[str, set[str]] = {}
    for arrow in arrows(root):
        if arrow.runtime and arrow.target.startswith(PACKAGE) and arrow.target != arrow.source:
            graph.setdefault(arrow.source, set()).add(arrow.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def shared_file_names(root: Path) -> dict[str, list[str]]:
    """File names more than one module under ``root`` has (``__init__.py`` aside), with those
    modules: one name, one idea, so a name read in a traceback or an import says which room."""
    by_name: dict[str, list[str]] = {}
    for name, path in modules(root).items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(name)
    return {file_name: names for file_name, names in by_name.items() if len(names) > 1}


def test_the_package_keeps_its_layers() -> None:
    assert violations(ROOT) == []


def test_no_two_modules_share_a_file_name() -> None:
    assert shared_file_names(ROOT) == {}


def unmapped(root: Path, document: str) -> list[str]:
    """Modules under ``root`` whose path (``core/scope.py``) the document never names (``__init__.py``
    aside: a package is named by its modules)."""
    paths = (path.relative_to(root).as_posix() for path in modules(root).values())
    return [path for path in paths if not path.endswith("__init__.py") and f"`{path}`" not in document]


def test_the_architecture_document_maps_every_module() -> None:
    missing = unmapped(ROOT, ARCHITECTURE.read_text())
    assert missing == [], f"name each in docs/content/architecture.md's module map: {missing}"


def test_the_map_check_finds_a_module_the_document_leaves_out(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"core/scope.py": "", "core/unwind.py": ""})
    assert unmapped(root, "- `core/scope.py`: the scope") == ["core/unwind.py"]


#: Packages whose every module is public: the test kit a user runs and the demo's DAGs folder.
PUBLIC_PACKAGES = ("testing", "demo_dags")


def public_declarations(repository: Path) -> str:
    """What declares an import path public: the user docs (the API summary included, the
    architecture map and the changelog not: they name internals too), the README, the packaging."""
    content = repository / "docs" / "content"
    pages = [page for page in content.glob("*.md") if page.name not in {"architecture.md", "changelog.md"}]
    others = [content / "api" / "index.md", repository / "README.md", repository / "provider.yaml"]
    return "\n".join(path.read_text() for path in [*pages, *others, repository / "pyproject.toml"])


def unmarked_internals(root: Path, declarations: str) -> list[str]:
    """Modules without a leading ``_`` whose import path nothing public names (mark them ``_name.py``)."""
    found = []
    for name, path in modules(root).items():
        parts = name.split(".")
        if path.name == "__init__.py" or path.stem.startswith("_") or parts[1] in PUBLIC_PACKAGES:
            continue
        if not re.search(rf"{re.escape(name)}(?![\w])", declarations):
            found.append(path.relative_to(root).as_posix())
    return found


def test_every_unmarked_module_is_public() -> None:
    missing = unmarked_internals(ROOT, public_declarations(ROOT.parents[1]))
    assert missing == [], f"internal modules are named _name.py; or document the import path: {missing}"


def test_the_marking_check_finds_an_undocumented_public_module(tmp_path: Path) -> None:
    files = {"core/scope.py": "", "core/shield.py": "", "core/_once.py": "", "testing/jobs.py": ""}
    root = _tree(tmp_path, files)
    assert unmarked_internals(root, "from cancellable_agents.core.scope import x") == ["core/shield.py"]


def test_every_room_has_a_layer() -> None:
    rooms = {name.split(".")[1] for name in modules(ROOT) if "." in name}
    missing = sorted(rooms - set(LAYERS))
    assert not missing, f"give {missing} a layer in LAYERS (and in docs/content/architecture.md)"


# -- the checker catches what it must (each arrow below was once in the code) ----------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for relative, source in {"__init__.py": "", **files}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(source)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"durable/_stores.py": "def _path(v):\n    from airflow.sdk import ObjectStoragePath\n"},
            "cancellable_agents.durable._stores:2 imports Airflow (airflow.sdk) below airflow/",
            id="lazy-airflow-import-in-durable",
        ),
        pytest.param(
            {
                "durable/_journal.py": (
                    "def has_sandbox(t):\n    from cancellable_agents.toolsets.sandbox import X\n"
                ),
                "toolsets/sandbox/__init__.py": "X = 1\n",
            },
            "cancellable_agents.durable._journal:2 imports cancellable_agents.toolsets.sandbox,"
            " a layer above it",
            id="durable-reaches-up-to-toolsets",
        ),
        pytest.param(
            {
                "airflow/mixin.py": (
                    "def wrap():\n    from cancellable_agents.airflow.retry import wrap_retry_policy\n"
                ),
                "airflow/retry.py": "from cancellable_agents.airflow.mixin import cancellation_of\n",
            },
            "import cycle: cancellable_agents.airflow.mixin -> cancellable_agents.airflow.retry",
            id="mixin-retry-cycle-held-by-a-lazy-import",
        ),
        pytest.param(
            {
                "core/scope.py": "from . import unwind\n",
                "core/unwind.py": "from .scope import TaskCancellation\n",
            },
            "import cycle: cancellable_agents.core.scope -> cancellable_agents.core.unwind",
            id="relative-imports-count",
        ),
    ],
)
def test_the_checker_catches(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    assert violations(_tree(tmp_path, files)) == [expected]


def test_the_checker_catches_a_shared_file_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"core/record.py": "", "durable/record.py": "", "durable/__init__.py": ""})
    assert shared_file_names(root) == {
        "record.py": ["cancellable_agents.core.record", "cancellable_agents.durable.record"]
    }


def test_type_checking_imports_are_no_cycle_but_still_respect_layers(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "core/scope.py": "from cancellable_agents.core.unwind import Phase\n",
            "core/unwind.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from cancellable_agents.core.scope import TaskCancellation\n"
                "    from cancellable_agents.run.runner import RunTracker\n"
            ),
            "run/runner.py": "RunTracker = 1\n",
        },
    )
    assert violations(root) == [
        "cancellable_agents.core.unwind:4 imports cancellable_agents.run.runner, a layer above it"
    ]
