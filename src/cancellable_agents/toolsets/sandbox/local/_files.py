"""The file tools' access to a workdir that a running command may be changing under them.

A command runs at the same time as the file tools (one model response can call ``run_shell``
and ``read_file`` in parallel), and it can swap any folder of its workdir for a symlink at any
moment. Resolving a path and then opening it by name races that swap: the open would follow a
symlink the check never saw, with the task's privileges (root on a root worker). So nothing
here opens a path by name from ``/``: every open starts at a descriptor of the workdir and
follows no symlink at any component, with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``
where the kernel has it (Linux 5.6+), else one ``openat(O_NOFOLLOW)`` per component, each
from the descriptor of the folder before (a write always walks: it may create folders). Files
and folders the tools create are handed to the sandbox's uid with ``fchown`` on their
descriptor, never by name.

A path through a symlink is refused ([`SandboxPathError`][]), also one that would stay
inside: the tools cannot tell a command's honest link from a swap. ``run_shell`` follows links
as the sandbox's uid, inside the sandbox's view.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import heapq
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cancellable_agents.toolsets.sandbox.protocol import SandboxPathError

if TYPE_CHECKING:
    from cancellable_agents.toolsets.sandbox.local.boundary._bwrap import BoundaryProfile

__all__ = [
    "LIST_LIMIT",
    "WorkdirFileTools",
    "WorkdirFiles",
    "openat2_supported",
    "outside_error",
    "shown_name",
]

#: Names ``list_files`` returns at most (its bytes are capped by ``output_limit`` as well).
LIST_LIMIT = 1000

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall-table merge)
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
    while True:
        fd = int(_libc.syscall(_SYS_OPENAT2, dir_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        # EAGAIN: a rename raced a lookup the kernel could not prove safe; it asks for a retry.
        if code not in (errno.EINTR, errno.EAGAIN):
            raise OSError(code, os.strerror(code), path)


@functools.cache
def openat2_supported() -> bool:
    """Whether this kernel has ``openat2`` (and no container filter denies it), probed once."""
    try:
        root = os.open("/", _DIR_FLAGS)
    except OSError:
        return False
    try:
        os.close(_openat2(root, ".", _DIR_FLAGS))
        return True
    except OSError:
        return False
    finally:
        os.close(root)


class WorkdirFiles:
    """Read, write and list files under ``workdir`` without following any symlink.

    ``owner``: the uid (and gid) that files and folders this creates are given (a root
    worker's sandbox runs as a uid of its own); ``None`` leaves them the task's.
    ``use_openat2``: ``None`` uses it where the kernel has it; ``False`` forces the
    per-component walk (tests run both).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        output_limit: int,
        owner: int | None = None,
        use_openat2: bool | None = None,
        list_limit: int = LIST_LIMIT,
    ) -> None:
        self.workdir = workdir
        self.output_limit = output_limit
        self.list_limit = list_limit
        self.owner = owner
        self.use_openat2 = openat2_supported() if use_openat2 is None else use_openat2

    def parts(self, path: str) -> list[str]:
        """``path`` as components below the workdir (``[]``: the workdir itself).

        ``..`` is resolved by name, which is exact here because no component may be a symlink.
        Raises [`SandboxPathError`][] for a path outside the workdir.
        """
        joined = os.path.normpath(os.path.join(self.workdir, path))
        relative = os.path.relpath(joined, self.workdir)
        if relative == os.curdir:
            return []
        if relative == os.pardir or relative.startswith(os.pardir + os.sep):
            raise outside_error(path)
        return relative.split(os.sep)

    def read_file(self, path: str) -> str:
        """The file's text (undecodable bytes replaced), capped at ``output_limit`` bytes."""
        # O_NONBLOCK: a FIFO the command made must not hang the tool (regular files ignore it).
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            self._require_regular(fd, path)
            data = _read_up_to(fd, self.output_limit + 1)
        text = data[: self.output_limit].decode("utf-8", "replace")
        if len(data) > self.output_limit:
            text += f"\n[... truncated after {self.output_limit} bytes ...]"
        return text

    def write_file(self, path: str, content: str) -> int:
        """Write ``content`` (UTF-8), creating parent folders; return the bytes written."""
        parts = self.parts(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        data = content.encode("utf-8")
        with self._folder(parts[:-1], path, create=True) as parent:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = self._call(lambda: os.open(parts[-1], flags, 0o644, dir_fd=parent), path)
            try:
                self._require_regular(fd, path)
                self._hand_over(fd)
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        return len(data)

    def list_files(self, path: str = ".") -> list[str]:
        """Names in a folder, sorted; folders end with ``/`` (a symlink to one does not).

        Names are the command's, shown to the model: each is escaped as by [`shown_name`][]
        (control characters, backslashes, undecodable bytes), so none can carry a terminal
        sequence or a line break into the model's context. At most ``list_limit`` names, of at
        most ``output_limit`` bytes in all, come back, like ``read_file``'s cap (a command can
        make millions of files); past that the last entry says how many names were left out,
        in words no name can be (it has a ``/`` inside).
        """
        with self._folder(self.parts(path), path, create=False) as fd, os.scandir(fd) as entries:
            names = (e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
            return _capped_listing(names, self.list_limit, self.output_limit)

    # -- opening -------------------------------------------------------------------------

    @contextmanager
    def _open(self, path: str, flags: int) -> Iterator[int]:
        parts = self.parts(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        with self._folder(parts[:-1], path, create=False) as parent:
            fd = self._call(
                lambda: os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent), path
            )
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _folder(self, parts: list[str], path: str, *, create: bool) -> Iterator[int]:
        """A descriptor of the folder ``parts`` below the workdir, reached without a symlink
        (created, and handed to the owner, where missing and ``create``)."""
        fd = os.open(self.workdir, _DIR_FLAGS)
        try:
            if parts and self.use_openat2 and not create:
                beneath = self._call(lambda: _openat2(fd, os.path.join(*parts), _DIR_FLAGS), path)
                os.close(fd)
                fd = beneath
            else:
                for name in parts:
                    child = self._step(fd, name, path, create=create)
                    os.close(fd)
                    fd = child
            yield fd
        finally:
            os.close(fd)

    def _step(self, parent: int, name: str, path: str, *, create: bool) -> int:
        """Open ``name`` in ``parent`` as a folder, not following a symlink; make it if asked."""
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
            else:
                child = self._call(lambda: os.open(name, _DIR_FLAGS, dir_fd=parent), path)
                self._hand_over(child)
                return child
        try:
            return self._call(lambda: os.open(name, _DIR_FLAGS, dir_fd=parent), path)
        except NotADirectoryError:
            # O_DIRECTORY | O_NOFOLLOW on a symlink says ENOTDIR: name the real reason.
            if _is_link(parent, name):
                raise _through_link(path) from None
            raise

    @staticmethod
    def _call(open_: Callable[[], int], path: str) -> int:
        """Run one open, turning a symlink met on the way into [`SandboxPathError`][], and
        naming ``path`` (the model's, not a component) in the other errors."""
        try:
            return open_()
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise _through_link(path) from None
            raise type(exc)(exc.errno, exc.strerror, path) from None

    @staticmethod
    def _require_regular(fd: int, path: str) -> None:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise SandboxPathError(f"path {path!r} is not a regular file")

    def _hand_over(self, fd: int) -> None:
        """What the task writes for a command running as the sandbox's own uid is that uid's, or
        the command could read but never change it; by descriptor, so it is the file just opened."""
        if self.owner is not None:
            os.fchown(fd, self.owner, self.owner)


def _capped_listing(names: Iterator[str], limit: int, output_limit: int) -> list[str]:
    """The first ``limit`` of ``names`` in order, shown escaped, cut before their bytes (UTF-8,
    as shown) pass ``output_limit``, then an entry saying how many were left out (if any)."""
    counted = _Counted(names)
    first = heapq.nsmallest(limit, counted)  # without holding the whole folder in memory
    shown: list[str] = []
    size = 0
    for name in first:
        size += len(shown_name(name).encode())
        if size > output_limit:
            break
        shown.append(shown_name(name))
    left_out = counted.count - len(shown)
    if left_out:
        cap = f"a listing stops at {limit} names / {output_limit} bytes"
        shown.append(f"[... {left_out} more names not listed ({cap}) ...]")
    return shown


class _Counted:
    """An iterator that counts what it yields (the folder's size, read once)."""

    def __init__(self, items: Iterator[str]) -> None:
        self._items = items
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        for item in self._items:
            self.count += 1
            yield item


def shown_name(name: str) -> str:
    """``name`` as the model is shown it, repr-style: a backslash is ``\\\\``, a character that
    is not printable (``< 0x20``, ``0x7f``, C1 controls, bidi and other format characters)
    its ``repr`` escape (``\\n``, ``\\r``, ``\\x1b``, ``\\u202e``), a byte that is not UTF-8
    ``\\xNN``; anything else as it is. A name shown escaped is not a path the file tools take
    back (``run_shell`` can reach it)."""
    if name.isprintable() and "\\" not in name:
        return name
    return "".join(_shown_char(c) for c in name)


def _shown_char(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable():
        return char
    if 0xDC80 <= ord(char) <= 0xDCFF:  # os.fsdecode's stand-in for a byte that is not UTF-8
        return f"\\x{ord(char) - 0xDC00:02x}"
    return repr(char)[1:-1]


def outside_error(path: str) -> SandboxPathError:
    """The error for a path outside the workdir (the model reads it and retries)."""
    return SandboxPathError(
        f"path {path!r} is outside the sandbox working directory; use a path relative to it"
    )


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False  # gone again: the ENOTDIR stands


def _through_link(path: str) -> SandboxPathError:
    return SandboxPathError(
        f"path {path!r} goes through a symbolic link; the file tools follow none (run_shell can use it)"
    )


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class WorkdirFileTools:
    """A sandbox's file tools on its workdir (``resolve``, ``read_file``, ``write_file``,
    ``list_files``: the [`SandboxFiles`][cancellable_agents.toolsets.sandbox.protocol.SandboxFiles]
    protocol), each through a [`WorkdirFiles`][]; mixed into ``LocalSandbox``, whose workdir,
    output limit and boundary (the uid its commands run as) they read."""

    workdir: Path
    output_limit: int
    _boundary: BoundaryProfile | None

    def resolve(self, path: str) -> Path:
        """``path`` (relative to the workdir, or absolute inside it) with symlinks resolved, for
        showing; the file tools never open what this returns (a command may swap it meanwhile).

        Raises [`SandboxPathError`][] if it points outside the workdir.
        """
        resolved = self.workdir.joinpath(*self._files().parts(path)).resolve()
        if resolved != self.workdir and self.workdir not in resolved.parents:
            raise outside_error(path)
        return resolved

    def _files(self) -> WorkdirFiles:
        """The workdir's race-free file access; what it creates is handed to the sandbox's uid."""
        owner = self._boundary.uid if self._boundary is not None else None
        return WorkdirFiles(self.workdir, output_limit=self.output_limit, owner=owner)

    def read_file(self, path: str) -> str:
        """The file's text (undecodable bytes replaced), capped at ``output_limit`` bytes."""
        return self._files().read_file(path)

    def write_file(self, path: str, content: str) -> int:
        """Write ``content`` (UTF-8), creating parent directories; return the bytes written."""
        return self._files().write_file(path, content)

    def list_files(self, path: str = ".") -> list[str]:
        """Names in a directory, sorted; directories end with ``/``. Escaped and capped as
        [`WorkdirFiles.list_files`][cancellable_agents.toolsets.sandbox.local._files.WorkdirFiles.list_files]
        says."""
        return self._files().list_files(path)
