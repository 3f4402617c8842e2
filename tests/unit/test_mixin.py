"""CancellableAgentMixin in-process: bases, lazy scope, on_kill contract, execute guard."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import pytest
from airflow.sdk.bases.operator import BaseOperator
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel

from cancellable_agents import AgentOperator, CancellableAgentMixin, LLMOperator, TaskCancelled
from cancellable_agents.airflow.kill_record.document import RECORD_PREFIX
from cancellable_agents.airflow.task_try import try_of
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import Outcome
from tests.airflow_versions import airflow_task_timeout, requires_retry_policies


class Echo(CancellableAgentMixin, BaseOperator):
    def execute(self, context: Any) -> Any:
        return self.run_agent_sync(Agent(TestModel(custom_output_text="ok")), "hi").output


def test_operators_put_the_mixin_before_base_operator() -> None:
    for cls in (LLMOperator, AgentOperator, Echo):
        mro = cls.__mro__
        assert mro.index(CancellableAgentMixin) < mro.index(BaseOperator)
        assert cls.on_kill is CancellableAgentMixin.on_kill


def test_wrong_base_order_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="put CancellableAgentMixin before BaseOperator"):

        class Wrong(BaseOperator, CancellableAgentMixin):  # type: ignore[misc]
            pass


def test_scope_is_lazy_survives_deepcopy_and_is_never_replaced() -> None:
    op = Echo(task_id="t")
    assert try_of(op) is None, "operators are deep-copied: no scope in __init__"
    clone = copy.deepcopy(op)
    scope = clone.cancellation
    assert clone.cancellation is scope
    seen: list[Any] = []
    threads = [threading.Thread(target=lambda: seen.append(Echo(task_id="x").cancellation)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2)
    assert len({id(s) for s in seen}) == 4


def test_on_kill_returns_quickly_never_raises_and_is_idempotent() -> None:
    op = Echo(task_id="t")
    started = time.perf_counter()
    for _ in range(20):
        op.on_kill()
    assert time.perf_counter() - started < 0.1
    assert op.cancellation.cancelled
    events = [e.event for e in op.cancellation.timeline]
    assert events.count("kill_received") == 1


def test_on_kill_survives_a_failing_operator_on_kill(caplog: pytest.LogCaptureFixture) -> None:
    class Fragile(CancellableAgentMixin, BaseOperator):
        def on_kill(self) -> None:
            super().on_kill()

    class Broken(Fragile):
        def execute(self, context: Any) -> None:
            return None

    op = Broken(task_id="t")
    op.cancellation.register(lambda: 1 / 0, name="bad")
    op.on_kill()
    assert op.cancellation.wait_released(2)


def test_kill_before_execute_means_no_run(caplog: pytest.LogCaptureFixture) -> None:
    op = Echo(task_id="t")
    op.on_kill()
    with caplog.at_level("WARNING"), pytest.raises(TaskCancelled):
        op.execute({})
    assert RECORD_PREFIX in caplog.text
    assert op.cancellation.outcome is Outcome.CANCELLED
    assert "execute_refused" in [e.event for e in op.cancellation.timeline], "execute must not run"


def test_kill_after_execute_returned_is_a_no_op() -> None:
    op = Echo(task_id="t")
    assert op.execute({}) == "ok"
    op.on_kill()
    assert not op.cancellation.cancelled
    assert "cancel_ignored" in [e.event for e in op.cancellation.timeline]


def test_kill_during_execute_after_the_run_discards_the_result() -> None:
    class KilledLate(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> Any:
            out = self.run_agent_sync(Agent(TestModel(custom_output_text="ok")), "hi").output
            self.on_kill()  # SIGTERM lands after the run, before execute returns
            return out

    op = KilledLate(task_id="t")
    with pytest.raises(TaskCancelled, match="result is discarded"):
        op.execute({})


def test_execution_timeout_gives_the_run_an_earlier_deadline() -> None:
    from datetime import timedelta

    op = Echo(task_id="t", execution_timeout=timedelta(seconds=10))
    op.timeout_margin = 2.0
    deadline = op.run_timeout()
    assert deadline is not None and 7.5 < deadline <= 8.0
    assert Echo(task_id="u").run_timeout() is None


def test_timeout_path_on_kill_records_timeout_and_releases() -> None:
    AirflowTaskTimeout = airflow_task_timeout()

    op = Echo(task_id="t")
    released = threading.Event()
    op.cancellation.register(released.set, name="sandbox")
    try:
        raise AirflowTaskTimeout()
    except AirflowTaskTimeout:
        op.on_kill()  # the Task SDK calls on_kill inside its `except AirflowTaskTimeout`
    assert released.is_set(), "on the timeout path nothing else unwinds: on_kill waits for it"
    assert op.cancellation.cause is CancelCause.TIMEOUT


def test_cancellation_settings_are_operator_arguments() -> None:
    op = LLMOperator(task_id="t", model="test", prompt="p", cancellation_budget=2.5, timeout_margin=1.0)
    assert op.cancellation_budget == 2.5 and op.timeout_margin == 1.0
    assert op.cancellation.budget == 2.5


def test_bad_budget_is_refused_and_a_too_long_one_warned(caplog: pytest.LogCaptureFixture) -> None:
    from cancellable_agents.core.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="cancellation_budget must be a positive"):
        Echo(task_id="t", cancellation_budget=-1)
    with caplog.at_level("WARNING"):
        Echo(task_id="u", cancellation_budget=8)
    assert "SIGKILLs a task 5s after SIGTERM" in caplog.text


@requires_retry_policies
def test_mixin_operators_get_the_cancellation_aware_retry_policy() -> None:
    from cancellable_agents import CancellationAwareRetryPolicy

    assert isinstance(Echo(task_id="t").retry_policy, CancellationAwareRetryPolicy)
    assert Echo(task_id="u", cancellation_retry_policy=False).retry_policy is None


def test_inherited_execute_is_guarded_too() -> None:
    from airflow.providers.standard.operators.python import PythonOperator

    class KillablePython(CancellableAgentMixin, PythonOperator):
        pass

    def work() -> str:
        op.on_kill()  # the kill lands while the callable runs
        return "done"

    op = KillablePython(task_id="t", python_callable=work)
    with pytest.raises(TaskCancelled):
        op.execute({"ti": None, "params": {}})


def test_the_scope_is_current_for_all_of_execute() -> None:
    from cancellable_agents import current_cancellation

    seen: list[Any] = []

    class Looks(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> None:
            seen.append(current_cancellation())

    op = Looks(task_id="t")
    op.execute({})
    assert seen == [op.cancellation]
    assert current_cancellation() is None


def test_an_error_caused_by_the_kill_ends_as_task_cancelled() -> None:
    class BrokenByTheKill(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> None:
            self.on_kill()
            raise ConnectionResetError("the unwind closed our client")

    op = BrokenByTheKill(task_id="t")
    with pytest.raises(TaskCancelled) as info:
        op.execute({})
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert op.cancellation.outcome is Outcome.CANCELLED


def test_an_ordinary_error_stays_itself() -> None:
    class Broken(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> None:
            raise KeyError("bad input")

    with pytest.raises(KeyError):
        Broken(task_id="t").execute({})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the descendant reaper is Linux-only")
def test_reaping_survives_a_pre_execute_override_without_super() -> None:
    class OwnPreExecute(CancellableAgentMixin, BaseOperator):
        def pre_execute(self, context: Any) -> None:  # no super(): the reaper must start anyway
            pass

        def execute(self, context: Any) -> Any:
            # A tool that leaves a detached process behind, then fails.
            out = subprocess.run(
                ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            )
            self.leftover = int(out.stdout)
            raise RuntimeError("the tool broke")

    op = OwnPreExecute(task_id="own_pre_execute")
    op.pre_execute({})
    with pytest.raises(RuntimeError, match="the tool broke"):
        op.execute({})
    try:
        assert op.task_try().reaper is not None
        assert not _alive(op.leftover), "the detached process outlived the failed task"
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(op.leftover).kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
