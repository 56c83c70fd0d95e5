"""
Batch transfers: many files (a directory tree, a glob's matches) in one step per direction.

The contract is two methods of :class:`~sandbox_provider.sandbox.hook.SandboxHook`,
``import_batch`` and ``export_batch``, whose defaults here loop over the per-file operations, so
every backend keeps working; a backend with a faster way (one archive through one launch or one
request) overrides them. :func:`read_export_archive` checks a tar stream that came out of a sandbox
(treated as hostile) and hands its files to an :class:`ExportSink`, so a backend that produces one
gets the checks of the contract without writing them again.
"""

from __future__ import annotations

import fnmatch
import posixpath
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError

__all__ = [
    "ExportBudget",
    "ExportLimits",
    "ExportRequest",
    "ExportSink",
    "ImportEntry",
    "default_export_batch",
    "default_import_batch",
    "glob_base",
    "is_glob",
    "joined_name",
    "read_export_archive",
]

#: The kinds of :class:`ExportRequest`.
EXPORT_KINDS = ("file", "tree", "glob")
#: How deep the default walk of a tree goes before it gives up (a symlink loop, say).
MAX_TREE_DEPTH = 64
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class ImportEntry:
    """
    One file to write into a sandbox.

    :param path: the sandbox path of one regular file (relative paths resolve in the workdir).
    :param size: the exact number of bytes ``open()`` yields.
    :param open: returns a fresh binary stream at its first byte; called at most once; the importer
        closes it.
    :param local_path: the source's path when it is a regular file on the worker (already checked,
        symlinks followed), for a backend that copies it natively; None otherwise.
    :param walked: ``(worker directory, sandbox directory)`` when a directory walk found this plain
        file (not a symlink) below the worker directory, at the same relative path as ``path`` has
        below the sandbox directory: a backend may hand such files to a native archiver by their
        relative names (which must not follow a symlink that replaced one since). None otherwise.
    """

    path: str
    size: int
    open: Callable[[], IO[bytes]]
    local_path: str | None = None
    walked: tuple[str, str] | None = None


@dataclass(frozen=True)
class ExportRequest:
    """
    What to copy out of a sandbox: ``kind`` ``"file"`` (one regular file, named by its basename),
    ``"tree"`` (every regular file below a directory, named relative to it) or ``"glob"`` (the
    matches of a shell pattern, named relative to its leading directory; directories among them as
    trees). Resolved in the sandbox, symlinks followed as it sees them.
    """

    path: str
    kind: str = "file"

    def __post_init__(self) -> None:
        if self.kind not in EXPORT_KINDS:
            raise ValueError(f"ExportRequest.kind must be one of {EXPORT_KINDS}, got {self.kind!r}.")


@dataclass(frozen=True)
class ExportLimits:
    """
    Bounds of one export batch: ``max_file_bytes`` per file and ``max_total_bytes`` for all its files
    together (bytes), ``max_files`` files at most.
    """

    max_file_bytes: int
    max_total_bytes: int
    max_files: int = 100_000


class ExportSink(Protocol):
    """
    Where an export batch puts its files (the engine's ``.partial`` copies). For each file the
    backend calls :meth:`begin`, writes every byte to the stream it returns, then :meth:`end`; files
    never interleave. The backend never closes the stream.
    """

    def begin(self, index: int, name: str) -> IO[bytes]:
        """A writable binary stream for file ``name`` (relative, normalized) of request ``index``."""
        ...

    def end(self, index: int, name: str, size: int) -> None:
        """The file is complete: ``size`` bytes were written."""
        ...

    # Optional, for a backend that writes a batch's files in place itself (the local one):
    # ``local_directory(index) -> str | None``, a local directory path, not there yet, that the
    # backend may create and fill with request ``index``'s files (tree and glob requests), and
    # ``adopt(index, files)``, which records the ``{name: size}`` it put there, checked.


def is_glob(path: str) -> bool:
    """True when ``path`` holds a shell pattern character (``*``, ``?`` or ``[``)."""
    return any(char in _GLOB_CHARS for char in path)


def glob_base(pattern: str) -> tuple[str, list[str]]:
    """``(leading directory without pattern characters, the pattern's remaining components)``."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    fixed: list[str] = []
    while parts and not is_glob(parts[0]):
        fixed.append(parts.pop(0))
    base = "/".join(fixed)
    if pattern.startswith("/"):
        return "/" + base, parts
    return base or ".", parts


# -- checks every implementation shares -----------------------------------------------------------------


class ExportBudget:
    """Counts files and bytes of one batch against its :class:`ExportLimits`."""

    def __init__(self, limits: ExportLimits) -> None:
        self.limits = limits
        self.files = 0
        self.total = 0

    def admit(self, request: ExportRequest, name: str, size: int) -> None:
        """:raises SandboxFileTooLargeError, SandboxError: before a file of ``size`` bytes is copied."""
        if size > self.limits.max_file_bytes:
            raise SandboxFileTooLargeError(joined_name(request, name), size, self.limits.max_file_bytes)
        if self.total + size > self.limits.max_total_bytes:
            raise SandboxFileTooLargeError(request.path, self.total + size, self.limits.max_total_bytes)
        self.files += 1
        if self.files > self.limits.max_files:
            raise SandboxError(
                f"The export of {request.path!r} holds more than {self.limits.max_files} files; export fewer "
                "(a narrower glob, say), or pack them into one archive in the sandbox and export that."
            )

    def left(self) -> int:
        return min(self.limits.max_file_bytes, self.limits.max_total_bytes - self.total)


def joined_name(request: ExportRequest, name: str) -> str:
    """The sandbox path of file ``name`` (relative to the request's directory) of ``request``."""
    if request.kind == "file":
        return request.path
    base = glob_base(request.path)[0] if request.kind == "glob" else request.path
    return posixpath.join(base, name)


def check_member_name(name: str) -> str | None:
    """``name`` normalized if it is a safe relative name, else None (absolute, ``..``, NUL, empty)."""
    if not name or "\0" in name or name.startswith("/"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


# -- reading an archive that came out of a sandbox ------------------------------------------------------


def read_export_archive(
    stream: IO[bytes], requests: Sequence[ExportRequest], sink: ExportSink, *, limits: ExportLimits
) -> int:
    """
    Check the tar stream ``stream`` (concatenated archives are read as one) and hand its regular
    files to ``sink``; return the bytes handed over.

    Every member's name starts with the index of its request (``"0/sub/a.csv"``); directories are
    skipped. Anything else (a link, device, FIFO, a name outside its request or given twice, a file
    over a limit) fails the whole batch before a byte of that member reaches the sink.

    :raises SandboxError: naming the member refused; :class:`SandboxFileTooLargeError` for a limit.
    """
    budget = ExportBudget(limits)
    seen: set[tuple[int, str]] = set()
    with tarfile.open(fileobj=stream, mode="r|", ignore_zeros=True) as archive:
        for member in archive:
            index, name = _member_place(member.name, requests)
            if member.isdir() and name is not None:
                continue
            if index is None or name is None:
                raise SandboxError(f"The sandbox sent an archive member named {member.name!r}, outside the export.")
            request = requests[index]
            if not member.isreg():
                raise SandboxError(
                    f"{joined_name(request, name)!r} is not a regular file in the sandbox ({_kind(member)}); "
                    "export regular files only."
                )
            if (index, name) in seen:
                raise SandboxError(f"The sandbox sent {joined_name(request, name)!r} twice in one export.")
            seen.add((index, name))
            budget.admit(request, name, member.size)
            _copy_member(archive, member, sink, index, name)
            budget.total += member.size
    return budget.total


def _member_place(raw: str, requests: Sequence[ExportRequest]) -> tuple[int | None, str | None]:
    if raw.startswith("./"):
        raw = raw[2:]
    head, _, rest = raw.partition("/")
    if not head.isdigit() or int(head) >= len(requests):
        return None, None
    name = check_member_name(rest)
    if name is None and rest.strip("/.") == "":
        return int(head), None if requests[int(head)].kind == "file" else ""
    return int(head), name


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "a symbolic link"
    if member.islnk():
        return "a hard link"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a FIFO"
    return "not a file"


#: Members up to this size are read from the archive's stream at once (no file object per member).
_SMALL_MEMBER = 1024 * 1024


def _copy_member(archive: tarfile.TarFile, member: tarfile.TarInfo, sink: ExportSink, index: int, name: str) -> None:
    out = sink.begin(index, name)
    copied = 0
    if member.size <= _SMALL_MEMBER and not member.sparse:
        # The stream sits at the member's data; the archive skips its padding on the next member.
        data = archive.fileobj.read(member.size) if member.size else b""
        out.write(data)
        copied = len(data)
    elif (source := archive.extractfile(member)) is not None:
        while chunk := source.read(1024 * 1024):
            out.write(chunk)
            copied += len(chunk)
    if copied != member.size:
        raise SandboxError(f"The sandbox's archive ended inside {name!r}.")
    sink.end(index, name, copied)


# -- the defaults: one file at a time -------------------------------------------------------------------


class FileMoves(Protocol):
    """What the default batches use of a hook: its one-file operations (a ``SandboxHook`` has them)."""

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int: ...

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int: ...

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]: ...


def default_import_batch(hook: FileMoves, handle: str, entries: Sequence[ImportEntry]) -> int:
    """Write each entry with ``hook.import_file``; return the bytes written."""
    total = 0
    for entry in entries:
        with entry.open() as source:
            written = hook.import_file(handle, entry.path, source)
        if written != entry.size:
            raise SandboxError(f"The source for {entry.path!r} gave {written} bytes, not the {entry.size} it reported.")
        total += written
    return total


def default_export_batch(
    hook: FileMoves, handle: str, requests: Sequence[ExportRequest], sink: ExportSink, *, limits: ExportLimits
) -> int:
    """Copy each request's files with ``hook.export_file``, walking trees with ``list_directory``."""
    budget = ExportBudget(limits)
    for index, request in enumerate(requests):
        if request.kind == "file":
            _export_one(hook, handle, budget, sink, index, request, request.path, posixpath.basename(request.path))
        elif request.kind == "tree":
            hook.list_directory(handle, request.path)  # missing or not a directory: its error
            _walk(hook, handle, budget, sink, index, request, request.path, "", [], 0)
        else:
            base, pattern = glob_base(request.path)
            _walk(hook, handle, budget, sink, index, request, base, "", pattern, 0)
    return budget.total


def _export_one(hook, handle, budget: ExportBudget, sink: ExportSink, index, request, path: str, name: str) -> None:
    room = budget.left()
    stream = sink.begin(index, name)
    try:
        size = hook.export_file(handle, path, stream, max_bytes=room)
    except SandboxFileTooLargeError as err:
        if room < budget.limits.max_file_bytes:
            raise SandboxFileTooLargeError(
                request.path, budget.total + err.size_bytes, budget.limits.max_total_bytes
            ) from err
        raise
    budget.admit(request, name, size)
    budget.total += size
    sink.end(index, name, size)


def _walk(hook, handle, budget, sink, index, request, directory: str, prefix: str, pattern: list[str], depth: int):
    """Export what ``directory`` holds (matching ``pattern``'s first component, if any), recursively."""
    if depth > MAX_TREE_DEPTH:
        raise SandboxError(f"{directory!r} is nested more than {MAX_TREE_DEPTH} levels deep (a symlink loop?).")
    try:
        entries = hook.list_directory(handle, directory)
    except SandboxError:
        if pattern:
            return  # a glob whose fixed part is missing matches nothing
        raise
    for entry, is_dir in entries:
        if pattern and not _matches(entry, pattern[0]):
            continue
        path, name = posixpath.join(directory.rstrip("/") or "/", entry), posixpath.join(prefix, entry)
        rest = pattern[1:]
        if rest:
            if is_dir:
                _walk(hook, handle, budget, sink, index, request, path, name, rest, depth + 1)
            continue
        if is_dir:
            _walk(hook, handle, budget, sink, index, request, path, name, [], depth + 1)
            continue
        try:
            _export_one(hook, handle, budget, sink, index, request, path, name)
        except SandboxFileTooLargeError:
            raise
        except SandboxError as err:
            if "is a directory" not in str(err):
                raise
            # A symlink to a directory: the trailing "/" makes the listing go through it.
            _walk(hook, handle, budget, sink, index, request, path + "/", name, [], depth + 1)


def _matches(entry: str, pattern: str) -> bool:
    if entry.startswith(".") and not pattern.startswith("."):
        return False
    return fnmatch.fnmatchcase(entry, pattern)
