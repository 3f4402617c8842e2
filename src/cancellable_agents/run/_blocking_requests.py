"""Model requests a blocking SDK makes in a worker thread, closed on the socket when the scope is cancelled.

Most model SDKs are async (httpx): a cancelled run cancels the task awaiting the request, which
closes its connection at once. botocore (Bedrock) is not: pydantic-ai runs each call in an AnyIO
worker thread (``anyio.to_thread.run_sync(..., abandon_on_cancel=True)``), and a cancel only stops
*waiting* for that thread. The thread stays blocked in the socket read until the model answers or
botocore's read timeout (60 s) passes, with the request open; and as a non-daemon thread it holds the
task process at its exit until Airflow's SIGKILL (measured before this module: the request open
5,018 ms, the task SIGKILLed). pydantic-ai closes a stream that has started
(``BedrockStreamedResponse.close_stream``), but not a request still waiting for its answer's first
byte (the model thinking, or any non-streaming ``converse``).

So, for each botocore HTTP request sent inside a run (the scope is
[`current_cancellation`][cancellable_agents.core.scope.current_cancellation]; AnyIO copies the
context into its worker threads), the connection it is sent on is noted until ``send`` returns
(an event stream's: until its body is released, which older pydantic-ai never closes on a cancel)
([`watch_botocore`][] wraps ``URLLib3Session.send`` and ``AWSConnection.request``, once per
process). The scope's first such request registers one ``Phase.IN_FLIGHT`` resource,
which on a cancel shuts the noted sockets down (``SHUT_RDWR``): the blocked read returns at once, the
server sees the request closed, and the thread ends. What the thread then raises becomes
[`RequestCancelled`][], which botocore's retry handlers do not retry, so no new request follows the
cancel; a request that starts after the cancel is refused the same way before it is sent. The
timeline shows ``blocking_requests_closed`` (how many, in what time). Airflow-free.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref
from typing import Any

from cancellable_agents.core.scope import Phase, TaskCancellation, current_cancellation

#: Marks the wrapped functions, so wrapping is idempotent.
_HOOKED = "_cancellable_agents_blocking_hook"
_hook_lock = threading.Lock()
_registry_lock = threading.Lock()
_by_scope: weakref.WeakKeyDictionary[TaskCancellation, _Requests] = weakref.WeakKeyDictionary()
#: The requests of the scope whose ``send`` runs on this thread (``None`` outside one).
_sending = threading.local()


class RequestCancelled(Exception):
    """A blocking model request whose scope was cancelled: its socket was shut down, or it was
    refused before it was sent. Not a botocore error, so botocore does not retry it."""


class _Requests:
    """The connections one scope's blocking requests are in flight on, and whether it was cancelled."""

    def __init__(self, scope: TaskCancellation) -> None:
        self.scope = scope
        self.lock = threading.Lock()
        self.connections: set[Any] = set()  # guarded by lock
        #: Set by `close`; already set for a scope cancelled before its first request (its late
        #: release runs on a thread of its own, which a request must not outrun).
        self.closed = scope.cancelled  # guarded by lock

    def add(self, connection: Any) -> None:
        """Note ``connection`` (a request is about to be sent on it); refuse it after the cancel."""
        with self.lock:
            if not self.closed:
                self.connections.add(connection)
                return
        raise RequestCancelled(f"{self.scope.name} was cancelled: no new model request")

    def discard(self, connection: Any) -> None:
        with self.lock:
            self.connections.discard(connection)

    def close(self) -> None:
        """The scope was cancelled: shut down every socket a request is blocked on (a resource)."""
        started = self.scope.now()
        with self.lock:
            self.closed = True
            connections = list(self.connections)
        shut = sum(_shut_down(connection) for connection in connections)
        self.scope.record(
            "blocking_requests_closed", requests=shut, took_ms=round((self.scope.now() - started) * 1000, 1)
        )


def _shut_down(connection: Any) -> bool:
    """Shut ``connection``'s socket down both ways; whether there was one to shut."""
    sock = getattr(connection, "sock", None)
    if not isinstance(sock, socket.socket):
        return False
    with contextlib.suppress(OSError):  # already closed by the peer or by botocore
        sock.shutdown(socket.SHUT_RDWR)
    return True


def _requests_of(scope: TaskCancellation) -> _Requests:
    """The scope's requests, registered with it (``Phase.IN_FLIGHT``) the first time."""
    with _registry_lock:
        requests = _by_scope.get(scope)
        if requests is not None:
            return requests
        requests = _by_scope[scope] = _Requests(scope)
    scope.register(requests.close, name="blocking model requests", phase=Phase.IN_FLIGHT)
    return requests


def watch_botocore() -> bool:
    """Wrap botocore's ``URLLib3Session.send`` and ``AWSConnection.request`` (idempotent); return
    whether botocore's requests are watched. A botocore without them (renamed) is left alone."""
    try:
        from botocore import awsrequest, httpsession
    except ImportError:
        return False
    session_type = getattr(httpsession, "URLLib3Session", None)
    connection_type = getattr(awsrequest, "AWSConnection", None)
    send = getattr(session_type, "send", None)
    request = getattr(connection_type, "request", None)
    if send is None or request is None:
        return False
    with _hook_lock:
        if getattr(send, _HOOKED, False):
            return True

        def send_watched(self: Any, http_request: Any) -> Any:
            scope = current_cancellation()
            if scope is None:
                return send(self, http_request)
            requests = _requests_of(scope)
            outer = getattr(_sending, "current", None)
            sent_on: list[Any] = []
            _sending.current = (requests, sent_on)
            try:
                response = send(self, http_request)
                if getattr(http_request, "stream_output", False):
                    # An event stream is read after ``send`` returned: noted until it is released.
                    _forget_on_release(response, requests, list(sent_on))
                    sent_on.clear()
                return response
            except RequestCancelled:
                raise
            except Exception as exc:
                if requests.closed:
                    raise RequestCancelled(
                        f"{scope.name} was cancelled: its model request was closed"
                    ) from exc
                raise
            finally:
                _sending.current = outer
                for connection in sent_on:
                    requests.discard(connection)

        def request_watched(self: Any, *args: Any, **kwargs: Any) -> Any:
            current: tuple[_Requests, list[Any]] | None = getattr(_sending, "current", None)
            if current is not None:
                requests, sent_on = current
                requests.add(self)  # noted until the answer was read: ``send`` returned
                sent_on.append(self)
            return request(self, *args, **kwargs)

        setattr(send_watched, _HOOKED, True)
        setattr(request_watched, _HOOKED, True)
        session_type.send = send_watched  # type: ignore[union-attr]
        connection_type.request = request_watched  # type: ignore[union-attr]
        return True


def _forget_on_release(response: Any, requests: _Requests, connections: list[Any]) -> None:
    """Forget ``connections`` once ``response``'s body is released or closed (urllib3's
    ``release_conn``/``close``, wrapped on this response); where they cannot be wrapped, the
    connections stay noted until the scope ends (shutting an idle one down then is harmless)."""
    raw = getattr(response, "raw", None)

    def forgetting(inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for connection in connections:
                requests.discard(connection)
            return inner(*args, **kwargs)

        return call

    for name in ("release_conn", "close"):
        inner = getattr(raw, name, None)
        if inner is not None:
            with contextlib.suppress(AttributeError):
                setattr(raw, name, forgetting(inner))
