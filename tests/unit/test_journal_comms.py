"""The journal's writer beside Airflow's real comms channel.

A task talks to its supervisor through the Task SDK's ``CommsDecoder`` over a socket; here it is
the real class over a socket pair whose other end answers each frame after a delay, as the
supervisor does after its round trip to the API server. Once a task used Airflow's async API on
its event loop (``asend``), a sync call on that loop raises ``DeadlockImminentError`` when another
thread holds the channel, so from then on the journal stores each step before the tools run.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from cancellable_agents.airflow._adapter import comms_used_from_a_loop
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable import Journal, MemoryStore
from cancellable_agents.run.runner import run_agent_in_scope
from tests.process.trees import eventually

comms_module = pytest.importorskip("airflow.sdk.execution_time.comms")
if not hasattr(comms_module, "DeadlockImminentError"):
    pytest.skip("this Task SDK's comms have no loop-thread refusal", allow_module_level=True)

from airflow.sdk.execution_time import task_runner  # noqa: E402
from airflow.sdk.execution_time.comms import (  # noqa: E402
    CommsDecoder,
    DeadlockImminentError,
    GetVariable,
    _RequestFrame,
    _ResponseFrame,
)

#: How long the "supervisor" takes to answer: long enough that a store call is still holding
#: the channel when the step's tool starts.
ANSWER_DELAY_S = 0.3
STEPS = 2
#: Cleared by a test that needs journal write number ``HELD_WRITE`` to hold the channel until
#: it says so (the tool then meets the write for sure, however slowly it polls).
WRITES_ANSWERED = threading.Event()
HELD_WRITE = 2


class Supervisor:
    """The supervisor's end of the channel: answers every request frame, after a delay; the
    ``HELD_WRITE``-th journal write only once ``WRITES_ANSWERED`` is set."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.requests: list[str] = []
        self._decoder = msgspec.msgpack.Decoder(_RequestFrame)
        self._thread = threading.Thread(target=self._serve, name="fake-supervisor", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (head := self._read(4)) is not None:
            body = self._read(int.from_bytes(head, "big"))
            if body is None:
                return
            frame = self._decoder.decode(body)
            key = str((frame.body or {}).get("key"))
            self.requests.append(key)
            threading.Event().wait(ANSWER_DELAY_S)
            if key == "journal-write" and self.requests.count(key) == HELD_WRITE:
                WRITES_ANSWERED.wait(10)
            self.sock.sendall(_ResponseFrame(id=frame.id).as_bytes())

    def _read(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:  # the test closed the channel
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@pytest.fixture
def comms(monkeypatch: pytest.MonkeyPatch) -> Iterator[CommsDecoder[Any, Any]]:
    WRITES_ANSWERED.set()
    task_end, supervisor_end = socket.socketpair()
    supervisor = Supervisor(supervisor_end)
    decoder: CommsDecoder[Any, Any] = CommsDecoder(socket=task_end)
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", decoder, raising=False)
    yield decoder
    WRITES_ANSWERED.set()
    task_end.close()  # the supervisor's next read sees the end
    supervisor.join(timeout=5)
    supervisor_end.close()


@dataclass
class ChannelStore(MemoryStore):
    """A store whose every write is a round trip through the task's channel, as Airflow's task
    state store's is."""

    comms: Any = None
    stored: int = 0

    def set(self, key: str, value: Any) -> None:
        self.comms.send(GetVariable(key="journal-write"))
        super().set(key, value)
        self.stored += 1


@dataclass
class AsyncToolTask:
    """An agent whose async tool makes a sync Airflow call, then an async one, on the run's loop
    (``Variable.get`` and ``await aget_connection`` in one tool), once per step."""

    comms: Any
    store: ChannelStore
    calls: list[int] = field(default_factory=list)
    #: In step 2 the tool waits until that step's entry holds the channel (the control), not
    #: "or stored".
    meet_the_writer: bool = False

    def agent(self) -> Agent[None, str]:
        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            done = sum(isinstance(m, ModelResponse) for m in messages)
            if done < STEPS:
                return ModelResponse(parts=[ToolCallPart("probe", {"n": done + 1})])
            return ModelResponse(parts=[TextPart("done")])

        agent: Agent[None, str] = Agent(FunctionModel(model))

        @agent.tool
        async def probe(ctx: RunContext[None], n: int) -> str:
            # This step's entry is in flight (its store call holds the channel) or stored.
            holding = self.comms._thread_lock.locked
            must_meet = self.meet_the_writer and n == HELD_WRITE
            eventually(lambda: holding() or (not must_meet and self.store.stored >= n), timeout=10)
            self.comms.send(GetVariable(key=f"sync-{n}"))
            await self.comms.asend(GetVariable(key=f"async-{n}"))
            self.calls.append(n)
            return "ok"

        return agent

    def run(self, journal: Journal) -> Any:
        scope = journal.scope
        assert scope is not None
        with scope.activate():
            return run_agent_in_scope(scope, self.agent(), "probe twice", journal=journal)


def _journal(store: ChannelStore, **options: Any) -> Journal:
    return Journal(store, try_number=1, scope=TaskCancellation("try1"), returns_flush_s=0, **options)


def test_written_beside_the_tools_a_sync_call_on_the_loop_meets_the_writer(comms: Any) -> None:
    """The control: without the check, step 2's write holds the channel while the tool's sync
    call on the loop (after step 1's async one) is refused."""
    store = ChannelStore(comms=comms)
    task = AsyncToolTask(comms, store, meet_the_writer=True)
    WRITES_ANSWERED.clear()  # step 2's write holds the channel until the tool has met it
    with pytest.raises(DeadlockImminentError):
        task.run(_journal(store))
    assert task.calls == [1]


def test_once_the_loop_used_the_async_api_each_step_is_stored_before_its_tools(
    comms: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = ChannelStore(comms=comms)
    task = AsyncToolTask(comms, store)
    journal = _journal(store, beside_is_safe=lambda: not comms_used_from_a_loop())
    assert not comms_used_from_a_loop()
    with caplog.at_level(logging.INFO, logger="cancellable_agents.durable"):
        result = task.run(journal)
    assert result.output == "done" and task.calls == [1, 2]
    assert comms_used_from_a_loop()
    notes = [r.getMessage() for r in caplog.records if "async API on its event loop" in r.getMessage()]
    assert len(notes) == 1, notes
