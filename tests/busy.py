"""Run a command while busy loops take the machine's cores: ``python -m tests.busy [-n N] -- CMD``.

``make test-under-load`` runs the process suite and the pod e2e this way: one spinning process
per core (``-n``, default ``os.cpu_count()``), as another CI lane and its Airflow stack would
take them. The loops are plain ``while True: pass`` processes at the default priority, in their
own process group; they stop when the command ends, on Ctrl-C, or by themselves after
``--max-minutes`` (so a forgotten run cannot keep a machine busy). Exits with the command's code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

SPIN = "import time\ndeadline = time.monotonic() + {seconds}\nwhile time.monotonic() < deadline:\n    pass\n"


def start_loops(count: int, seconds: float) -> list[subprocess.Popen[bytes]]:
    """``count`` spinning processes that end by themselves after ``seconds``."""
    code = SPIN.format(seconds=seconds)
    return [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(count)]


def stop_loops(loops: list[subprocess.Popen[bytes]]) -> None:
    for loop in loops:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)
    for loop in loops:
        loop.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-n", "--loops", type=int, default=os.cpu_count() or 1, help="busy loops (one per core)"
    )
    parser.add_argument(
        "--max-minutes", type=float, default=60.0, help="the loops stop by themselves after this"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.loops < 0 or args.max_minutes <= 0:
        parser.error("--loops must be >= 0 and --max-minutes > 0")
    loops = start_loops(args.loops, args.max_minutes * 60)
    started = time.monotonic()
    print(f"[busy] {args.loops} busy loop(s) running beside: {' '.join(command)}", flush=True)
    try:
        return subprocess.call(command)
    finally:
        stop_loops(loops)
        print(f"[busy] loops stopped after {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
