"""SandboxToolset for a real pydantic-ai agent, on LocalSandbox in both isolation modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.run.tool_calls import IDEMPOTENCY_KEY_ENV, RunIdentity, derive_key
from cancellable_agents.toolsets.sandbox import LocalSandbox, SandboxToolset
from tests.process.trees import MODES

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def _tool_returns(messages: list[ModelMessage]) -> list[Any]:
    parts = [p for m in messages for p in getattr(m, "parts", [])]
    return [p.content for p in parts if isinstance(p, (ToolReturnPart, RetryPromptPart))]


def _scripted(calls: list[ToolCallPart], seen: list[Any]) -> FunctionModel:
    """A model that makes ``calls`` one per turn, then answers with what the tools returned."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = _tool_returns(messages)
        if len(returns) < len(calls):
            return ModelResponse(parts=[calls[len(returns)]])
        seen.extend(returns)
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


@pytest.mark.parametrize("mode", MODES)
def test_toolset_runs_echo_for_a_pydantic_ai_agent(mode: str) -> None:
    seen: list[Any] = []
    toolset = SandboxToolset(isolation=mode)  # type: ignore[arg-type]
    calls = [
        ToolCallPart("run_shell", {"command": "echo hi"}),
        ToolCallPart("run_python", {"code": "print(6 * 7)"}),
        ToolCallPart("write_file", {"path": "notes/a.txt", "content": "x"}),
        ToolCallPart("list_files", {"path": "notes"}),
        ToolCallPart("read_file", {"path": "notes/a.txt"}),
    ]
    agent = Agent(_scripted(calls, seen), toolsets=[toolset])
    result = run_agent_in_scope(TaskCancellation("t"), agent, "go")
    assert result.output == "done"
    assert seen[0] == {"exit_code": 0, "stdout": "hi\n", "stderr": ""}
    assert seen[1]["stdout"] == "42\n"
    assert seen[2:] == ["wrote 1 bytes to notes/a.txt", ["a.txt"], "x"]
    assert toolset.sandbox is None, "the toolset destroys the sandbox it created"


def test_toolset_rejects_escaping_paths_and_keeps_a_sandbox_it_was_given(tmp_path: Path) -> None:
    box = LocalSandbox(tmp_path / "wd", isolation="process-group")
    seen: list[Any] = []
    calls = [
        ToolCallPart("read_file", {"path": "../../etc/passwd"}),
        ToolCallPart("run_shell", {"command": "sleep 5", "timeout": 0.2}),
    ]
    agent = Agent(_scripted(calls, seen), toolsets=[SandboxToolset(box, command_timeout=30)])
    run_agent_in_scope(TaskCancellation("t"), agent, "go")
    assert "outside the sandbox working directory" in str(seen[0])
    assert seen[1]["timed_out"] == "killed after 0.2s"
    assert box.workdir.exists(), "a sandbox passed in belongs to the caller"
    assert box.run("echo still usable").ok
    box.destroy()


def test_a_described_toolset_makes_its_sandbox_in_the_workdir_with_the_env_it_names(tmp_path: Path) -> None:
    """What a DAG file would otherwise build a ``LocalSandbox`` for (a workdir, variables) is a
    description's argument: the task makes the sandbox there, and leaves a workdir it was given."""
    seen: list[Any] = []
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    (workdir / "README").write_text("kept\n")
    toolset = SandboxToolset(isolation="process-group", workdir=workdir, env={"REPORT_LEVEL": "brief"})
    calls = [ToolCallPart("run_shell", {"command": "cat README; echo $REPORT_LEVEL; touch made"})]
    agent = Agent(_scripted(calls, seen), toolsets=[toolset])
    result = run_agent_in_scope(TaskCancellation("t"), agent, "go")
    assert result.output == "done"
    assert seen[0]["stdout"] == "kept\nbrief\n", seen
    assert (workdir / "made").exists(), "a given workdir stays"
    assert (workdir / "README").read_text() == "kept\n", "a given workdir stays"


@pytest.mark.parametrize("mode", MODES)
def test_a_command_gets_its_tool_calls_idempotency_key_in_its_environment(mode: str) -> None:
    """``run_shell`` and ``run_python`` give the command the key of the call that runs them (as
    the command's ``env=``: the sandbox's environment allowlist is not widened, and no shell
    wraps the command, so ``$0`` is the command's own shell); the key is the one the run derives
    for that call."""
    seen: list[Any] = []
    calls = [
        ToolCallPart("run_shell", {"command": f"echo ${IDEMPOTENCY_KEY_ENV}; echo $0"}, "call_0"),
        ToolCallPart(
            "run_python", {"code": f"import os; print(os.environ['{IDEMPOTENCY_KEY_ENV}'])"}, "call_1"
        ),
    ]
    agent = Agent(_scripted(calls, seen), toolsets=[SandboxToolset(isolation=mode)])  # type: ignore[arg-type]
    identity = RunIdentity(("dag", "task", "run", 3), "0", 1)
    run_agent_in_scope(TaskCancellation("t"), agent, "go", identity=identity)
    shell_key = derive_key(identity, 1, "call_0")  # response 1 (after the prompt) made call_0
    python_key = derive_key(identity, 3, "call_1")  # response 2, after the first return
    assert seen[0] == {"exit_code": 0, "stdout": f"{shell_key}\n/bin/sh\n", "stderr": ""}
    assert seen[1]["stdout"] == f"{python_key}\n"
