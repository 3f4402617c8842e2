"""A real statsd receiver for the tests: a UDP socket on 127.0.0.1 that keeps the lines it gets.

Airflow's statsd backend sends one datagram per metric; with ``[metrics] statsd_influxdb_enabled``
the tags ride in the line (``name,tag=value,...:value|type``), which is what the tests read.
Used by the unit tests (Stats configured in-process) and by the e2e session (every Airflow
component and task process sends here).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

#: How long a datagram sent on loopback may take to arrive (it arrives in microseconds; a
#: task process that sends it may be slower to get there on a loaded machine).
ARRIVAL_TIMEOUT = 10.0


class StatsdReceiver:
    """A UDP socket on 127.0.0.1 that keeps every statsd line it receives (or only those that
    contain ``keep``: an Airflow stack sends its own metrics there too, many per second)."""

    def __init__(self, keep: str = "") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.keep = keep
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="statsd-receiver", daemon=True)
        self._thread.start()

    def airflow_env(self) -> dict[str, str]:
        """The environment that points Airflow's ``Stats`` here."""
        return airflow_statsd_env(self.port)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode(errors="replace").splitlines():
                if self.keep in line:
                    self.lines.put(line)

    def _drain(self, timeout: float) -> None:
        with contextlib.suppress(queue.Empty):
            self.seen.append(self.lines.get(timeout=timeout))
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return

    def wait_for(self, *names: str, timeout: float = ARRIVAL_TIMEOUT) -> dict[str, str]:
        """The first line of each metric in ``names`` (name without tags -> whole line)."""
        deadline = time.monotonic() + timeout
        while True:
            found: dict[str, str] = {}
            for line in self.seen:
                if metric_name(line) in names:
                    found.setdefault(metric_name(line), line)
            if set(found) == set(names):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"missing {sorted(set(names) - set(found))}; received {self.seen}")
            self._drain(remaining)

    def wait_line(self, *parts: str, timeout: float = ARRIVAL_TIMEOUT) -> str:
        """The first line received that holds every one of ``parts``."""
        deadline = time.monotonic() + timeout
        while not (found := [line for line in self.seen if all(p in line for p in parts)]):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line with {parts}; received {self.seen}")
            self._drain(remaining)
        return found[0]

    def wait_metric(self, name: str, timeout: float = ARRIVAL_TIMEOUT, **tags: str) -> str:
        """The first line of the metric ``name`` (without the statsd prefix) that carries ``tags``."""
        deadline = time.monotonic() + timeout
        while not (found := [line for line in self.seen if _is(line, name, tags)]):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {name} line with {tags}; received {self.seen}")
            self._drain(remaining)
        return found[0]

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(2)


def airflow_statsd_env(port: int, prefix: str = "airflow") -> dict[str, str]:
    """The environment that points Airflow's ``Stats`` at ``127.0.0.1:port``, tags in the lines."""
    return {
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(port),
        "AIRFLOW__METRICS__STATSD_PREFIX": prefix,
        "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True",
    }


def _is(line: str, name: str, tags: dict[str, str]) -> bool:
    full = metric_name(line)
    return (full == name or full.endswith(f".{name}")) and tags.items() <= metric_tags(line).items()


def metric_name(line: str) -> str:
    """``airflow.cancellable_agents.kills`` of ``airflow.cancellable_agents.kills,cause=user:1|c``."""
    return line.split(":", 1)[0].split(",", 1)[0]


def metric_tags(line: str) -> dict[str, str]:
    """The tags of an InfluxDB-style statsd line."""
    head = line.split(":", 1)[0].split(",")[1:]
    return dict(item.split("=", 1) for item in head)


def metric_value(line: str) -> str:
    """``1|c``, ``2.5|ms``: the value and its type."""
    return line.split(":", 1)[1]
