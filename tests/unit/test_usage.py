"""One usage shape for every record: the kill record, a sub-agent's record, the durable record."""

from __future__ import annotations

from pydantic_ai.usage import RunUsage

from cancellable_agents.core._usage import USAGE_FIELDS, usage_counts, usage_dict
from cancellable_agents.durable._try_usage import TryUsage, add_usage, minus_usage


def test_a_run_usage_reads_as_its_four_counts() -> None:
    usage = RunUsage(requests=2, input_tokens=30, output_tokens=4, tool_calls=1)
    assert usage_dict(usage) == {"requests": 2, "input_tokens": 30, "output_tokens": 4, "tool_calls": 1}
    assert list(usage_counts(usage)) == list(USAGE_FIELDS)


def test_no_usage_is_none_and_missing_counts_are_zero() -> None:
    assert usage_dict(None) is None

    class Partial:
        requests = 1
        input_tokens = None

    assert usage_dict(Partial()) == {"requests": 1, "input_tokens": 0, "output_tokens": 0, "tool_calls": 0}


def test_older_pydantic_ai_usage_method_is_called() -> None:
    def usage() -> RunUsage:
        return RunUsage(requests=3)

    assert usage_counts(usage)["requests"] == 3


def test_a_try_usage_round_trips_and_adds_up_across_tries() -> None:
    earlier = [TryUsage(1, 2, 10, 1, 1), TryUsage(2, 1, 5, 1, 0)]
    assert [TryUsage.from_dict(t.as_dict()) for t in earlier] == earlier
    assert TryUsage.from_dict({"try": 3}) == TryUsage(3)
    start = add_usage(None, earlier)
    assert usage_counts(start) == {"requests": 3, "input_tokens": 15, "output_tokens": 2, "tool_calls": 1}
    this_try = TryUsage.of_run(3, RunUsage(requests=4, input_tokens=20, output_tokens=2, tool_calls=1))
    assert minus_usage(this_try, earlier) == TryUsage(3, 1, 5, 0, 0)
