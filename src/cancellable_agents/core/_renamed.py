"""Old import paths of renamed public modules: they still import, with one warning that names
the new path and the version that removes the old one.

No module is left behind at an old path (a file there would be a second name for one idea, and
would show in every listing of the package). Instead the package root registers the renames
with [`renamed_modules`][], and a finder at the end of ``sys.meta_path`` answers only for
those names, after every real module was looked for: the old name is a module that hands out the
new module's objects (the same objects), imported once, so the warning comes once per process.
The versioning and deprecation policy is in ``docs/content/versioning.md``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

from cancellable_agents.core.exceptions import CancellableAgentsDeprecationWarning

__all__ = ["renamed_modules"]


class _RenamedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old module name as an alias of its new module (and nothing else)."""

    def __init__(self) -> None:
        self.renames: dict[str, tuple[str, str]] = {}  # old name -> (new name, removed in)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        return ModuleSpec(fullname, self) if fullname in self.renames else None

    def create_module(self, spec: ModuleSpec) -> None:
        """The default: a new, empty module at the old name (the new module's own ``__spec__``
        must stay its own, which returning it here would overwrite)."""

    def exec_module(self, module: ModuleType) -> None:
        new, removed_in = self.renames[module.__name__]
        # stacklevel 2 is the importer's line: warnings skips the import system's own frames.
        warnings.warn(
            f"{module.__name__} was renamed {new}; import it from there (the old path goes away"
            f" in {removed_in})",
            CancellableAgentsDeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(new)
        module.__getattr__ = functools.partial(getattr, target)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        module.__doc__ = target.__doc__


_FINDER = _RenamedModuleFinder()


def renamed_modules(renames: Mapping[str, str], removed_in: str) -> None:
    """Let each old dotted name in ``renames`` import its new module until ``removed_in``."""
    _FINDER.renames.update({old: (new, removed_in) for old, new in renames.items()})
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
