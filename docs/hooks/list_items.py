"""MkDocs hook: a list item that rendered as text fails the strict build.

Python-Markdown ends a list item at a block indented less than four spaces (a table, a fenced
code block, a second paragraph), and the items after it then render as a paragraph of lines
starting with ``- ``. Nothing else catches it: the page builds, and reads as a wall of dashes.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("mkdocs.plugins.list_items")
_LITERAL_ITEM = re.compile(r"^- (?:<(?:strong|em|code)>|[A-Za-z*`])", re.MULTILINE)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Warn (strict: fail) for each line of ``html`` that is a list item left as text."""
    outside_code = re.sub(r"<pre\b.*?</pre>", "", html, flags=re.DOTALL)
    for match in _LITERAL_ITEM.finditer(outside_code):
        line = outside_code[match.start() :].split("\n", 1)[0]
        log.warning(
            f"{page.file.src_path}: a list item rendered as text ({line[:60]!r}): indent the "
            f"blocks inside the item before it by four spaces and leave a blank line before it"
        )
    return html
