"""What the kill metrics cost the unwind: metrics off vs statsd to a dead port vs a live receiver.

``.venv/bin/python -m benchmarks.metrics_cost [--reps N]``. One process, modes interleaved per
repetition (so machine load hits them alike). Each repetition: a fresh operator runs an agent
whose async tool waits; a real SIGTERM to this process is handled as the Task SDK handles it
(``on_kill`` on the main thread), the run unwinds, the record is logged, the metrics are sent
(:mod:`cancellable_agents.airflow._metrics`), and ``execute`` raises. Reported per mode, median
and max (ms):

- **signal -> unwound**: ``kill_received`` -> ``run_unwound`` from the kill record;
- **signal -> raised**: SIGTERM sent -> ``TaskCancelled`` caught: includes writing the record
  and emitting every metric, so a backend that costs anything shows here.

Stats is set up as ``task_runner.main()`` sets it up (``[metrics] statsd_on``, host, port from
the environment, then ``stats.initialize``). "dead" is a loopback port nobody listens on: every
datagram draws an ICMP port-unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import statistics
import threading
import time
from typing import Any

MODES = ("off", "statsd-dead", "statsd-live")


def _free_port() -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def _use(mode: str, live_port: int, dead_port: int) -> None:
    """Point Airflow's Stats at this mode's receiver (as the Task SDK's ``main()`` does)."""
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics import stats_utils

    if mode == "off":
        stats.initialize(factory=NoStatsLogger, export_legacy_names=False)
        return
    os.environ["AIRFLOW__METRICS__STATSD_ON"] = "True"
    os.environ["AIRFLOW__METRICS__STATSD_HOST"] = "127.0.0.1"
    os.environ["AIRFLOW__METRICS__STATSD_PORT"] = str(live_port if mode == "statsd-live" else dead_port)
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)


def _one_kill() -> tuple[float, float]:
    """(signal -> unwound, signal -> raised) in ms for one real SIGTERM of a real run."""
    from airflow.sdk.bases.operator import BaseOperator
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    from cancellable_agents import CancellableAgentMixin, TaskCancelled

    started = threading.Event()

    class Waits(CancellableAgentMixin, BaseOperator):
        def execute(self, context: Any) -> Any:
            agent = Agent(TestModel(call_tools=["wait"]))

            @agent.tool_plain
            async def wait() -> str:
                started.set()
                await asyncio.Event().wait()
                return "never"

            return self.run_agent_sync(agent, "go").output

    op = Waits(task_id="bench", reap_descendants=False)
    signal.signal(signal.SIGTERM, lambda *_: op.on_kill())  # the Task SDK's handler, in short
    sent: list[float] = []

    def kill() -> None:
        if started.wait(30):
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        op.execute({})
    except TaskCancelled:
        raised = time.perf_counter()
    else:
        raise RuntimeError("the run was not cancelled")
    finally:
        killer.join(30)
    record = op.cancellation.summary()
    unwound = next(e["ms"] for e in record["timeline"] if e["event"] == "run_unwound")
    return unwound, (raised - sent[0]) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the record is logged per kill; not what is measured
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    live_port, dead_port = receiver.getsockname()[1], _free_port()
    drain = threading.Thread(target=lambda: _drain(receiver), daemon=True)
    drain.start()
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up: imports and the first statsd client are not what is measured
        _use(mode, live_port, dead_port)
        _one_kill()
    for _ in range(args.reps):
        for mode in MODES:
            _use(mode, live_port, dead_port)
            results[mode].append(_one_kill())
    print(f"| mode ({args.reps} reps) | signal -> unwound median / max | signal -> raised median / max |")
    print("| --- | --- | --- |")
    for mode, rows in results.items():
        unwound, raised = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"| {mode} | {statistics.median(unwound):.2f} / {max(unwound):.2f} ms "
            f"| {statistics.median(raised):.2f} / {max(raised):.2f} ms |"
        )
    return 0


def _drain(sock: socket.socket) -> None:
    while True:
        sock.recv(65535)


if __name__ == "__main__":
    raise SystemExit(main())
