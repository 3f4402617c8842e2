"""The pydantic-ai hook that makes a winding-down run's next request its last ([`WindDownCapability`][]).

Options and report: [`cancellable_agents.core.wind_down`][]. This hook decides at the start of each
step (``prepare_tools``, which pydantic-ai runs before the request's parameters are built and
before its ``request_limit`` check), so the step in flight is never cut: a tool already running
returns in its own time, and only the request after it changes. The decision is taken once and
never undone: every later request is tool-less too (a model that still calls tools gets nothing to
call, and the run's deadline kills it as it would without wind-down). Airflow-free.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import InstructionPart, ModelResponse
from pydantic_ai.tools import ToolDefinition

from cancellable_agents.core.wind_down import DEFAULT_INSTRUCTION, WindDown, WindDownReason, WindDownReport

log = logging.getLogger(__name__)

__all__ = ["WindDownCapability", "WindDownState", "budget_reason"]


@dataclass
class WindDownState:
    """One run's wind-down, shared by every copy pydantic-ai makes of the capability.

    Written on the run's event loop only; ``lock`` guards the report, which the runner reads from
    the main thread after the run (and a test from another thread).
    """

    options: WindDown
    #: ``clock()`` reading at which the deadline wind-down starts (``None``: not on the deadline).
    start_at: float | None
    #: ``clock()`` reading of the run's deadline (``None``: no deadline).
    deadline_at: float | None
    clock: Callable[[], float]
    run_started: float
    #: Called once, on the loop, when the wind-down starts (the scope's timeline).
    on_start: Callable[[WindDownReport], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    report: WindDownReport | None = None
    #: ``clock()`` when the final request was sent, and whether it answered.
    final_sent_at: float | None = None
    #: The largest request so far, in tokens and cost (the default reserve under a limit).
    largest_tokens: int = 0
    largest_cost: float = 0.0

    @property
    def wound_down(self) -> bool:
        with self.lock:
            return self.report is not None

    def decide(self, ctx: RunContext[Any]) -> bool:
        """Whether this step's request is the final one (deciding it now if it is the first)."""
        with self.lock:
            if self.report is not None:
                return True
        now = self.clock()
        reason: WindDownReason | None = None
        if self.start_at is not None and now >= self.start_at:
            reason = "deadline"
        elif self.options.budget:
            reason = budget_reason(ctx.usage, ctx.usage_limits, self.reserve_tokens(), self.reserve_cost())
        if reason is None:
            return False
        limits = ctx.usage_limits
        request_limit = getattr(limits, "request_limit", None)
        report = WindDownReport(
            reason=reason,
            started_s=now - self.run_started,
            requests_made=ctx.usage.requests,
            requests_left=request_limit - ctx.usage.requests if request_limit is not None else None,
            left_s=self.deadline_at - now if self.deadline_at is not None else None,
        )
        with self.lock:
            self.report = report
        if self.on_start is not None:
            self.on_start(report)
        return True

    def reserve_tokens(self) -> int:
        """Tokens the final request is expected to need: the author's reserve, else the largest
        request so far plus the final instruction (about 3 characters a token, on the high side)."""
        reserve = self.options.reserve_tokens
        if reserve is not None:
            return reserve
        instruction = self.options.instruction if isinstance(self.options.instruction, str) else None
        return self.largest_tokens + len(instruction or DEFAULT_INSTRUCTION) // 3

    def reserve_cost(self) -> float:
        reserve = self.options.reserve_cost
        return reserve if reserve is not None else self.largest_cost

    def note_usage(self, usage: Any) -> None:
        """After each response, its ``RequestUsage``: the largest request so far (the default reserve)."""
        self.largest_tokens = max(self.largest_tokens, int(getattr(usage, "total_tokens", 0) or 0))
        self.largest_cost = max(self.largest_cost, float(getattr(usage, "cost", None) or 0.0))

    def answered(self) -> None:
        """The final request answered: how long it took goes into the report."""
        with self.lock:
            if self.report is None or self.final_sent_at is None or self.report.final_answer_s is not None:
                return
            self.report = dataclasses.replace(self.report, final_answer_s=self.clock() - self.final_sent_at)


def budget_reason(usage: Any, limits: Any, reserve_tokens: int, reserve_cost: float) -> WindDownReason | None:
    """The usage limit this step's request is the last one under, or ``None``.

    The request limit: pydantic-ai refuses a request once ``requests >= request_limit``, so the
    request made when one is left is the last. Token and cost limits are checked after a response,
    so the final request needs room: it is the one made when less than the reserve is left.
    """
    if limits is None:
        return None
    request_limit = limits.request_limit
    if request_limit is not None and usage.requests + 1 >= request_limit:
        return "request_limit"
    for limit_name, used in (
        ("total_tokens_limit", usage.total_tokens),
        ("input_tokens_limit", usage.input_tokens),
        ("output_tokens_limit", usage.output_tokens),
    ):
        limit = getattr(limits, limit_name, None)
        if limit is not None and usage.requests > 0 and used + reserve_tokens >= limit:
            return "tokens_limit"
    cost_limit = getattr(limits, "cost_limit", None)
    cost = getattr(usage, "cost", None)
    if (
        cost_limit is not None
        and cost is not None
        and usage.requests > 0
        and float(cost) + reserve_cost >= float(cost_limit)
    ):
        return "cost_limit"
    return None


class WindDownCapability(AbstractCapability[Any]):
    """Per-run capability: once the wind-down starts, no function tools and one final instruction.

    ``prepare_tools`` sees function tools only (output tools are prepared apart), so a structured
    output's tool stays offered and the answer is validated as usual.
    """

    def __init__(self, state: WindDownState) -> None:
        self.state = state

    async def prepare_tools(
        self, ctx: RunContext[Any], tool_defs: list[ToolDefinition]
    ) -> list[ToolDefinition]:
        if self.state.decide(ctx):
            return []
        return tool_defs

    async def before_model_request(self, ctx: RunContext[Any], request_context: Any) -> Any:
        state = self.state
        if not state.decide(ctx):  # a run without function tools: prepare_tools may not have asked
            return request_context
        params = request_context.model_request_parameters
        instruction = InstructionPart(state.options.final_instruction(ctx.messages), dynamic=True)
        params = dataclasses.replace(
            params, instruction_parts=[*(params.instruction_parts or []), instruction], function_tools=[]
        )
        with state.lock:
            if state.final_sent_at is None:
                state.final_sent_at = state.clock()
        return dataclasses.replace(request_context, model_request_parameters=params)

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: Any, response: ModelResponse
    ) -> ModelResponse:
        self.state.note_usage(response.usage)
        if self.state.final_sent_at is not None:
            self.state.answered()
        return response
