"""
Plain functions behind the local hook's transfers: the byte streams that cross into a sandbox's
launch through a pipe, fed by a thread of the worker, and the pipe an export's archive comes back
through, read by another.

A source that is a regular local file goes into the pipe with ``sendfile``: the kernel moves its
pages and no byte passes through Python. Everything else (object storage, text of ``files=``) is
read and written a megabyte at a time. A batch goes in as one tar stream: headers made by
:mod:`tarfile`, the data of each file as above; the many plain files a directory walk found go last,
archived by the worker's own GNU ``tar`` straight into the pipe (``native_split``), run by bubblewrap
in a mount namespace where only the walked directory and the worker's programs exist, so a link in
the tree, even a directory swapped for one after the walk, leads nowhere outside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import os
import posixpath
import shutil
import signal
import stat
import subprocess
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
#: A directory walk's plain files go to the worker's ``tar`` from this many on; fewer get tarfile headers.
NATIVE_MIN_FILES = 32
#: Where the worker's ``tar`` sees the walked directory, and what else of the worker it sees (read-only).
_WALKED = "/walked"
_PROGRAMS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32")
_DELIMITERS = ",|#:;@%!~"


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


def regular_fd(stream: IO[bytes]) -> int | None:
    """The descriptor of ``stream`` when it is a regular file; else None."""
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
        source_fd = regular_fd(source)
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


@functools.cache
def host_tar() -> str | None:
    """The worker's GNU ``tar``, looked up once per process; None when there is none."""
    found = shutil.which("tar", path="/usr/bin:/bin")
    if found is None:
        return None
    try:
        version = subprocess.run([found, "--version"], capture_output=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return found if b"GNU tar" in version else None


def _transform(prefix: str) -> list[str] | None:
    """GNU tar's options putting every member under the sandbox directory ``prefix``; None if it cannot say it."""
    if prefix in ("", "."):
        return []
    delimiter = next((d for d in _DELIMITERS if d not in prefix), None)
    if delimiter is None or any(c in prefix for c in "\n\r"):
        return None
    target = (prefix if prefix.endswith("/") else prefix + "/").replace("\\", "\\\\").replace("&", "\\&")
    return ["--transform", f"s{delimiter}^{delimiter}{target}{delimiter}SH"]


def native_split(entries: Sequence[ImportEntry]) -> tuple[list[ImportEntry], list[ImportEntry]]:
    """
    ``(entries for tarfile headers, in their order; the walked plain files the worker's tar archives
    after them)``: the biggest group of one directory walk, of at least :data:`NATIVE_MIN_FILES`,
    when no other entry lands on one of its paths (so moving it last changes no outcome).
    """
    groups: dict[tuple[str, str], list[ImportEntry]] = {}
    for entry in entries:
        if entry.walked is not None and entry.local_path is not None:
            groups.setdefault(entry.walked, []).append(entry)
    if not groups or host_tar() is None:
        return list(entries), []
    key, group = max(groups.items(), key=lambda item: len(item[1]))
    if len(group) < NATIVE_MIN_FILES or _transform(key[1]) is None:
        return list(entries), []
    rest = [entry for entry in entries if entry.walked != key]
    if rest:
        landing = {posixpath.normpath(entry.path) for entry in group}
        if any(posixpath.normpath(entry.path) in landing for entry in rest):
            return list(entries), []
    return rest, group


def confined(bwrap: str, top: str) -> list[str]:
    """
    bubblewrap's command line (up to ``--``) running a worker program in a mount namespace of its own
    where only the worker's programs and ``top`` (at ``/walked``) exist, read-only: a link in ``top``
    that leads out of it finds nothing. The worker's own user (in a user namespace of its own when
    it is not root, as bubblewrap then needs one to mount).
    """
    argv = [bwrap, "--die-with-parent"] + ([] if os.geteuid() == 0 else ["--unshare-user"])
    for path in _PROGRAMS:
        argv += ["--ro-bind-try", path, path]
    return [*argv, "--ro-bind", top, _WALKED, "--"]


def archive_natively(fd: int, group: Sequence[ImportEntry], mtime: float, *, bwrap: str) -> None:
    """
    Write ``group`` (one walk's plain files, see :func:`native_split`) into ``fd`` as a tar archive
    made by the worker's GNU ``tar``, :func:`confined` to the walked directory by ``bwrap``: names
    given relative to it, links never followed (a file replaced by a symlink since the walk goes in
    as that symlink; a directory replaced by one leads nowhere outside), regular files stored as the
    tarfile headers would say them (mode 0644, owner 0, ``mtime``).

    :raises BrokenPipeError: the sandbox stopped reading; :raises SandboxError: tar failed, saying why.
    """
    top, prefix = group[0].walked or ("", "")
    tar = host_tar()
    transform = _transform(prefix)
    if tar is None or transform is None:
        raise SandboxError(f"The worker cannot archive the files below {top} natively.")
    argv = [*confined(bwrap, top), tar, "-c", "-f", "-", "-P", "--format=gnu", "--no-recursion", "--hard-dereference"]
    argv += ["--owner=0", "--group=0", "--numeric-owner", "--mode=644", f"--mtime=@{int(mtime)}", *transform]
    argv += ["-C", _WALKED, "--null", "--verbatim-files-from", "-T", "-"]
    start = len(top.rstrip("/")) + 1
    names = b"".join(os.fsencode(entry.local_path[start:]) + b"\0" for entry in group if entry.local_path)
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    )
    _, err = proc.communicate(names)
    if proc.returncode in (-signal.SIGPIPE, 128 + signal.SIGPIPE):  # tar's own, or as bubblewrap reports it
        raise BrokenPipeError("the sandbox stopped reading")
    if proc.returncode != 0:
        lines = [line for line in err.decode(errors="replace").splitlines() if "Exiting with failure" not in line]
        raise SandboxError(f"Could not read the files below {top}: {lines[0] if lines else proc.returncode}")


class ArchiveFeed:
    """
    A thread that writes ``entries`` into a new pipe: as a tar stream (``archive=True``), or the one
    entry's bytes alone. :attr:`read_end` goes to the launch as its standard input; :meth:`finish`
    waits for the thread and returns what stopped it (None when it wrote everything). ``bwrap``
    confines the worker's ``tar`` (:func:`archive_natively`); without it every file gets tarfile headers.
    """

    def __init__(self, entries: Sequence[ImportEntry], *, archive: bool, bwrap: str | None = None) -> None:
        self.read_end, self._write_end = pipe()
        self.error: BaseException | None = None
        native = archive and bwrap is not None
        self._entries, self._native = native_split(entries) if native else (list(entries), [])
        self._bwrap = bwrap or ""
        self._archive = archive
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
            if self._native:
                archive_natively(self._write_end, self._native, now, bwrap=self._bwrap)  # its end of archive ends it
            elif self._archive:
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
