"""
Plain functions behind the local hook's transfers: the byte streams that cross into a sandbox's
launch through a pipe, fed by a thread of the worker, and the pipe an export's archive comes back
through, read by another.

A source that is a regular local file goes into the pipe with ``sendfile``: the kernel moves its
pages and no byte passes through Python. Everything else (object storage, text of ``files=``) is
read and written a megabyte at a time. A batch goes in as one tar stream: headers made by
:mod:`tarfile`, the data of each file as above.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ExportSink, ImportEntry, read_export_archive
from sandbox_provider.sandbox.errors import SandboxError

__all__ = ["ArchiveFeed", "ArchiveUnreadable", "ExportReader", "pipe"]

CHUNK = 1024 * 1024
_BLOCK = tarfile.BLOCKSIZE


def pipe() -> tuple[int, int]:
    """A pipe (read end, write end), close-on-exec, with a 1 MiB buffer where the kernel allows it."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, CHUNK)
    return read_end, write_end


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _source_fd(stream: IO[bytes]) -> int | None:
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError):
        return None


def copy_entry(fd: int, entry: ImportEntry) -> None:
    """
    Write exactly ``entry.size`` bytes of the entry's source into ``fd``.

    :raises SandboxError: when the source holds fewer or more bytes than it said.
    """
    with entry.open() as source:
        left = entry.size
        source_fd = _source_fd(source)
        if source_fd is not None:
            offset = source.tell()
            while left > 0:
                sent = os.sendfile(fd, source_fd, offset, min(left, 64 * CHUNK))
                if sent == 0:
                    break
                offset += sent
                left -= sent
            more = os.pread(source_fd, 1, offset) if left == 0 else b""
        else:
            while left > 0 and (data := source.read(min(left, CHUNK))):
                _write_all(fd, data)
                left -= len(data)
            more = source.read(1) if left == 0 else b""
    if left or more:
        raise SandboxError(f"The source for {entry.path!r} does not hold the {entry.size} bytes it reported.")


def header(entry: ImportEntry, mtime: float) -> bytes:
    """The tar header of one regular file of a batch import (PAX, so long names and sizes fit)."""
    info = tarfile.TarInfo(entry.path)
    info.size = entry.size
    info.mode = 0o644
    info.mtime = int(mtime)
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class ArchiveFeed:
    """
    A thread that writes ``entries`` into a new pipe: as a tar stream (``archive=True``), or the one
    entry's bytes alone. :attr:`read_end` goes to the launch as its standard input; :meth:`finish`
    waits for the thread and returns what stopped it (None when it wrote everything).
    """

    def __init__(self, entries: Sequence[ImportEntry], *, archive: bool) -> None:
        self.read_end, self._write_end = pipe()
        self.error: BaseException | None = None
        self._entries, self._archive = list(entries), archive
        self._thread = threading.Thread(target=self._feed, name="sandbox-stage", daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        now = time.time()
        try:
            for entry in self._entries:
                if self._archive:
                    _write_all(self._write_end, header(entry, now))
                copy_entry(self._write_end, entry)
                if self._archive and entry.size % _BLOCK:
                    _write_all(self._write_end, bytes(_BLOCK - entry.size % _BLOCK))
            if self._archive:
                _write_all(self._write_end, bytes(2 * _BLOCK))
        except BrokenPipeError:
            self.error = BrokenPipeError("the sandbox stopped reading")
        except BaseException as err:  # handed to the caller by finish()
            self.error = err
        finally:
            os.close(self._write_end)

    def finish(self, timeout: float = 30.0) -> BaseException | None:
        self._thread.join(timeout)
        return self.error


class ArchiveUnreadable(SandboxError):
    """The stream out of the sandbox was no tar archive (it failed before writing one, say)."""


class ExportReader:
    """
    A thread that reads the export archive written into a new pipe's :attr:`write_end` (the launch's
    standard output), checks it and feeds ``sink`` (:func:`~sandbox_provider.sandbox.batch.read_export_archive`).
    """

    def __init__(self, requests: Sequence[ExportRequest], sink: ExportSink, limits: ExportLimits) -> None:
        read_end, self.write_end = pipe()
        self._stream = io.BufferedReader(io.FileIO(read_end, "rb"), buffer_size=CHUNK)
        self.total = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(requests, sink, limits), daemon=True)
        self._thread.start()

    def _read(self, requests, sink, limits) -> None:
        try:
            if self._stream.peek(1):  # nothing at all: every request matched nothing, or it failed first
                self.total = read_export_archive(self._stream, requests, sink, limits=limits)
        except tarfile.TarError as err:
            self.error = ArchiveUnreadable(f"The sandbox sent an archive that cannot be read: {err}")
        except BaseException as err:  # handed to the caller by finish()
            self.error = err
        finally:
            self._stream.close()  # a launch still writing gets EPIPE and stops

    def finish(self, timeout: float = 30.0) -> BaseException | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return SandboxError("The export archive did not end after the sandbox's launch did.")
        return self.error


def run_with(
    launch: Callable[[], Any], *, finish: Callable[[], BaseException | None]
) -> tuple[Any, BaseException | None]:
    """Run ``launch`` then ``finish``, even when ``launch`` raises: ``(its result, finish's error)``."""
    try:
        result = launch()
    except BaseException:
        finish()
        raise
    return result, finish()
