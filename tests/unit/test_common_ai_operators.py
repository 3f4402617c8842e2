"""``cancellable_agents.common_ai``: common.ai's operators with this provider's kill semantics.

The real-signal behaviour is in ``tests/process/test_common_ai_kills.py``; here: the import
contract, constructor parity, the class layout, and a kill before the run through
``AgentOperator.execute`` against the local HTTP model server (zero requests must arrive).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from typing import Any

import pytest

if os.environ.get("CANCELLABLE_AGENTS_EXPECT_COMMON_AI") == "1":
    from airflow.providers.common.ai.operators import agent as common_ai_agent
else:
    common_ai_agent = pytest.importorskip(
        "airflow.providers.common.ai.operators.agent",
        reason="apache-airflow-providers-common-ai is not installed here; `make compat-common-ai` runs this",
    )

from airflow.providers.common.ai.operators.llm import LLMOperator as CommonAILLMOperator

from cancellable_agents import CancellableAgentMixin, CancellationAwareRetryPolicy, TaskCancelled
from cancellable_agents.common_ai import AgentOperator, LLMOperator, cancellable
from cancellable_agents.testing.openai_server import ScriptedModelServer

CONN_ID = "common_ai_unit"


def test_import_without_common_ai_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['airflow.providers.common.ai.operators.agent'] = None\n"
        "try:\n    import cancellable_agents.common_ai\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "airflow-provider-cancellable-agents[common-ai]" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("ours", "theirs"), [(AgentOperator, common_ai_agent.AgentOperator), (LLMOperator, CommonAILLMOperator)]
)
def test_same_constructor_arguments(ours: type, theirs: type) -> None:
    """Every argument of common.ai's constructor, passed by name, is accepted and lands the same."""
    params = inspect.signature(theirs.__init__).parameters.values()
    kwargs = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    kwargs.update(task_id="t", prompt="p", llm_conn_id=CONN_ID, model_id="openai-chat:echo")
    op, reference = ours(**kwargs), theirs(**kwargs)
    for name in kwargs:
        if hasattr(reference, name) and name != "task_id":
            assert getattr(op, name) == getattr(reference, name), name
    # The mixin comes first: its on_kill and run_agent_sync are the ones called.
    assert issubclass(ours, CancellableAgentMixin)
    assert ours.on_kill.__qualname__.startswith("CancellableAgentMixin")
    assert ours.run_agent_sync is CancellableAgentMixin.run_agent_sync


def test_retry_policy_is_wrapped_and_mixin_settings_are_accepted() -> None:
    inner = CancellationAwareRetryPolicy()  # any policy; already-wrapped stays as is
    op = AgentOperator(
        task_id="t", prompt="p", llm_conn_id=CONN_ID, retry_policy=inner, cancellation_budget=3
    )
    assert op.retry_policy is inner and op.cancellation_budget == 3
    plain = LLMOperator(task_id="u", prompt="p", llm_conn_id=CONN_ID)
    assert isinstance(plain.retry_policy, CancellationAwareRetryPolicy)


def test_cancellable_wraps_other_common_ai_operators() -> None:
    branch_module = importlib.import_module("airflow.providers.common.ai.operators.llm_branch")
    Branch = cancellable(branch_module.LLMBranchOperator)
    assert Branch.__name__ == "LLMBranchOperator" and issubclass(Branch, CancellableAgentMixin)
    assert cancellable(Branch) is Branch
    op = Branch(task_id="b", prompt="p", llm_conn_id=CONN_ID)
    assert op.cancellation.cancelled is False


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Any:
    with ScriptedModelServer() as srv:
        conn = {"conn_type": "pydanticai", "host": srv.base_url, "password": "not-a-real-key"}
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(conn))
        yield srv


def test_kill_before_execute_makes_no_model_request(server: ScriptedModelServer) -> None:
    op = AgentOperator(task_id="t", prompt="hello", llm_conn_id=CONN_ID, model_id="openai-chat:echo")
    op.on_kill()  # as the Task SDK's SIGTERM handler would, before execute started
    with pytest.raises(TaskCancelled):
        op.execute(context={})
    assert server.request_count == 0


def test_run_goes_through_the_task_scope(server: ScriptedModelServer) -> None:
    op = LLMOperator(task_id="t", prompt="hello", llm_conn_id=CONN_ID, model_id="openai-chat:echo")
    assert op.execute(context={}) == "echo: hello"
    events = [e.event for e in op.cancellation.timeline]
    assert "run_started" in events and "run_completed" in events
