"""Headless Chromium (the Debian package) driven over the DevTools protocol, for UI checks.

Only what the UI tests need: log in as the UI does, open a page with its auth cookie, wait for
text to render, read the page's text, click, type into a field, take a screenshot. Chromium runs in
its own session with a fresh profile directory and no network beyond loopback (no sync, no
component updates, no QUIC); ``close`` ends exactly the process group it started.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.e2e.airflow_stack import free_port, wait_until

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def chromium_binary() -> str | None:
    """The Debian package's ``chromium`` (``make system-deps`` installs it), if installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def ui_cookie(url: str, username: str, password: str) -> tuple[str, str, str]:
    """The UI's session cookie for ``Chromium.page``, as the UI's login page gets it."""
    response = httpx.post(f"{url}/auth/token", json={"username": username, "password": password}, timeout=30)
    assert response.status_code == 201, response.text
    return "_token", response.json()["access_token"], url


class Page:
    """One tab: commands are sent and their answers awaited; events in between are skipped."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        """Every DevTools event received so far (``Network.*`` once ``Network.enable`` was sent)."""

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            if "method" in message:
                self.events.append(message)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise AssertionError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def text(self) -> str:
        return str(self.evaluate("document.body ? document.body.innerText : ''") or "")

    def wait_for_text(self, needle: str, timeout: float = 30.0) -> str:
        """The page's text once it shows ``needle`` (the UI renders after its API calls answer)."""
        return wait_until(
            lambda: (text := self.text()) and needle in text and text,
            timeout,
            f"the page to show {needle!r}",
            interval=0.2,
            on_timeout=lambda: self.text()[-3000:],
        )

    def click_text(self, tag: str, label: str) -> None:
        """Click the first ``tag`` element whose text or aria-label is ``label``."""
        script = (
            f"(() => {{ const el = [...document.querySelectorAll({json.dumps(tag)})].find(e => "
            f"(e.innerText || '').trim() === {json.dumps(label)} || "
            f"e.getAttribute('aria-label') === {json.dumps(label)}); if (!el) return false; "
            "el.click(); return true; })()"
        )
        if not self.evaluate(script):
            raise AssertionError(f"no <{tag}> labelled {label!r} on the page:\n{self.text()[-2000:]}")

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element matching the CSS ``selector`` and type ``text`` into it as the
        keyboard does (a value set from script is not seen by the UI's React form state)."""
        script = (
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); if (!el) return false; "
            "el.focus(); return document.activeElement === el; })()"
        )
        if not self.evaluate(script):
            raise AssertionError(f"no focusable {selector!r} on the page:\n{self.text()[-2000:]}")
        self.call("Input.insertText", text=text)

    def wait_for_response(
        self, url_part: str, timeout: float = 30.0, method: str | None = None
    ) -> tuple[int, str]:
        """Status and body of the first response whose URL contains ``url_part`` (to a ``method``
        request, if given: the UI also reads what it writes; the page must have sent
        ``Network.enable`` before the request)."""

        def finished() -> tuple[int, str] | None:
            self.call("Runtime.evaluate", expression="0")  # drains the events received so far
            sent = [e for e in self.events if e["method"] == "Network.responseReceived"]
            ids = {e["params"]["requestId"]: e for e in sent if url_part in e["params"]["response"]["url"]}
            if method is not None:
                requests = [e["params"] for e in self.events if e["method"] == "Network.requestWillBeSent"]
                asked = {r["requestId"] for r in requests if r["request"]["method"] == method}
                ids = {request_id: e for request_id, e in ids.items() if request_id in asked}
            for event in self.events:
                request_id = event["params"].get("requestId")
                if event["method"] == "Network.loadingFinished" and request_id in ids:
                    body = self.call("Network.getResponseBody", requestId=request_id)["body"]
                    return int(ids[request_id]["params"]["response"]["status"]), str(body)
            return None

        return wait_until(finished, timeout, f"a response from {url_part}", interval=0.2)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path


class Chromium:
    """A headless Chromium with a fresh profile; one DevTools connection per page."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.port = free_port()
        profile.mkdir(parents=True, exist_ok=True)
        args = [f"--user-data-dir={profile}", f"--remote-debugging-port={self.port}", "about:blank"]
        self.proc = subprocess.Popen(
            [binary, *FLAGS, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own group: close() ends all of Chromium's processes
            env={**os.environ, "TMPDIR": str(profile)},  # its singleton socket dir goes with the profile
        )
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        wait_until(self._ready, 30, "Chromium's DevTools endpoint", interval=0.1)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"chromium exited with {self.proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            return self._http.get("/json/version").status_code == 200
        return False

    @contextlib.contextmanager
    def page(self, cookie: tuple[str, str, str] | None = None) -> Iterator[Page]:
        """A new tab; ``cookie`` is ``(name, value, url)`` set before anything loads."""
        target = self._http.put("/json/new?about:blank").json()
        with connect(target["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10) as ws:
            page = Page(ws)
            page.call("Page.enable")
            if cookie is not None:
                name, value, url = cookie
                page.call("Network.enable")
                page.call("Network.setCookie", name=name, value=value, url=url, httpOnly=True)
            yield page

    def close(self) -> None:
        self._http.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
