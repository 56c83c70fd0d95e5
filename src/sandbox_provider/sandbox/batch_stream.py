"""
Batch transfers over an exec that streams both ways (the Docker and Kubernetes backends): a whole
mapping in one program per direction, as tar through the program's standard streams, run in the
sandbox as the user its commands run as, so permissions and symbolic links apply exactly as a command
meets them, and the cost is one exec per direction however many files move.

- **In** (``import_batch``): the worker builds the archive with :mod:`tarfile`'s header writer as it
  streams (never more than one 1 MiB piece in memory), its exact size known beforehand (neither
  Docker's exec over TLS nor Kubernetes' exec channel protocol v4 can half-close standard input), and
  ``guest/stage.sh`` extracts it (in the command's own exec when the files are staged with it).
- **Out** (``export_batch``): ``guest/export_tree.sh`` writes one archive per request, one after
  another, and :func:`~sandbox_provider.sandbox.batch.read_export_archive` checks every member
  (treated as hostile) before its bytes reach the sink.

:class:`ExecTransfers` is the mixin that gives such a backend its file operations and batches.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, ClassVar, cast

from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ExportSink, ImportEntry, glob_base
from sandbox_provider.sandbox.errors import SandboxError
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, OutputSink, RunOutcome
from sandbox_provider.sandbox.spec import SandboxExecResult, check_path

__all__ = [
    "ArchivePipe",
    "ExecTransfers",
    "ImportArchive",
    "StagedErrors",
    "check_utf8_command",
    "export_arguments",
    "export_failure",
    "import_failure",
    "is_utf8",
    "transfer_allowance",
]

#: Bytes read from a source at a time while the archive is built.
PIECE_BYTES = 1024 * 1024
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE
#: Seconds a batch is allowed per file it may move, on top of its bytes' share: a tree of many small files
#: costs a header, a file to open and a sink's begin and end per file, whatever its bytes.
SECONDS_PER_FILE = 0.002
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
        #: the reader had stopped while the exec still wrote: its error, not the exec's end, stopped the export
        self.refused = False
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
        """Hand on a piece of the archive; raises once the reader has stopped (and :attr:`refused` is set)."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._write_fd, view) :]
        except OSError:
            self.refused = True
            raise

    def finish(self) -> None:
        """End the archive and wait for the reader. :raises: what the reader raised."""
        try:
            os.close(self._write_fd)
        except OSError:
            pass
        self._thread.join()
        if self.error is not None:
            raise self.error

    def finish_cut(self) -> BaseException | None:
        """:meth:`finish`, returning what the reader raised (None: the archive was whole) instead of raising it."""
        try:
            self.finish()
        except Exception as err:
            return err
        return None


def transfer_allowance(max_bytes: int, max_files: int, min_rate: int) -> float:
    """
    Seconds one batch of at most ``max_bytes`` bytes in at most ``max_files`` files may take: at least
    ``FILE_OP_TIMEOUT``, or its bytes at ``min_rate`` bytes per second plus :data:`SECONDS_PER_FILE` per file.
    """
    return max(FILE_OP_TIMEOUT, max_bytes / min_rate + max(0, max_files) * SECONDS_PER_FILE)


def is_utf8(text: str) -> bool:
    """False for a string carrying undecodable bytes as surrogates (``os.fsdecode`` of non-UTF-8 names)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_utf8_command(command: str) -> str:
    """:raises SandboxError: for a command that cannot be sent as UTF-8 text."""
    if not is_utf8(command):
        raise SandboxError(
            "command must be valid UTF-8 text; it holds characters that cannot be encoded (undecodable "
            "bytes carried as surrogates)."
        )
    return command


class StagedErrors:
    """
    What a staged command's standard error began with (64 KiB at most), passed on as it comes: after
    the run, :meth:`check` raises the staging failure the runner reported, if it reported one.
    """

    def __init__(self, output: Any) -> None:
        self.output = output
        self.head = bytearray()

    def deliver(self, stream: int, data: bytes) -> None:
        if stream == 2 and len(self.head) < 64 * 1024:
            self.head.extend(data)
        (self.output.stderr if stream == 2 else self.output.stdout)(data)

    def check(self, stage: Sequence[ImportEntry], archive: ImportArchive, exit_code: int) -> None:
        """:raises SandboxError: for a source that failed, or files ``stage.sh`` could not extract."""
        if archive.error is not None:
            raise archive.error
        text = self.head.decode(errors="replace")
        if exit_code == STAGE_FAILED_STATUS and STAGE_FAILED_MARK in text.splitlines():
            raise import_failure(stage, text)


class ExecTransfers:
    """
    Mixin for backends whose exec streams both ways (Docker, Kubernetes): file operations run the
    shared guest programs with their bytes on the exec's standard streams (``_stream_script``, for
    :class:`~sandbox_provider.sandbox.files.StreamFiles`), and a batch is one tar stream per direction.
    Put it before ``StreamFiles`` in the bases.

    The backend implements ``_exec(handle, argv, *, timeout, on_output, stdin, stdin_size) ->
    (RunOutcome, bytes read from stdin)``, ``_op_argv(program, args)`` (the argv running the shared
    guest program ``program``) and ``_archive_owner(handle)`` (the uid and gid in the archive's headers).
    """

    #: An export runs at least this fast (bytes per second) or times out.
    min_transfer_rate: int = 8 * 1024 * 1024

    if TYPE_CHECKING:
        display_name: ClassVar[str]

        def _exec(
            self,
            handle: str,
            argv: list[str],
            *,
            timeout: float,
            on_output: Callable[[int, bytes], None],
            stdin: IO[bytes] | None = None,
            stdin_size: int = 0,
        ) -> tuple[RunOutcome, int]: ...
        def _deadline(self, handle: str, timeout: float) -> float: ...
        def check_handle(self, handle: Any) -> str: ...

    def _op_argv(self, program: str, args: Sequence[str]) -> list[str]:
        raise NotImplementedError

    def _archive_owner(self, handle: str) -> tuple[int, int]:
        raise NotImplementedError

    def _check_path(self, path: str) -> str:
        check_path(path)
        if not is_utf8(path):
            raise SandboxError(
                f"{path!r} is not valid UTF-8 (it carries undecodable bytes as surrogates); paths in a "
                f"{self.display_name} sandbox must be valid UTF-8 text."
            )
        return path

    def _stream_script(
        self,
        handle: str,
        program: str,
        *args: object,
        timeout: float,
        on_stdout: Any = None,
        stdin: IO[bytes] | None = None,
        stdin_size: int = 0,
    ) -> tuple[SandboxExecResult, int]:
        # File operations: the shared guest programs, run as the command user like any command. The
        # bytes of standard output go straight to on_stdout, never through a tail buffer.
        handle = self.check_handle(handle)
        budget = self._deadline(handle, timeout)
        sink = OutputSink(64 * 1024)

        def deliver(stream: int, data: bytes) -> None:
            if stream == 2:
                sink.stderr(data)
            elif on_stdout is not None:
                on_stdout(data)
            else:
                sink.stdout(data)

        argv = self._op_argv(program, [str(a) for a in args])
        outcome, read = self._exec(handle, argv, timeout=budget, on_output=deliver, stdin=stdin, stdin_size=stdin_size)
        return sink.result(outcome, budget), read

    def _archive(self, handle: str, entries: Sequence[ImportEntry]) -> ImportArchive:
        for entry in entries:
            self._check_path(entry.path)
        uid, gid = self._archive_owner(handle)
        return ImportArchive(entries, uid=uid, gid=gid)

    def import_batch(self, handle: str, entries: Sequence[ImportEntry]) -> int:
        """
        Write every entry in one exec: a tar archive built as it streams, extracted in the sandbox
        by GNU ``tar`` as the command user (parent directories made, a file or symlink at a path
        replaced, symlinks above it resolved as a command meets them). Returns the bytes written.

        :raises SandboxError: naming the entry, for a path that cannot be written or a source that
            did not hold its size; :raises SandboxTerminalError: if the sandbox is gone.
        """
        from sandbox_provider.sandbox.files import file_failure

        handle = self.check_handle(handle)
        if not entries:
            return 0
        archive = self._archive(handle, entries)
        allowance = transfer_allowance(archive.size, len(entries), self.min_transfer_rate)
        result, _ = self._stream_script(
            handle, "stage.sh", timeout=allowance, stdin=cast(IO[bytes], archive), stdin_size=archive.size
        )
        if archive.error is not None:
            raise archive.error
        if result.timed_out or result.sandbox_terminated:
            raise file_failure(result, "the staged files", "writing")
        if not result.ok:
            raise import_failure(entries, result.stderr)
        return sum(int(entry.size) for entry in entries)

    def export_batch(
        self, handle: str, requests: Sequence[ExportRequest], sink: ExportSink, *, limits: ExportLimits
    ) -> int:
        """
        Copy what every request names out in one exec: one file alone streams as it is (see
        ``export_file``); anything else comes as tar archives written in the sandbox by GNU ``tar``
        as the command user (symlinks followed as it sees them), every member checked before its
        bytes reach ``sink``. Returns the bytes exported.

        :raises SandboxFileTooLargeError: over a limit; :raises SandboxError: missing, wrong kind,
            hostile member; :raises SandboxTerminalError: if the sandbox is gone.
        """
        from sandbox_provider.sandbox.batch import default_export_batch
        from sandbox_provider.sandbox.files import file_failure

        handle = self.check_handle(handle)
        for request in requests:
            self._check_path(request.path)
        if len(requests) == 1 and requests[0].kind == "file":
            return default_export_batch(cast(Any, self), handle, requests, sink, limits=limits)
        pipe = ArchivePipe(requests, sink, limits)
        allowance = transfer_allowance(limits.max_total_bytes, limits.max_files, self.min_transfer_rate)
        try:
            result, _ = self._stream_script(
                handle, "export_tree.sh", *export_arguments(requests), timeout=allowance, on_stdout=pipe.write
            )
        finally:
            cut = pipe.finish_cut()
        # The reader refused a member first (the exec was stopped for it): its error. Otherwise an
        # export cut off by its allowance, or by the sandbox ending, left the archive cut short: that
        # is a timeout (or an ended sandbox), not a corrupt archive.
        if (result.timed_out or result.sandbox_terminated) and not pipe.refused:
            raise file_failure(result, "the export", "exporting")
        if cut is not None:
            raise cut
        if not result.ok:
            raise export_failure(requests, result.exit_code, result.stderr)
        return pipe.total
