"""``durable=True`` on the operators: parse-time checks per Airflow version, and an operator's
killed try resumed by the next try through ``DurableOptions(path=...)`` (real files via
ObjectStoragePath); the options' deployment defaults and the 0.1 keywords.

Runs on every supported Airflow (the compat venvs too): on 3.1/3.2 ``durable=True`` without a
``path`` must fail when the DAG is parsed, naming the fix.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from cancellable_agents import AgentOperator, DurableOptions, LLMOperator, TaskCancelled
from cancellable_agents.airflow import mixin
from cancellable_agents.airflow._adapter import has_task_state_store
from cancellable_agents.airflow._durable_task import journal_for
from cancellable_agents.core.exceptions import ConfigurationError
from tests.unit.durable_runs import TI, operator_agent


def test_durable_needs_a_store_on_airflow_before_3_3_and_says_which() -> None:
    if has_task_state_store():
        AgentOperator(task_id="ok", model="test", prompt="p", durable=True)
        return
    with pytest.raises(ConfigurationError, match=r"DurableOptions\(path=\.\.\.\).*ObjectStoragePath"):
        AgentOperator(task_id="refused", model="test", prompt="p", durable=True)


def test_durable_options_are_one_argument(tmp_path: Path) -> None:
    options = DurableOptions(
        path=str(tmp_path), resume_after_clear=True, usage_limits_span_tries=True, flush_after=0
    )
    op = LLMOperator(task_id="t", model="test", prompt="p", durable=options)
    assert op.durable is options
    journal = journal_for(op, op.task_try({"ti": TI(1)}))
    assert (journal.returns_flush_s, journal.resume_after_clear, journal.usage_spans_tries) == (0, True, True)
    assert DurableOptions.of(True) == DurableOptions() and DurableOptions.of(False) is None
    assert LLMOperator(task_id="v", model="test", prompt="p").durable is None


def test_options_left_unset_take_the_deployments_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__DURABLE_FLUSH_AFTER", "0.25")
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__DURABLE_WRITE_AHEAD", "True")
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__DURABLE_BATCH_WINDOW", "0.5")
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__CANCELLATION_BUDGET", "3.5")
    # A path, so the test holds where Airflow has no task state store (3.1/3.2) too.
    op = LLMOperator(task_id="t", model="test", prompt="p", durable=DurableOptions(path=str(tmp_path)))
    journal = journal_for(op, op.task_try({"ti": TI(1)}))
    assert (journal.returns_flush_s, journal.write_ahead, op.cancellation_budget) == (0.25, True, 3.5)
    assert journal.batch_window_s == 0.5
    own = DurableOptions(path=str(tmp_path), flush_after=1, batch_window=0)
    given = LLMOperator(task_id="u", model="test", prompt="p", cancellation_budget=2, durable=own)
    journal = journal_for(given, given.task_try({"ti": TI(1)}))
    assert (journal.returns_flush_s, given.cancellation_budget) == (1, 2), "an operator's own value wins"
    assert journal.batch_window_s == 0


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "1"])
def test_a_bad_durable_window_is_refused_naming_the_option(value: object) -> None:
    for name in ("flush_after", "batch_window"):
        with pytest.raises(ConfigurationError, match=rf"DurableOptions\({name}=...\) must be >= 0 seconds"):
            DurableOptions(**{name: value})  # type: ignore[arg-type]


def test_a_bad_deployment_value_is_refused_naming_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__CANCELLABLE_AGENTS__TIMEOUT_MARGIN", "two")
    with pytest.raises(
        ConfigurationError,
        match=r"\[cancellable_agents\] timeout_margin .*AIRFLOW__CANCELLABLE_AGENTS__TIMEOUT_MARGIN",
    ):
        LLMOperator(task_id="t", model="test", prompt="p")


def test_the_old_durable_keywords_still_work_and_each_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mixin, "_warned_old_keywords", set())
    old = {"durable_path": str(tmp_path), "resume_after_clear": True, "durable_flush_after": 0}
    with pytest.warns(DeprecationWarning) as caught:
        op = LLMOperator(task_id="t", model="test", prompt="p", durable=True, **old)
        LLMOperator(task_id="u", model="test", prompt="p", durable=True, **old)
    assert sorted(str(w.message).split("=")[0] for w in caught) == sorted(old), "one warning per keyword"
    assert all("DurableOptions(" in str(w.message) and "0.3.0" in str(w.message) for w in caught)
    assert op.durable == DurableOptions(path=str(tmp_path), resume_after_clear=True, flush_after=0)


def _try(tmp_path: Path, try_number: int, kill_at: int | None) -> tuple[AgentOperator, list[int], Any]:
    requests: list[int] = []
    box: list[Any] = []
    op = AgentOperator(
        task_id="agent",
        agent=operator_agent(kill_at, box, requests),
        prompt="four steps",
        durable=DurableOptions(path=str(tmp_path)),
        classify_timeout=0.2,
    )
    box.append(op)
    try:
        outcome: Any = op.execute({"ti": TI(try_number)})
    except TaskCancelled as exc:
        outcome = exc
    return op, requests, outcome


def test_a_killed_try_is_resumed_by_the_next_and_the_record_reports_usage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        _, first, outcome = _try(tmp_path, 1, kill_at=3)
        assert isinstance(outcome, TaskCancelled)
        record_lines = [
            r.getMessage() for r in caplog.records if "cancellable_agents.record " in r.getMessage()
        ]
        assert len(record_lines) == 1
        record = json.loads(record_lines[0].split("cancellable_agents.record ", 1)[1])
        assert record["attached"]["durable"]["usage_this_try"]["requests"] == len(first)
        assert any(tmp_path.rglob("*.json")), "the record is kept for the next try"

        op, second, outcome = _try(tmp_path, 2, kill_at=None)
    assert outcome == "done"
    assert len(second) == 2, "try 2 re-ran tool 3, then asked for step 4 and the answer: nothing else"
    facts = op.cancellation.attached["durable"]
    assert facts["resumed_from_try"] == 1
    assert facts["usage_total"]["requests"] == len(first) + len(second)
    assert not list(tmp_path.rglob("*.json")), "success deletes the record"


@pytest.mark.skipif(not has_task_state_store(), reason="Airflow's task state store is 3.3+")
def test_the_kill_record_is_logged_before_the_store_is_asked_to_write_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through Airflow's task state store the end entry is API calls, seconds long on a busy API
    server (Celery e2e: 3.7 s; SIGKILL comes at 5 s): the cause must be in the log before them."""

    class Accessor:
        """``context["task_state_store"]``; notes, when the end is written, whether the record is in."""

        def __init__(self) -> None:
            self.values: dict[str, Any] = {}
            self.record_logged_before_end: list[bool] = []

        def get(self, key: str) -> Any:
            return self.values.get(key)

        def set(self, key: str, value: Any) -> None:
            batch = value if isinstance(value, list) else [value]  # queued entries share a call
            if any(isinstance(v, dict) and v.get("kind") == "end" for v in batch):
                logged = any("cancellable_agents.record " in r.getMessage() for r in caplog.records)
                self.record_logged_before_end.append(logged)
            self.values[key] = json.loads(json.dumps(value))

        def delete(self, key: str) -> None:
            self.values.pop(key, None)

    requests: list[int] = []
    box: list[Any] = []
    store = Accessor()
    op = AgentOperator(
        task_id="agent",
        agent=operator_agent(2, box, requests),
        prompt="four steps",
        durable=True,
        classify_timeout=0.2,
    )
    box.append(op)
    with caplog.at_level(logging.INFO), pytest.raises(TaskCancelled):
        op.execute({"ti": TI(1), "task_state_store": store})
    assert store.record_logged_before_end == [True]
