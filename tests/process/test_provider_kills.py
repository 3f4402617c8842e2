"""Each provider's real SDK, killed mid-stream with a real SIGTERM through the Task SDK's handler.

One task process per provider (``task_scenarios.py provider_NAME``, forked from the session's
zygote): an ``LLMOperator`` whose model is that provider's pydantic-ai model and SDK
(``tests/provider_models.py``), streaming 600 tokens from the session's scripted server, which
speaks the provider's wire protocol (``cancellable_agents.testing.wire_protocols``) and records when
it sees the client go. The test SIGTERMs the task once tokens flow, then checks, per provider:

- the task raised ``TaskCancelled`` and its unwind fit in Airflow's grace;
- the server saw the request closed, timed from the signal, inside the grace (Bedrock's botocore
  blocks in a worker thread: before its connection was shut down on the cancel, its request stayed
  open until Airflow's SIGKILL);
- nothing of the request outlives the unwind: no connection to the server still established once
  the task failed, no thread of ours left running at the process's end, and the process exits on
  its own.

Latencies are printed (``-s``); ``benchmarks/provider_kills.py`` measures them over many runs
with the same kill (``tests/process/provider_kills.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from cancellable_agents.testing.openai_server import ScriptedModelServer
from tests.process.provider_kills import kill_request
from tests.provider_models import PROVIDERS, installed
from tests.taskproc import GRACE, unwound_ms

pytestmark = pytest.mark.process


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_each_providers_request_is_closed_by_the_kill(
    spawn_task: Any, model_server: ScriptedModelServer, provider: str
) -> None:
    check(spawn_task, model_server, provider, "stream")


@pytest.mark.parametrize("moment", ["first", "whole"])
def test_a_bedrock_request_blocked_in_its_thread_is_closed_by_the_kill(
    spawn_task: Any, model_server: ScriptedModelServer, moment: str
) -> None:
    """botocore blocks its worker thread in the socket read until the answer starts (``first``)
    or ends (``whole``): the kill must close that connection, not leave the thread in it."""
    check(spawn_task, model_server, "bedrock", moment)


def check(spawn_task: Any, model_server: ScriptedModelServer, provider: str, moment: str) -> None:
    if not installed(provider):
        pytest.skip(f"{PROVIDERS[provider]} is not installed (the package's {provider} extra)")
    result = kill_request(spawn_task, model_server, provider, moment)
    print(
        f"\n[provider] {provider} ({moment}): SIGTERM -> task raised {result['raised_ms']:.1f} ms, "
        f"server saw the request closed {result['closed_ms']} ms, process gone {result['exit_ms']:.0f} ms, "
        f"connections left {result['connections']}, threads holding the exit {result['holding']}"
    )
    assert unwound_ms(result["record"]) < GRACE * 1000
    assert result["closed_ms"] is not None, f"{provider}: the server never saw the request closed"
    assert result["closed_ms"] < GRACE * 1000, result
    assert result["connections"] == [], f"{provider}: a connection outlived the unwind"
    assert result["holding"] == [], f"{provider}: threads still running at the process's end"
    assert result["requests"] == 1, f"{provider}: a request was made after the cancel (a retry)"
    if provider == "bedrock" and moment != "stream":
        # pydantic-ai closes a started stream itself; a request still blocked in its read is ours.
        [closed] = result["closed_on_the_socket"]
        assert closed["requests"] == 1, closed
