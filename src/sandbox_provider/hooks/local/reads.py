"""
Reading a local sandbox's file from the worker's side of its workspace, without a launch, when the
answer is the one the sandbox itself would give.

Every other file operation runs inside the sandbox, so a path resolves the way the sandbox sees it.
A read of a plain file of the workspace needs no launch for that: the worker opens it through the
workspace directory one component at a time, never following a symlink, and takes the bytes only
if every directory on the way and the file itself belong to the sandbox's user with the owner
permission a read needs, the file is a regular one within the byte budget, and it held the same
size from the first byte read to the last. Anything else (a symlink anywhere, a path outside the
workdir, another owner, a mode that forbids it, a FIFO, a file over the budget or changing) is left
to the sandbox's own read, which gives its usual answer and error.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from collections.abc import Callable
from typing import Any

from sandbox_provider.hooks.local import state
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT
from sandbox_provider.sandbox.nofollow import DIR_FLAGS
from sandbox_provider.sandbox.spec import check_byte_count, check_path

__all__ = ["HostReads", "read_plain_file"]

_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _parts(path: str, workdir: str) -> list[str] | None:
    """
    The components of ``path`` below ``workdir``; None if it is not below, or holds a ``..``, whose
    meaning depends on what the components before it are (a symlink's ``..`` is its target's parent).
    """
    names = [name for name in posixpath.join(workdir, path).split("/") if name not in ("", ".")]
    top = [name for name in workdir.split("/") if name]
    if ".." in names or len(names) <= len(top) or names[: len(top)] != top:
        return None
    return names[len(top) :]


def _owned(info: os.stat_result, uid: int, kind: Callable[[int], bool], permission: int) -> bool:
    return kind(info.st_mode) and info.st_uid == uid and bool(info.st_mode & permission)


def read_plain_file(workspace: str, workdir: str, path: str, *, uid: int, max_bytes: int) -> bytes | None:
    """
    The bytes of the sandbox path ``path`` read through ``workspace`` (the host directory mounted at
    ``workdir``), or None when the sandbox must read it itself (see the module).

    :param uid: the host user id the sandbox's processes run as.
    :param max_bytes: the most bytes to return; a bigger file is left to the sandbox (None).
    """
    parts = _parts(path, workdir)
    if parts is None:
        return None
    try:
        fd = os.open(workspace, DIR_FLAGS)
    except OSError:
        return None
    try:
        for name in [".", *parts[:-1]]:
            # The first step checks the workspace itself.
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            if not _owned(os.fstat(fd), uid, stat.S_ISDIR, stat.S_IXUSR):
                return None
        child = os.open(parts[-1], _FILE, dir_fd=fd)
        os.close(fd)
        fd = child
        info = os.fstat(fd)
        if not _owned(info, uid, stat.S_ISREG, stat.S_IRUSR) or info.st_size > max_bytes:
            return None
        data = _read_upto(fd, max_bytes + 1)
        if len(data) != info.st_size or os.fstat(fd).st_size != info.st_size:
            return None  # changing while read: the sandbox's read reports it its own way
        return data
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_upto(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        piece = os.read(fd, min(left, 1024 * 1024))
        if not piece:
            break
        chunks.append(piece)
        left -= len(piece)
    return b"".join(chunks)


class HostReads:
    """Mixin of ``LocalSandboxHook``: :meth:`read_file` from the host side when it can (see the module)."""

    workdir: str
    _plan: Callable[[str], Any]
    _deadline: Callable[[str, float], float]
    check_handle: Callable[[str], str]

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path``, at most ``max_bytes``: a plain file of the
        workspace straight from the worker's side, anything else read inside the sandbox.

        :raises SandboxFileTooLargeError: if it holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, unreadable, a directory or not a regular file.
        :raises SandboxTerminalError: if the sandbox is gone or past its lifetime.
        """
        check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        handle = self.check_handle(handle)
        self._deadline(handle, FILE_OP_TIMEOUT)  # gone or expired: refused as a launch would be
        plan = self._plan(handle)
        workspace = os.path.join(state.box_path(plan.path, plan.limits), "workspace")
        data = read_plain_file(workspace, self.workdir, path, uid=plan.uid, max_bytes=int(max_bytes))
        if data is not None:
            return data
        return super().read_file(handle, path, max_bytes=max_bytes)  # type: ignore[misc]
