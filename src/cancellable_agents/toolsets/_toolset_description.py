"""What a DAG file builds at parse time: a light description of a toolset, made into the
pydantic-ai toolset when the task runs.

The dag-processor parses every DAG file again and again, and imports again in every parse what is
not under ``airflow.``: a pydantic-ai toolset built at a DAG file's top level cost ~1.3 s of CPU
per parse. A [`ToolsetDescription`][] holds only its arguments;
[`build`][cancellable_agents.toolsets._toolset_description.ToolsetDescription.build] makes its toolset once,
importing pydantic-ai then. The operators build the descriptions they are given in ``execute`` ([`built`][]).
A description handed straight to a pydantic-ai
``Agent(toolsets=[...])`` works as well: it is a ``ToolsetFunc`` (called with the run's context,
it returns its toolset). Any attribute a description does not have is its toolset's, so code that
uses the toolset at run time (``toolset.sandbox``, ``toolset.run_shell(...)``) reads as before.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from typing import Any, ClassVar


class ToolsetDescription:
    """The arguments of a toolset, and the toolset they make once it is needed.

    Subclasses name the toolset's class (`toolset_class`, ``"module:Class"``, imported on
    [`build`][]) and take its constructor's arguments.
    """

    #: ``"module:Class"`` of the pydantic-ai toolset this describes.
    toolset_class: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        self._kwargs = kwargs
        self._toolset: Any = None
        self._lock = threading.Lock()

    def build(self) -> Any:
        """The toolset (made on the first call, with pydantic-ai imported then; the same after)."""
        with self._lock:
            if self._toolset is None:
                module, _, name = self.toolset_class.partition(":")
                cls = getattr(__import__(module, fromlist=[name]), name)
                self._toolset = cls(*self._args, **self._kwargs)
            return self._toolset

    def __call__(self, ctx: Any = None) -> Any:
        """pydantic-ai's ``ToolsetFunc``: a description passed to ``Agent(toolsets=[...])``."""
        return self.build()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never for our own fields (during copy and unpickling they are unset)
            raise AttributeError(name)
        return getattr(self.build(), name)

    def __deepcopy__(self, memo: dict[int, Any]) -> ToolsetDescription:
        """Airflow copies operators for each try: copy the arguments, never a built toolset."""
        return type(self)(*copy.deepcopy(self._args, memo), **copy.deepcopy(self._kwargs, memo))

    def __repr__(self) -> str:
        arguments = [repr(a) for a in self._args] + [f"{k}={v!r}" for k, v in self._kwargs.items()]
        return f"{type(self).__name__}({', '.join(arguments)})"


def built(toolsets: Iterable[Any]) -> list[Any]:
    """``toolsets`` with every description made into its toolset (the others as they are)."""
    return [t.build() if isinstance(t, ToolsetDescription) else t for t in toolsets]
