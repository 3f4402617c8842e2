"""common.ai's ``AgentOperator`` and ``LLMOperator`` with this provider's kill semantics.

``apache-airflow-providers-common-ai`` brings durable journals, sandbox backends, human review,
fallback connections and a cross-try usage budget; its own kill handling (a token cancelled from
``on_kill``) loses a kill that lands before the run, lets a killed task succeed, leaves sync tools
and the processes tools started running, and hands a kill to a model-backed retry policy. The
classes here are common.ai's operators with
[`CancellableAgentMixin`][cancellable_agents.airflow.mixin.CancellableAgentMixin] in front: same constructor
arguments, so switching is an import change::

    from cancellable_agents.common_ai import AgentOperator, LLMOperator

Every agent run common.ai makes goes through ``self.run_agent_sync`` (the first run, a durable
retry's replay, a HITL regeneration, the usage-budget tracking around them), and the mixin's
``run_agent_sync`` has the same signature, so each one runs in the task's scope. The one blocking
wait that is not a run, the HITL review poll, waits on the scope instead of ``time.sleep``, so a
kill ends it at once. [`cancellable`][] does the same for any other common.ai operator class.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

try:
    from airflow.providers.common.ai.operators.agent import AgentOperator as _CommonAIAgentOperator
    from airflow.providers.common.ai.operators.llm import LLMOperator as _CommonAILLMOperator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cancellable_agents.common_ai needs apache-airflow-providers-common-ai; install it with "
        "`pip install 'airflow-provider-cancellable-agents[common-ai]'`"
    ) from exc

from cancellable_agents.airflow.mixin import CancellableAgentMixin

__all__ = ["AgentOperator", "LLMOperator", "cancellable"]

_Op = TypeVar("_Op", bound=type)


class _PollingTaskInstance:
    """The task instance as common.ai's HITL poll loop sees it: each XCom poll first waits out the
    poll interval on the task's scope, so a kill ends the wait at once instead of after it.

    The loop itself is told to sleep 0 s between polls; this proxy keeps the real interval.
    Everything but ``xcom_pull`` goes to the real task instance.
    """

    def __init__(self, operator: CancellableAgentMixin, ti: Any, interval: float) -> None:
        self._operator = operator
        self._ti = ti
        self._interval = interval
        self._last_poll: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ti, name)

    def xcom_pull(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._operator.cancellation
        if self._last_poll is not None:
            scope.wait(max(0.0, self._last_poll + self._interval - time.monotonic()))
        if scope.cancelled:
            raise self._operator.cancelled_error("killed while waiting for human review")
        self._last_poll = time.monotonic()
        return self._ti.xcom_pull(*args, **kwargs)


class CommonAIKillSemantics(CancellableAgentMixin):
    """The mixin plus what common.ai's operators need beyond ``run_agent_sync``.

    Put it first in the bases, before the common.ai operator class (as [`cancellable`][] does).
    ``on_kill`` is the mixin's; it still calls common.ai's ``on_kill``, which finds no token
    (common.ai's ``run_agent_sync`` is never used) and returns. ``durable=`` stays common.ai's
    (its journal), so switching keeps the constructor's meaning.
    """

    owns_durable = False
    # common.ai's wrapped ``__init__`` expects the outermost one to be wrapped too.
    own_init_in_every_subclass = True

    def _complete_run(self, context: Any, result: Any, **kwargs: Any) -> Any:
        """AgentOperator's post-run step (XCom pushes, journal and usage-budget cleanup), refused
        once killed: the result is discarded, and the retry still finds the durable journal."""
        if self.cancellation.cancelled:
            raise self.cancelled_error("killed after the result arrived; the result is discarded")
        return super()._complete_run(context, result, **kwargs)  # type: ignore[misc]

    def _poll_loop(self, *, ti: Any, **kwargs: Any) -> Any:
        """common.ai's HITL review wait, ended by a kill (see `_PollingTaskInstance`)."""
        interval = float(getattr(self, "hitl_poll_interval", 10.0))
        proxy = _PollingTaskInstance(self, ti, interval)
        self.hitl_poll_interval = 0.0
        try:
            return super()._poll_loop(ti=proxy, **kwargs)  # type: ignore[misc]
        finally:
            self.hitl_poll_interval = interval


def cancellable(operator_class: _Op) -> _Op:
    """Return ``operator_class`` (a common.ai operator, or any operator whose agent runs go through
    ``self.run_agent_sync``) with this provider's kill semantics, under the same name.

    Constructor arguments are the class's own plus the mixin's (``cancellation_budget``,
    ``timeout_margin``, ``classify_timeout``, ``reap_descendants``, ``cancellation_retry_policy``).
    """
    if issubclass(operator_class, CancellableAgentMixin):
        return operator_class
    return type(  # type: ignore[return-value]
        operator_class.__name__,
        (CommonAIKillSemantics, operator_class),
        {"__module__": __name__, "__doc__": operator_class.__doc__},
    )


class AgentOperator(CommonAIKillSemantics, _CommonAIAgentOperator):
    """common.ai's ``AgentOperator`` with this provider's kill semantics (same arguments)."""


class LLMOperator(CommonAIKillSemantics, _CommonAILLMOperator):
    """common.ai's ``LLMOperator`` with this provider's kill semantics (same arguments)."""
