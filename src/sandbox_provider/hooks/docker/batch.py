"""
Batch transfers of the Docker backend: a whole mapping in one exec per direction, as tar through
the exec's standard streams, run in the sandbox as its command user.

Why not the Engine's archive API (``put_archive`` / ``get_archive``)? The Engine runs it as root,
outside the sandbox's view: it would write where the command user cannot, follow (or not) symbolic
links by its own rules, and read files the user cannot read, and a command could plant a symlink
that turns a later transfer against the keeper's own files. A ``tar`` run through exec as the
command user meets permissions and symlinks exactly as a command does, and the archive travels
over the exec socket, so the cost is one exec per direction however many files move.

- **In** (``import_batch``): the worker builds the archive with :mod:`tarfile`'s header writer as it
  streams (never more than one 1 MiB piece in memory), its exact size known beforehand (the exec's
  standard input cannot be half-closed over TLS), and ``guest/stage.sh`` extracts it (in the command's own exec when the files are staged with it).
- **Out** (``export_batch``): ``guest/export_tree.sh`` writes one archive per request, one after
  another, and :func:`~sandbox_provider.sandbox.batch.read_export_archive` checks every member
  (treated as hostile) before its bytes reach the sink.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
import time
from collections.abc import Sequence

from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ExportSink, ImportEntry, glob_base
from sandbox_provider.sandbox.errors import SandboxError

__all__ = ["ArchivePipe", "ImportArchive", "export_arguments", "export_failure", "import_failure"]

#: Bytes read from a source at a time while the archive is built.
PIECE_BYTES = 1024 * 1024
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE
#: The status of ``stage.sh`` (and of the runner) when the archive could not be extracted.
STAGE_FAILED_STATUS, STAGE_FAILED_MARK = 125, "sandbox-stage-failed"


def _padded(size: int, unit: int) -> int:
    return -(-size // unit) * unit


class ImportArchive:
    """
    A tar archive of ``entries``, read like a file, built while it is read; :attr:`size` is its exact
    length in bytes. A source that fails, or yields more or fewer bytes than its entry says, is
    padded or cut to keep the archive whole, and :attr:`error` names it (raise it after the copy).
    """

    def __init__(self, entries: Sequence[ImportEntry], *, uid: int, gid: int) -> None:
        now = int(time.time())
        self._headers = []
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.size, info.mode, info.mtime, info.uid, info.gid = int(entry.size), 0o644, now, uid, gid
            self._headers.append(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
        self._entries = list(entries)
        body = sum(len(h) + _padded(e.size, _BLOCK) for h, e in zip(self._headers, self._entries, strict=True))
        self.size = _padded(body + 2 * _BLOCK, _RECORD)
        self.error: SandboxError | None = None
        self._pieces = self._generate()
        self._pending = b""

    def read(self, n: int = -1) -> bytes:
        while not self._pending:
            try:
                self._pending = next(self._pieces)
            except StopIteration:
                return b""
        if n < 0 or n >= len(self._pending):
            piece, self._pending = self._pending, b""
        else:
            piece, self._pending = self._pending[:n], self._pending[n:]
        return piece

    def _generate(self):
        written = 0
        for header, entry in zip(self._headers, self._entries, strict=True):
            yield header
            copied = yield from self._body(entry)
            yield bytes(_padded(copied, _BLOCK) - copied)
            written += len(header) + _padded(copied, _BLOCK)
        yield bytes(self.size - written)

    def _body(self, entry: ImportEntry):
        copied = 0
        try:
            with entry.open() as source:
                while copied < entry.size:
                    piece = source.read(min(PIECE_BYTES, entry.size - copied))
                    if not piece:
                        break
                    copied += len(piece)
                    yield piece
                extra = source.read(1) if copied == entry.size else b""
        except Exception as err:  # reported once the copy is over; the archive stays whole
            self._fail(SandboxError(f"Could not read the source for {entry.path!r}: {type(err).__name__}: {err}"))
            extra = b""
        if copied != entry.size or extra:
            self._fail(SandboxError(f"The source for {entry.path!r} did not hold the {entry.size} bytes it reported."))
        while copied < entry.size:  # keep the archive whole; the file is refused afterwards
            filler = min(PIECE_BYTES, entry.size - copied)
            copied += filler
            yield bytes(filler)
        return copied

    def _fail(self, error: SandboxError) -> None:
        if self.error is None:
            self.error = error


def import_failure(entries: Sequence[ImportEntry], stderr: str) -> SandboxError:
    """The error for ``stage.sh`` failing: the first entry tar names, and what it said."""
    said = [line[5:] for line in stderr.splitlines() if line.startswith("tar: ") and "Exiting with" not in line]
    for line in said:
        for entry in entries:
            if line.startswith(entry.path + ": "):
                return SandboxError(f"Could not write {entry.path!r} into the sandbox: {line[len(entry.path) + 2 :]}")
    detail = said[0] if said else "tar could not extract the archive"
    return SandboxError(f"Could not write the staged files into the sandbox: {detail}")


def export_arguments(requests: Sequence[ExportRequest]) -> list[str]:
    """The arguments of ``export_tree.sh`` for ``requests``."""
    args: list[str] = []
    for request in requests:
        if request.kind == "glob":
            base, pattern = glob_base(request.path)
            args += ["glob", base + "\n" + "/".join(pattern)]
        else:
            args += [request.kind, request.path]
    return args


def export_failure(requests: Sequence[ExportRequest], code: int, stderr: str) -> SandboxError:
    """The error for ``export_tree.sh`` ending with status ``code`` and ``stderr``."""
    from sandbox_provider.sandbox.files import file_status_error

    found = re.findall(r"sandbox-export-failed:(\d+)", stderr)
    index = int(found[-1]) if found else -1
    request = requests[index] if 0 <= index < len(requests) else None
    path = request.path if request is not None else "the export"
    if request is not None and request.kind == "tree" and code == guest.NOT_REGULAR_STATUS:
        return SandboxError(f"{path!r} is not a directory in the sandbox.")
    known = file_status_error(code, path)
    if known is not None:
        return known
    said = [line for line in stderr.splitlines() if line.startswith("tar: ") and "Exiting with" not in line]
    lines = said or [line for line in stderr.splitlines() if line.strip() and "sandbox-export-failed:" not in line]
    detail = lines[0] if lines else f"exit status {code}"
    return SandboxError(f"Could not export {path!r} from the sandbox: {detail}")


class ArchivePipe:
    """
    Feeds an exec's standard output to :func:`read_export_archive` in a thread of its own, through
    a pipe (so a slow sink slows the exec, and nothing piles up in memory).
    """

    def __init__(self, requests: Sequence[ExportRequest], sink: ExportSink, limits: ExportLimits) -> None:
        read_fd, self._write_fd = os.pipe()
        self._reader = os.fdopen(read_fd, "rb", buffering=PIECE_BYTES)
        self.total = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(requests, sink, limits), daemon=True)
        self._thread.start()

    def _read(self, requests: Sequence[ExportRequest], sink: ExportSink, limits: ExportLimits) -> None:
        from sandbox_provider.sandbox.batch import read_export_archive

        try:
            self.total = read_export_archive(self._reader, requests, sink, limits=limits)
        except BaseException as err:  # raised in the caller's thread by finish()
            self.error = err
        finally:
            self._reader.close()  # the exec's next write fails, which stops it

    def write(self, data: bytes) -> None:
        """Hand on a piece of the archive; raises once the reader has stopped."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._write_fd, view) :]

    def finish(self) -> None:
        """End the archive and wait for the reader. :raises: what the reader raised."""
        try:
            os.close(self._write_fd)
        except OSError:
            pass
        self._thread.join()
        if self.error is not None:
            raise self.error
