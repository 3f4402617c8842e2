"""The documentation builds with warnings as errors, and what it shows DAG authors is real.

``mkdocs build --strict`` fails on broken links, missing anchors and pages left out of the nav;
with mkdocstrings it also fails on a docstring's cross-reference to nothing (the API reference);
the other tests catch what MkDocs cannot: Python snippets that do not parse, README links to
pages that do not exist, and public names the API summary forgets.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cancellable_agents

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = DOCS / "content"
README = ROOT / "README.md"

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_docs_build_strict(tmp_path: Path) -> None:
    """The site builds offline with MkDocs' strict mode (every warning is an error)."""
    site = tmp_path / "site"
    command = ["mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"), "-d", str(site)]
    proc = subprocess.run(
        [sys.executable, "-m", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    built = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in ("index.html", "kill-paths/index.html", "retries/index.html", "sandbox/index.html"):
        assert page in built, f"{page} missing from the built site: {sorted(built)}"
    # The API reference is rendered from the docstrings, not an empty page.
    api = (site / "api" / "core" / "index.html").read_text()
    assert 'id="cancellable_agents.core.scope.TaskCancellation"' in api


def _markdown_files() -> list[Path]:
    return [README, *sorted(PAGES.glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_python_snippets_parse(path: Path) -> None:
    """Every ```python block a DAG author may copy is valid Python."""
    text = path.read_text()
    for number, block in enumerate(_PYTHON_BLOCK.findall(text), start=1):
        try:
            ast.parse(block)
        except SyntaxError as exc:
            pytest.fail(f"{path.name}: python block {number} does not parse: {exc}\n{block}")


def test_readme_links_exist() -> None:
    """The README's relative links (into docs/ and example_dags/) point at files that exist."""
    targets = [t for t in _MD_LINK.findall(README.read_text()) if "://" not in t]
    assert targets, "the README should link into the docs"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_api_reference_links_every_public_name() -> None:
    """The API reference's first page links each name ``cancellable_agents`` exports to its
    rendered docstring (the strict build checks that each link lands)."""
    index = (PAGES / "api" / "index.md").read_text()
    unlinked = [name for name in cancellable_agents.__all__ if f"[`{name}`][" not in index]
    assert not unlinked, f"api/index.md does not link: {unlinked}"


def test_api_summary_names_every_public_name() -> None:
    """Each name exported by ``cancellable_agents`` is described on the API summary page."""
    reference = (PAGES / "reference.md").read_text()
    undocumented = [name for name in cancellable_agents.__all__ if f"`{name}" not in reference]
    assert not undocumented, f"reference.md does not describe: {undocumented}"


def test_a_list_item_rendered_as_text_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The docs hook that fails the strict build on a bullet Python-Markdown left as a paragraph
    line (after a block indented by two spaces inside the item before it); code is not prose."""
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import list_items
    finally:
        sys.path.remove(str(DOCS / "hooks"))

    class Page:
        class file:
            src_path = "page.md"

    broken = "<p>refused.\n- <code>True</code>: the host's network</p>"
    in_code = "<pre><code>- item\n- <em>x</em></code></pre>\n<ul><li>fine</li></ul>"
    with caplog.at_level("WARNING", logger="mkdocs.plugins.list_items"):
        assert list_items.on_page_content(in_code, Page, None, None) == in_code
        assert caplog.records == []
        list_items.on_page_content(broken, Page, None, None)
    [record] = caplog.records
    assert "page.md: a list item rendered as text" in record.getMessage()
