"""wait_shielded: cleanup awaited through repeated cancels, within a budget, then the cancel again.

Every test drives a real event loop; "the cancel was delivered" is awaited as loop turns (the
shield is back to waiting), never as wall-clock time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from cancellable_agents.core._shield import wait_shielded
from cancellable_agents.core.scope import TaskCancellation

pytestmark = pytest.mark.timeout(30)

#: Loop turns a delivered cancel needs to reach (or cut short) the shielded wait.
TURNS = 20


class Work:
    """Shielded work that runs until released, and says whether it finished."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = False

    async def __call__(self) -> None:
        self.started.set()
        await self.release.wait()
        self.finished = True


async def turns(n: int = TURNS) -> None:
    """Let the loop run ``n`` times round (a scheduling yield, not a timed wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def expired(timeout: asyncio.Timeout) -> None:
    for _ in range(TURNS):
        if timeout.expired():
            return
        await asyncio.sleep(0)
    raise AssertionError("the timeout did not expire")


async def started(call: Callable[[], Coroutine[Any, Any, None]], work: Work) -> asyncio.Task[None]:
    task = asyncio.create_task(call())
    await asyncio.wait_for(work.started.wait(), 5)
    return task


def test_an_absorbed_cancel_is_raised_again_once_the_work_is_done() -> None:
    async def main() -> None:
        work = Work()
        caller = await started(lambda: wait_shielded(work(), "work"), work)
        caller.cancel("first")
        await turns()
        assert not caller.done(), "the cancel cut the shielded wait short"
        work.release.set()
        with pytest.raises(asyncio.CancelledError) as raised:
            await asyncio.wait_for(caller, 5)
        assert work.finished, "the caller ended before the work it shielded"
        assert raised.value.args == ("first",), "the cancel raised is not the one absorbed"

    asyncio.run(main())


def test_repeated_cancels_do_not_cut_the_wait_short_and_none_is_uncancelled() -> None:
    async def main() -> None:
        work = Work()
        caller = await started(lambda: wait_shielded(work(), "work"), work)
        for _ in range(3):
            caller.cancel()
            await turns()
            assert not caller.done(), "a repeated cancel cut the shielded wait short"
        work.release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, 5)
        assert work.finished
        # Not ours to uncancel: whoever sent them still sees all three.
        assert caller.cancelling() == 3

    asyncio.run(main())


def test_without_a_cancel_the_work_is_awaited_and_its_outcome_returned() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("teardown failed")

    async def main() -> None:
        work = Work()
        caller = await started(lambda: wait_shielded(work(), "work"), work)
        work.release.set()
        await asyncio.wait_for(caller, 5)
        assert work.finished and not caller.cancelled()
        with pytest.raises(RuntimeError, match="teardown failed"):
            await wait_shielded(fails(), "teardown")

    asyncio.run(main())


def test_a_cancel_wins_over_the_works_own_failure() -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def fails() -> None:
            await release.wait()
            raise RuntimeError("teardown failed")

        caller = asyncio.create_task(wait_shielded(fails(), "teardown"))
        await turns()
        caller.cancel()
        await turns()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, 5)

    asyncio.run(main())


def test_a_timeout_bounds_the_wait_from_the_start_and_leaves_the_work_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        work = Work()
        loop = asyncio.get_running_loop()
        began = loop.time()
        with caplog.at_level(logging.WARNING, logger="cancellable_agents.core._shield"):
            await asyncio.wait_for(wait_shielded(work(), "the stop of command c1", timeout=0.05), 5)
        assert loop.time() - began >= 0.05
        assert work.started.is_set() and not work.finished
        work.release.set()  # it was left running, not cancelled: it can still finish
        await turns()
        assert work.finished

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the stop of command c1 did not finish within the budget; left running"]


def test_after_a_cancel_the_scopes_remaining_budget_bounds_the_wait_then_the_cancel_is_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = 0.1

    async def main() -> None:
        scope = TaskCancellation("shield", budget=budget)
        work = Work()
        loop = asyncio.get_running_loop()

        async def shielded() -> None:
            with scope.activate():
                await wait_shielded(work(), "the sandbox's teardown")

        caller = await started(shielded, work)
        cancelled_at = loop.time()
        caller.cancel()
        with (
            caplog.at_level(logging.WARNING, logger="cancellable_agents.core._shield"),
            pytest.raises(asyncio.CancelledError),
        ):
            await asyncio.wait_for(caller, 5)
        assert loop.time() - cancelled_at >= budget
        assert not work.finished, "the budget did not cut the wait"
        work.release.set()
        await turns()

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the sandbox's teardown did not finish within the budget; left running"]


def test_before_any_cancel_the_wait_has_no_bound_of_its_own() -> None:
    """The work bounds itself (a stop, a teardown); only a cancel puts the budget on the caller."""
    budget = 0.05

    async def slow() -> str:
        await asyncio.sleep(budget * 4)  # the work itself takes longer than the budget
        return "done"

    async def main() -> None:
        scope = TaskCancellation("shield", budget=budget)
        with scope.activate():
            job = asyncio.ensure_future(slow())
            await asyncio.wait_for(wait_shielded(job, "teardown"), 5)
        assert job.done() and job.result() == "done"

    asyncio.run(main())


async def shielded_under_an_expired_timeout(work: Work) -> asyncio.Task[None]:
    """A task shielding ``work`` inside ``asyncio.timeout(0)``, once that timeout has fired."""
    scopes: list[asyncio.Timeout] = []

    async def under_timeout() -> None:
        async with asyncio.timeout(0) as timeout:
            scopes.append(timeout)
            await wait_shielded(work(), "work")

    caller = await started(under_timeout, work)
    await expired(scopes[0])
    return caller


def test_a_cancel_that_is_not_ours_is_not_swallowed_by_an_enclosing_timeout() -> None:
    """The timeout's own cancel and an outside one both land in the shield: the timeout takes
    back its own, and the outside one must still end the caller as a cancel."""

    async def main() -> None:
        work = Work()
        caller = await shielded_under_an_expired_timeout(work)
        caller.cancel()
        await turns()
        work.release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, 5)
        assert work.finished

    asyncio.run(main())


def test_an_enclosing_timeouts_own_cancel_still_comes_out_as_its_timeout() -> None:
    async def main() -> None:
        work = Work()
        caller = await shielded_under_an_expired_timeout(work)
        assert not caller.done(), "the timeout's cancel cut the shielded wait short"
        work.release.set()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(caller, 5)
        assert work.finished

    asyncio.run(main())
