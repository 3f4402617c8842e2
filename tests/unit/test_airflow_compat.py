"""The Airflow < 3.3 contract: no retry policies there, and nothing else is lost.

Airflow 3.1 and 3.2 have no ``airflow.sdk.definitions.retry_policy``. There the operators must
still build, parse, serialize and raise ``TaskCancelled`` with the cause when killed (the real
SIGTERM paths are ``tests/process``, which ``make compat-airflow`` runs on those versions too);
only the retry policy is missing, and asking for it must say why and what still works.
These tests skip on 3.3+; ``make compat-airflow`` runs them on 3.1 and 3.2.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from airflow.sdk import DAG
from airflow.sdk.bases.operator import BaseOperator

from cancellable_agents import AgentOperator, CancellableAgentMixin, LLMOperator
from tests.airflow_versions import only_without_retry_policies

pytestmark = only_without_retry_policies


class Summarise(CancellableAgentMixin, BaseOperator):
    """A DAG author's own operator with the mixin."""

    def execute(self, context: Any) -> None:
        return None


def _assert_explains_the_fallback(exc: ImportError) -> None:
    text = str(exc)
    assert "Airflow 3.3" in text, text
    assert "operators still raise TaskCancelled" in text, text
    assert isinstance(exc.__cause__, ImportError), "the missing Airflow module stays visible in the chain"


def test_importing_the_retry_module_names_airflow_3_3_and_what_still_works() -> None:
    with pytest.raises(ImportError) as first:
        importlib.import_module("cancellable_agents.airflow.retry")
    _assert_explains_the_fallback(first.value)
    with pytest.raises(ImportError) as again:  # not cached as a half-imported module
        importlib.import_module("cancellable_agents.airflow.retry")
    _assert_explains_the_fallback(again.value)


def test_the_public_name_fails_with_the_same_message() -> None:
    with pytest.raises(ImportError) as info:
        from cancellable_agents import CancellationAwareRetryPolicy  # noqa: F401
    _assert_explains_the_fallback(info.value)


def test_cancellation_retry_policy_defaults_to_true() -> None:
    parameter = inspect.signature(CancellableAgentMixin.__init__).parameters["cancellation_retry_policy"]
    assert parameter.default is True


def test_operators_build_with_retry_policy_left_alone() -> None:
    """The default ``cancellation_retry_policy=True`` (and an explicit one) neither wraps nor fails."""
    with DAG("compat", schedule=None) as dag:
        operators = [
            LLMOperator(task_id="llm", model="test", prompt="p"),
            AgentOperator(task_id="agent", model="test", prompt="p"),
            Summarise(task_id="custom"),
            LLMOperator(task_id="explicit", model="test", prompt="p", cancellation_retry_policy=True),
            Summarise(task_id="off", cancellation_retry_policy=False),
        ]
    for operator in operators:
        assert getattr(operator, "retry_policy", None) is None, operator.task_id
        assert operator.cancellation.name == operator.task_id  # the scope works as on 3.3
    assert set(dag.task_ids) == {op.task_id for op in operators}


def _dag_serialization() -> Any:
    """The DAG processor's serializer: ``DagSerialization`` from 3.2, ``SerializedDAG`` on 3.1."""
    try:
        from airflow.serialization.serialized_objects import DagSerialization
    except ImportError:
        from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization
    return DagSerialization


def test_the_dag_serializes_as_a_dag_processor_would() -> None:
    with DAG("compat_serialized", schedule=None) as dag:
        LLMOperator(task_id="llm", model="test", prompt="p")
        AgentOperator(task_id="agent", model="test", prompt="p")
        Summarise(task_id="custom")
    serialization = _dag_serialization()
    restored = serialization.from_dict(serialization.to_dict(dag))
    assert set(restored.task_ids) == {"llm", "agent", "custom"}


def test_retry_policy_is_not_an_operator_argument_before_3_3() -> None:
    """Airflow itself refuses the argument; the provider adds nothing that would accept it."""
    with pytest.raises(TypeError, match="retry_policy"):
        LLMOperator(task_id="llm", model="test", prompt="p", retry_policy=None)
