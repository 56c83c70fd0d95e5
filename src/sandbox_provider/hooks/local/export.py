"""
Directory exports of the local backend that the sandbox writes straight into their destination's
``.partial`` directory, when every destination of the batch is local storage.

Each request's ``.partial`` directory (made empty and owned by the sandbox's user) is bound into
one launch at ``/.airflow-export/<index>``, where ``export_into.sh`` extracts what
``export_tree.sh`` packs (symlinks followed as the sandbox sees them), so the bytes never pass
through the worker and no archive is parsed in Python. The launch's file-size limit stops a file one
byte past ``max_file_bytes``; ``export_into.sh`` stops tar once the members' sizes pass the batch's
total or their number twice its file limit (:func:`stream_caps`), so no more than that lands on the
worker's disk before the exact checks below.

Nothing written there is trusted: once the launch has ended, and with it the only mount of those
directories any sandbox process had (a destination inside what the sandbox sees otherwise, its own
workspace say, it could change at any time, whichever way the export went), :func:`adopt` walks each one without following anything,
refuses all but directories and regular files, checks the batch's limits, and gives every entry to
the worker (owner, mode 0644 or 0755, no set-id bits) before the engine publishes it. On any failure
the directories are removed whole (iteratively: depth and permissions set inside cannot stop it).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

from sandbox_provider.sandbox.batch import ExportBudget, ExportLimits, ExportRequest, joined_name
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError
from sandbox_provider.sandbox.files import special_kind_of
from sandbox_provider.sandbox.nofollow import DIR_FLAGS, remove_tree

__all__ = ["MOUNT", "adopt", "check_caps", "local_directories", "prepare", "remove", "stream_caps"]

#: Where a request's directory is bound in the export's launch: ``/.airflow-export/<index>``.
MOUNT = "/.airflow-export"
_LONGEST_NAME = 4095  # bytes of a relative name that a later rename can still take (PATH_MAX)


def local_directories(sink: Any, requests: Sequence[ExportRequest]) -> list[str] | None:
    """
    Each request's local ``.partial`` directory, from a sink that offers them
    (``local_directory(index)``); None when the batch cannot go this way (a file request, a sink
    without local directories, a destination on object storage).
    """
    offer: Callable[[int], str | None] | None = getattr(sink, "local_directory", None)
    if offer is None or not requests or any(r.kind == "file" for r in requests):
        return None
    found = [offer(i) for i in range(len(requests))]
    return None if any(d is None for d in found) else [d for d in found if d is not None]


_OVER_BYTES, _OVER_ENTRIES = 71, 72  # export_into.sh's statuses past its caps


def stream_caps(limits: ExportLimits) -> tuple[int, int]:
    """
    ``(bytes of the members' data, members)`` that ``export_into.sh`` lets tar extract before it
    stops it: the batch's total, and its file limit with room for directories (counted as members
    too), so a batch within its limits always fits and one past them stops within one member.
    """
    return limits.max_total_bytes, 2 * limits.max_files + 16


def check_caps(result: Any, requests: Sequence[ExportRequest], limits: ExportLimits) -> None:
    """
    :raises SandboxFileTooLargeError: the archive passed its byte cap (so the batch's total limit);
    :raises SandboxError: it passed its member cap (so the batch's file limit).
    """
    where = requests[0].path if len(requests) == 1 else ", ".join(r.path for r in requests)
    if result.exit_code == _OVER_BYTES:
        raise SandboxFileTooLargeError(where, stream_caps(limits)[0], limits.max_total_bytes)
    if result.exit_code == _OVER_ENTRIES:
        raise SandboxError(
            f"The export of {where!r} holds more than {limits.max_files} files; export fewer (a narrower glob, "
            "say), or pack them into one archive in the sandbox and export that."
        )


def prepare(directories: Sequence[str], uid: int | None) -> list[tuple[str, str]]:
    """
    Make each directory, empty, mode 0700, owned by ``uid`` (None: the worker); return the binds
    ``(host directory, path in the launch)``.

    :raises SandboxError: when one cannot be made (something is already there, say); the ones made
        before it are removed.
    """
    binds = []
    for index, directory in enumerate(directories):
        try:
            os.mkdir(directory, 0o700)
            binds.append((directory, f"{MOUNT}/{index}"))
            if uid is not None:  # through its descriptor: a link put in its place meanwhile is not followed
                fd = os.open(directory, DIR_FLAGS)
                try:
                    os.fchown(fd, uid, uid)
                finally:
                    os.close(fd)
        except OSError as err:
            remove([made for made, _ in binds])  # the ones made so far: nothing is left half prepared
            raise SandboxError(f"Could not make the export directory {directory}: {err.strerror}") from err
    return binds


def remove(directories: Sequence[str]) -> None:
    """Remove each directory and everything in it; what cannot be removed is left for the engine to name."""
    for directory in directories:
        try:
            remove_tree(directory)
        except OSError:
            pass


def adopt(directories: Sequence[str], requests: Sequence[ExportRequest], limits: ExportLimits) -> list[dict[str, int]]:
    """
    Check what the launch wrote into each request's directory and hand it to the worker; return,
    per request, ``{relative name: size in bytes}`` of its files. Called only after the launch ended.

    :raises SandboxFileTooLargeError: a file, or all of them, over ``limits``.
    :raises SandboxError: for anything that is not a directory or regular file, a name too long, or
        more files than ``limits.max_files``.
    """
    budget = ExportBudget(limits)
    owner = (os.geteuid(), os.getegid()) if os.geteuid() == 0 else None
    modes = _modes()
    return [
        _adopt_tree(directory, request, budget, owner, modes)
        for directory, request in zip(directories, requests, strict=True)
    ]


def _adopt_tree(
    top: str, request: ExportRequest, budget: ExportBudget, owner: tuple[int, int] | None, modes: tuple[int, int]
) -> dict[str, int]:
    """
    Depth first, holding open only the directories on the way down (one per level), so a directory
    of many subdirectories costs no more descriptors than a narrow one.
    """
    files: dict[str, int] = {}
    stack: list[tuple[str, int, list[str]]] = []
    try:
        fd = _enter(os.open(top, DIR_FLAGS), owner, modes[1])
        stack.append(("", fd, _adopt_level(fd, "", request, budget, owner, modes[0], files)))
        while stack:
            prefix, fd, subdirectories = stack[-1]
            if not subdirectories:
                os.close(stack.pop()[1])
                continue
            name = subdirectories.pop()
            child = _enter(os.open(name, DIR_FLAGS, dir_fd=fd), owner, modes[1])
            rel = prefix + name + "/"
            stack.append((rel, child, _adopt_level(child, rel, request, budget, owner, modes[0], files)))
    finally:
        for _, fd, _ in stack:
            os.close(fd)
    return files


def _enter(fd: int, owner: tuple[int, int] | None, mode: int) -> int:
    """A directory of the walk, opened: made the worker's, with ``mode``; returns ``fd``."""
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _adopt_level(
    fd: int,
    prefix: str,
    request: ExportRequest,
    budget: ExportBudget,
    owner: tuple[int, int] | None,
    file_mode: int,
    files: dict[str, int],
) -> list[str]:
    """One directory of the walk: its files adopted into ``files``; returns its subdirectories' names."""
    with os.scandir(fd) as listing:
        found = [(entry.name, entry.stat(follow_symlinks=False)) for entry in listing]
    subdirectories = []
    for name, info in found:
        rel = prefix + name
        if len(os.fsencode(rel)) > _LONGEST_NAME:
            raise SandboxError(f"{joined_name(request, rel)[:200]!r}... has a name too long to export.")
        if stat.S_ISDIR(info.st_mode):
            subdirectories.append(name)
        elif stat.S_ISREG(info.st_mode):
            budget.admit(request, rel, info.st_size)
            budget.total += info.st_size
            if owner is not None or info.st_mode & 0o7777 != file_mode:
                _own_file(fd, name, owner, file_mode, joined_name(request, rel))
            files[rel] = info.st_size
        else:
            raise SandboxError(
                f"{joined_name(request, rel)!r} is not a regular file in the sandbox "
                f"({_kind(info.st_mode)}); export regular files only."
            )
    return subdirectories


def _own_file(directory: int, name: str, owner: tuple[int, int] | None, mode: int, shown: str) -> None:
    """
    Give the regular file ``name`` to ``owner`` (the kernel drops set-id bits on chown) and ``mode``,
    through an ``O_PATH`` descriptor of it, so a link put at its name since it was listed is refused
    rather than followed (``chmod`` by name would follow it).
    """
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxError(f"{shown!r} changed into something that is not a regular file while it was checked.")
        here = f"/proc/self/fd/{fd}"  # the file itself: the kernel's link to the open descriptor
        if owner is not None:
            os.chown(here, *owner)
        os.chmod(here, mode)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else special_kind_of(mode) or "not a file"


def _modes() -> tuple[int, int]:
    """Modes for adopted files and directories: 0666 and 0777 under the worker's umask (from /proc)."""
    umask = 0o022
    try:
        with open("/proc/self/status") as f:
            umask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), umask)
    except OSError:
        pass
    return 0o666 & ~umask, 0o777 & ~umask
