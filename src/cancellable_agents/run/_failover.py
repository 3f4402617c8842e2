"""A model failover chain that a kill stops, that names the model in flight, and that stays with
the model that answered.

[`failover`][] wraps pydantic-ai's ``FallbackModel`` (the next model is tried when one fails with
a ``ModelAPIError``: down, refused, rate-limited, 5xx) with three promises of this provider:

- **a kill stops the chain.** A kill cancels the task awaiting the request; ``FallbackModel``
  moves on only for an ``Exception`` its ``fallback_on`` names, and a cancel is a
  ``CancelledError`` (a ``BaseException``), so no next model is asked. A member also refuses to
  start a request once its run's scope is cancelled, whatever error the closed request raised;
- **the record names the model in flight.** Each member's request is on the scope's timeline
  (``model_request``: its label and place in the chain), so a kill record shows which model a
  killed request went to;
- **the chain stays with the model that answered.** Each answer carries its member's label in
  ``provider_details`` (``ANSWERED_BY``), which the durable journal keeps with the messages; the
  next request, in this try or in a resumed one, starts at that member (the earlier ones stay
  behind it as fallbacks), so a run that failed over does not switch back mid-conversation.

Airflow-free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from cancellable_agents.core.scope import current_cancellation

#: The key in an answer's ``provider_details`` naming the chain member that gave it.
ANSWERED_BY = "cancellable_agents_failover_member"


class FailoverMember(WrapperModel):
    """One model of a chain, under a label (its connection id, or its model id)."""

    def __init__(self, wrapped: Model, label: str, position: int) -> None:
        super().__init__(wrapped)
        self.member = label
        self.position = position

    def _starting(self) -> None:
        scope = current_cancellation()
        if scope is None:
            return
        scope.raise_if_cancelled()
        scope.record("model_request", model=self.member, failover_position=self.position)

    def _stamp(self, response: ModelResponse) -> None:
        response.provider_details = {**(response.provider_details or {}), ANSWERED_BY: self.member}

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        self._starting()
        response = await self.wrapped.request(messages, model_settings, model_request_parameters)
        self._stamp(response)
        return response

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncIterator[StreamedResponse]:
        self._starting()
        async with self.wrapped.request_stream(
            messages, model_settings, model_request_parameters, run_context
        ) as stream:
            # The agent takes the response (``get()``) inside this block, and a provider may
            # replace the stream's ``provider_details`` while it streams: stamp what ``get`` gives.
            unstamped = stream.get

            def stamped() -> ModelResponse:
                response = unstamped()
                self._stamp(response)
                return response

            stream.get = stamped  # type: ignore[method-assign]
            yield stream


class Failover(FallbackModel):
    """``FallbackModel`` over [`FailoverMember`][]s that starts at the member that answered last."""

    def __init__(self, members: Sequence[FailoverMember], **kwargs: Any) -> None:
        super().__init__(*members, **kwargs)
        self._members = list(members)
        self._kwargs = kwargs
        self._reordered: dict[str, FallbackModel] = {}

    @property
    def members(self) -> list[FailoverMember]:
        """The chain in its configured order."""
        return list(self._members)

    def _sticky(self, messages: list[ModelMessage]) -> FallbackModel | None:
        """The chain starting at the member that gave the last answer; ``None``: the first did."""
        label = answered_by(messages)
        if label is None or label == self._members[0].member:
            return None
        first = next((m for m in self._members if m.member == label), None)
        if first is None:
            return None
        if label not in self._reordered:
            rest = [m for m in self._members if m is not first]
            self._reordered[label] = FallbackModel(first, *rest, **self._kwargs)
        return self._reordered[label]

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        chain = self._sticky(messages)
        if chain is None:
            return await super().request(messages, model_settings, model_request_parameters)
        return await chain.request(messages, model_settings, model_request_parameters)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncIterator[StreamedResponse]:
        chain = self._sticky(messages)
        opened = (
            super().request_stream(messages, model_settings, model_request_parameters, run_context)
            if chain is None
            else chain.request_stream(messages, model_settings, model_request_parameters, run_context)
        )
        async with opened as stream:
            yield stream


def answered_by(messages: list[ModelMessage]) -> str | None:
    """The label of the chain member that gave the last answer in ``messages``, if one did."""
    for message in reversed(messages):
        if isinstance(message, ModelResponse):
            label = (message.provider_details or {}).get(ANSWERED_BY)
            if isinstance(label, str):
                return label
    return None


def failover(models: Sequence[tuple[str, Model]]) -> Model:
    """One model for ``(label, model)`` pairs: the model itself when there is one, else a
    [`Failover`][] chain in the given order."""
    if len(models) == 1:
        return models[0][1]
    return Failover([FailoverMember(model, label, i) for i, (label, model) in enumerate(models)])
