"""A package's exports, loaded on first use (PEP 562), for packages a DAG file imports.

The dag-processor imports a DAG file's imports again in every parse (``docs/content/architecture.md``,
"Import cost"): a package
that imported its heavy parts eagerly would make every DAG file that names it pay for them. A
package lists ``name -> module`` and gets the module ``__getattr__`` and ``__dir__`` that import
the module when the name is first used (then the name is bound, so later uses cost nothing).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, loading each of ``exports`` on first use."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
