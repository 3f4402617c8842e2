"""The provider's exceptions. They live in the package (not in DAG files) so that a
``RetryRule("cancellable_agents.TaskCancelled")`` can import them on any worker.

- [`TaskCancelled`][]: a cancelled run (a kill, a timeout, a stopped parent). Not an error of
  the provider's: retry rules match it by name, and it is no [`CancellableAgentsError`][], so
  code catching the provider's errors never swallows a kill. Built by
  [`TaskCancellation.cancelled_error`][], the one place that knows how long to wait for the
  cause and what the record holds.
- [`CancellableAgentsError`][]: the base of everything else the provider raises: a
  configuration that cannot work ([`ConfigurationError`][]), a sandbox that cannot be had or
  used (``SandboxError`` and its kinds), an approval that cannot be waited for.
- [`CancellableAgentsDeprecationWarning`][]: a public name used through the name that a later
  version removes (the policy: ``docs/content/versioning.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cancellable_agents.core.causes import CancelCause, UserAction
from cancellable_agents.core.timeline import KillRecord, TimelineEvent

if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage
    from pydantic_ai.usage import RunUsage

__all__ = [
    "CancellableAgentsDeprecationWarning",
    "CancellableAgentsError",
    "ConfigurationError",
    "TaskCancelled",
]


class TaskCancelled(Exception):
    """The task's run was cancelled (killed, timed out, or its parent stopped).

    Carries everything a DAG author needs after the fact: the decided ``cause`` (plus the
    ``root_cause`` for sub-agents, and ``action`` for a user's stop), the partial transcript,
    the usage spent, the timeline of the unwind, and what was killed.
    """

    def __init__(
        self,
        message: str,
        *,
        cause: CancelCause = CancelCause.UNKNOWN,
        root_cause: CancelCause | None = None,
        detail: str = "",
        action: UserAction | None = None,
        messages: Sequence[ModelMessage] = (),
        usage: RunUsage | None = None,
        timeline: Sequence[TimelineEvent] = (),
        killed: Sequence[KillRecord] = (),
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.root_cause = root_cause or cause
        self.detail = detail
        self.action = action
        self.messages = list(messages)
        self.usage = usage
        self.timeline = list(timeline)
        self.killed = list(killed)

    def all_messages(self) -> list[ModelMessage]:
        """The partial transcript, ready to pass as ``message_history`` to resume."""
        return list(self.messages)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (str(self),), self.__dict__


class CancellableAgentsError(Exception):
    """Base of the provider's errors (every one but [`TaskCancelled`][])."""


class ConfigurationError(CancellableAgentsError, ValueError):
    """A DAG author's configuration cannot work (bad model id, unknown connection, bad budget).

    The message names the fix.
    """


class CancellableAgentsDeprecationWarning(DeprecationWarning):
    """Something of this provider is used through a name that goes away in a later version."""
