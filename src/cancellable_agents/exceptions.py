"""Exceptions a cancelled run raises. They live in the package (not in DAG files) so that a
``RetryRule("cancellable_agents.TaskCancelled")`` can import them on any worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cancellable_agents.causes import CancelCause

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage
    from pydantic_ai.usage import RunUsage

    from cancellable_agents.cancellation import TimelineEvent


class TaskCancelled(Exception):
    """The task's run was cancelled (killed, timed out, or its parent stopped).

    Carries everything a DAG author needs after the fact: the decided ``cause`` (plus the
    ``root_cause`` for sub-agents), the partial transcript, the usage spent, the timeline of
    the unwind, and the processes that were killed.
    """

    def __init__(
        self,
        message: str,
        *,
        cause: CancelCause = CancelCause.UNKNOWN,
        root_cause: CancelCause | None = None,
        detail: str = "",
        messages: Sequence[ModelMessage] = (),
        usage: RunUsage | None = None,
        timeline: Sequence[TimelineEvent] = (),
        killed: Sequence[dict[str, Any]] = (),
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.root_cause = root_cause or cause
        self.detail = detail
        self.messages = list(messages)
        self.usage = usage
        self.timeline = list(timeline)
        self.killed = list(killed)

    def all_messages(self) -> list[ModelMessage]:
        """The partial transcript, ready to pass as ``message_history`` to resume."""
        return list(self.messages)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (str(self),), self.__dict__


class ConfigurationError(ValueError):
    """A DAG author's configuration cannot work (bad model id, unknown connection, bad budget).

    The message names the fix.
    """
