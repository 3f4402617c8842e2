"""The e2e harness's REST client sends one write at a time (tests/e2e/airflow_stack.py: RestClient).

Concurrent writes self-deadlock Airflow's api-server on SQLite for 5 s each (its audit-log commit
runs on the event loop), which once ended the scheduler mid-suite. Checked against a real HTTP
server on loopback that holds each write until another request arrives (or half a second passes).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.e2e.airflow_stack import RestClient

#: How long the server holds a write open waiting for another request to arrive beside it.
HOLD_S = 0.5


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writes_in_flight = 0
        self.most_writes_at_once = 0
        self.writes_seen_by_reads: list[int] = []
        self.arrived = threading.Condition(self.lock)


def _server(recorder: Recorder) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: dict[str, str]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/auth/token":
                return self._answer(201, {"access_token": "token"})
            with recorder.arrived:
                recorder.writes_in_flight += 1
                recorder.most_writes_at_once = max(recorder.most_writes_at_once, recorder.writes_in_flight)
                recorder.arrived.notify_all()
                # Hold it until some other request arrives beside it (or HOLD_S passes).
                recorder.arrived.wait(HOLD_S)
                recorder.writes_in_flight -= 1
            return self._answer(200, {})

        def do_GET(self) -> None:
            with recorder.arrived:
                recorder.writes_seen_by_reads.append(recorder.writes_in_flight)
                recorder.arrived.notify_all()
            return self._answer(200, {})

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def served() -> Iterator[tuple[RestClient, Recorder]]:
    recorder = Recorder()
    server = _server(recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = RestClient(f"http://127.0.0.1:{server.server_address[1]}", "admin", "password")
    try:
        yield client, recorder
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_writes_from_several_threads_reach_the_server_one_at_a_time(
    served: tuple[RestClient, Recorder],
) -> None:
    client, recorder = served
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda _: client.request("POST", "/write", retry=False), range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    assert recorder.most_writes_at_once == 1


def test_a_read_does_not_wait_for_a_write_in_flight(served: tuple[RestClient, Recorder]) -> None:
    client, recorder = served
    with ThreadPoolExecutor(max_workers=1) as pool:
        write = pool.submit(client.request, "POST", "/write", retry=False)
        with recorder.arrived:
            assert recorder.arrived.wait_for(lambda: recorder.writes_in_flight == 1, 5)
        assert client.request("GET", "/read").status_code == 200
        assert write.result(5).status_code == 200
    assert recorder.writes_seen_by_reads == [1], "the read waited for the write to be answered"
