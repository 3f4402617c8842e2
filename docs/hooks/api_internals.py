"""MkDocs hook: each API page also renders the private (``_name.py``) modules of its room.

The package's public modules render through ``::: cancellable_agents.room`` (whose filter hides
``_``-names); this hook appends one ``:::`` block per private module below that room, under an
"Internals" heading, so docstrings may cross-reference internals and a new private module is
documented without editing the page. Private means "may change in any release", not "undocumented".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SRC = Path(__file__).resolve().parents[2] / "src"
_ROOM = re.compile(r"^::: (cancellable_agents(?:\.\w+)*)\s*$", re.MULTILINE)


def _private_modules(dotted: str) -> list[str]:
    """The private modules at or below the package ``dotted``, in path order."""
    folder = _SRC.joinpath(*dotted.split("."))
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.rglob("_*.py")):
        if path.name == "__init__.py" or path.stem.startswith("__"):
            continue
        parts = path.relative_to(_SRC).with_suffix("").parts
        found.append(".".join(parts))
    return found


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    rooms = _ROOM.findall(markdown)
    blocks = []
    for room in rooms:
        for module in _private_modules(room):
            blocks.append(f"::: {module}\n    options:\n      heading_level: 3\n")
    if not blocks:
        return markdown
    heading = (
        "\n\n## Internals\n\nPrivate modules (`_name.py`): documented for contributors, "
        "not part of the public API; they may change in any release.\n\n"
    )
    return markdown + heading + "\n".join(blocks)
