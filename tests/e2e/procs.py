"""/proc helpers: find processes by an argv marker, and check a pid is the task's supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PROC = Path("/proc")


def cmdline(pid: int) -> str:
    """The process's argv joined by spaces ('' for zombies, kernel threads and vanished pids)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def marked_processes(marker: str) -> dict[int, str]:
    """Live (non-zombie) processes whose argv contains ``marker``: pid -> cmdline."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        line = cmdline(int(entry.name))
        if marker in line:
            found[int(entry.name)] = line
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL every process carrying ``marker`` (only the tests' own trees carry it)."""
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def ancestors(pid: int) -> list[int]:
    """The chain of parent pids of ``pid`` up to (excluding) pid 0."""
    chain = []
    while pid > 1:
        try:
            stat = (PROC / str(pid) / "stat").read_text()
        except OSError:
            break
        pid = int(stat.rpartition(")")[2].split()[1])
        chain.append(pid)
    return chain
