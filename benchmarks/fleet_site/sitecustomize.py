"""Times Airflow's task heartbeats for ``benchmarks/fleet.py``: on ``PYTHONPATH`` of the fleet's
Airflow only, and only where ``FLEET_HEARTBEAT_LOG`` is set.

The heartbeat is sent by each task's supervisor (not the task process), through the Task SDK's
``httpx`` client: every request whose path ends in ``/heartbeat`` appends one JSON line (wall
time, milliseconds, status, pid) to the file ``FLEET_HEARTBEAT_LOG`` names. Imported by every
Python process of the stack at start, so the supervisors, forked later, inherit the wrapper.
Where ``FLEET_GC_LOG`` is set, every process also notes its garbage collections of 20 ms or more
there: one in the API server stops every request in flight. Where ``FLEET_GC_SAMPLES`` is set,
the API server notes there every ``GC_SAMPLE_S`` how many collections of each generation it
made so far and how many objects its oldest generation holds (a full collection comes once the
objects promoted into it since the last one outnumber a quarter of those it held then). Where
``FLEET_API_GC_FREEZE`` is set (``--api-gc-freeze S``), the API server freezes what it holds S
seconds after it starts.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _install(path: str) -> None:
    import httpx

    send = httpx.Client.send

    def timed_send(self: httpx.Client, request: httpx.Request, **kwargs: object) -> httpx.Response:
        if not request.url.path.endswith("/heartbeat"):
            return send(self, request, **kwargs)  # type: ignore[arg-type]
        started, status = time.perf_counter(), -1
        try:
            response = send(self, request, **kwargs)  # type: ignore[arg-type]
            status = response.status_code
            return response
        finally:
            line = {
                "at": time.time(),
                "ms": round((time.perf_counter() - started) * 1000, 3),
                "status": status,
                "pid": os.getpid(),
            }
            with open(path, "a") as out:  # one short line per write: appends do not interleave
                out.write(json.dumps(line) + "\n")

    httpx.Client.send = timed_send  # type: ignore[method-assign]


#: Collections shorter than this are not noted (every process collects many times a second).
GC_NOTE_MS = 20.0


def _note_collections(path: str) -> None:
    """Append one line per garbage collection of ``GC_NOTE_MS`` or more (wall time at its end,
    milliseconds, generation, objects collected, pid): a collection stops every thread
    of its process, so in the one API server process it stalls every request in flight."""
    import gc

    began: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - began[0]) * 1000
        if ms < GC_NOTE_MS:
            return
        line = {
            "at": time.time(),
            "ms": round(ms, 1),
            "gen": info.get("generation"),
            "collected": info.get("collected"),
            "pid": os.getpid(),
        }
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")

    gc.callbacks.append(callback)


#: How often the API server notes its collections so far and its oldest generation's size.
GC_SAMPLE_S = 2.0


def _sample_generations(path: str) -> None:
    """Every ``GC_SAMPLE_S``, one line (wall time, pid, collections so far by generation, objects
    in the oldest generation): where its objects come from, phase by phase."""
    import gc
    import threading

    def sample() -> None:
        while True:
            line = {
                "at": time.time(),
                "pid": os.getpid(),
                "api_collections": [s["collections"] for s in gc.get_stats()],
                "gen2_objects": len(gc.get_objects(generation=2)),
            }
            with open(path, "a") as out:
                out.write(json.dumps(line) + "\n")
            time.sleep(GC_SAMPLE_S)

    threading.Thread(target=sample, name="fleet-gc-sample", daemon=True).start()


def _freeze_later(after_s: float) -> None:
    """``after_s`` seconds from now, move every object the process holds to the permanent
    generation (``gc.freeze``, as Airflow's dag-processor does after its start): a full
    collection then walks only what came later, not the whole application. What was garbage
    then is never freed (a few MB of a start)."""
    import gc
    import threading

    def freeze() -> None:
        time.sleep(after_s)
        gc.freeze()  # no collection first: a full one is the stall this is meant to avoid

    threading.Thread(target=freeze, name="fleet-gc-freeze", daemon=True).start()


if sys.argv[1:2] == ["api-server"]:  # `python -m airflow api-server`; its workers inherit this
    os.environ["FLEET_API_SERVER"] = "1"
if os.environ.get("FLEET_API_GC_FREEZE") and os.environ.get("FLEET_API_SERVER"):
    _freeze_later(float(os.environ["FLEET_API_GC_FREEZE"]))
if os.environ.get("FLEET_HEARTBEAT_LOG"):
    _install(os.environ["FLEET_HEARTBEAT_LOG"])
if os.environ.get("FLEET_GC_LOG"):
    _note_collections(os.environ["FLEET_GC_LOG"])
if os.environ.get("FLEET_GC_SAMPLES") and os.environ.get("FLEET_API_SERVER"):
    _sample_generations(os.environ["FLEET_GC_SAMPLES"])
