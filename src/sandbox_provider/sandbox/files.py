"""
File operations over the shell, for backends whose vendor has no file API, and the checks every
backend's file operations share.

:class:`ShellFiles` runs the guest programs ``file.sh``, ``write.sh`` and ``list.sh`` through the
backend's own ``run_command``, so a path resolves the way the sandbox sees it. Bytes cross the
command line as base64 in bounded pieces.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from typing import IO

from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT
from sandbox_provider.sandbox.spec import SandboxExecResult, check_byte_count, check_path

__all__ = [
    "read_capped",
    "LIST_OUTPUT_BYTES",
    "CountingReader",
    "ShellFiles",
    "StreamFiles",
    "check_export_size",
    "file_failure",
    "file_status_error",
    "parse_listing",
    "reported_size",
    "special_kind_of",
    "write_step_error",
    "write_through_temp",
]

#: Raw bytes moved per shell command when exporting.
SHELL_CHUNK_BYTES = 4 * 1024 * 1024
#: Raw bytes per write command: a command line holds at most 128 KiB in one argument on Linux.
SHELL_WRITE_CHUNK_BYTES = 48 * 1024
#: The most bytes of names one ``list_directory`` returns.
LIST_OUTPUT_BYTES = 16 * 1024 * 1024


def _b64_cap(raw: int) -> int:
    return raw * 2 + 4096


def file_status_error(code: int, path: str) -> SandboxError | None:
    """The error a ``file.sh`` exit status stands for (too large excepted), or None."""
    if code == guest.MISSING_STATUS:
        return SandboxError(f"{path!r} does not exist in the sandbox, or cannot be read.")
    if code == guest.IS_DIR_STATUS:
        return SandboxError(f"{path!r} is a directory; list it with list_directory.")
    if code == guest.NOT_REGULAR_STATUS:
        return SandboxError(f"{path!r} is not a regular file.")
    return None


def file_failure(result: SandboxExecResult, path: str, verb: str) -> SandboxError:
    """The error for a file operation whose command failed: ended sandbox, timeout, status, or stderr."""
    if result.sandbox_terminated:
        return SandboxTerminalError(f"The sandbox ended while {verb} {path!r}.")
    if result.timed_out:
        return SandboxError(f"Timed out while {verb} {path!r}.")
    known = file_status_error(result.exit_code, path)
    if known is not None:
        return known
    detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit status {result.exit_code}"
    return SandboxError(f"Could not finish {verb} {path!r}: {detail}")


def reported_size(stderr: str) -> int | None:
    """The size ``file.sh`` printed to ``stderr`` (the last one, past any other noise)."""
    found = re.findall(rf"{guest.SIZE_MARK}(\d+)", stderr)
    return int(found[-1]) if found else None


def read_capped(path: str, max_bytes: int, run: Callable[[Callable[[bytes], None]], SandboxExecResult]) -> bytes:
    """
    The bytes of ``path`` that ``run(on_stdout)`` streams (the guest ``file.sh ... head`` program),
    keeping at most ``max_bytes``.

    :raises SandboxFileTooLargeError: if the program says, or the stream shows, it holds more.
    :raises SandboxError: for the program's other failures (missing, unreadable, not a regular file).
    """
    chunks: list[bytes] = []
    seen = [0]

    def keep(data: bytes) -> None:
        seen[0] += len(data)
        if seen[0] <= max_bytes:
            chunks.append(data)

    result = run(keep)
    if result.exit_code == guest.TOO_LARGE_STATUS or seen[0] > max_bytes:
        raise SandboxFileTooLargeError(path, max(reported_size(result.stderr) or 0, seen[0]), max_bytes)
    if not result.ok:
        raise file_failure(result, path, "reading")
    return b"".join(chunks)


def check_export_size(path: str, expected: int, copied: int) -> None:
    """:raises SandboxError: when the bytes copied differ from the size reported before the copy."""
    if copied != expected:
        raise SandboxError(
            f"{path!r} changed while it was exported: it held {expected} bytes when the export began and "
            f"{copied} bytes were copied. Something in the sandbox may still be writing it."
        )


def checked_size(result: SandboxExecResult, path: str, max_bytes: int, verb: str) -> int:
    """
    The size ``file.sh`` reported for ``path``, once its command succeeded.

    :raises SandboxFileTooLargeError: for the over-the-limit status.
    :raises SandboxError: for any other failure, or no size reported.
    """
    size = reported_size(result.stderr)
    if result.exit_code == guest.TOO_LARGE_STATUS:
        raise SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
    if not result.ok:
        raise file_failure(result, path, verb)
    if size is None:
        raise SandboxError(f"The sandbox did not report the size of {path!r}.")
    return size


def parse_listing(path: str, result: SandboxExecResult) -> list[tuple[str, bool]]:
    """Turn the output of ``list.sh`` into sorted ``(name, is_directory)`` pairs, or raise what failed."""
    if not result.ok:
        if result.exit_code == guest.MISSING_STATUS:
            raise SandboxError(f"{path!r} is not a directory in the sandbox.")
        raise file_failure(result, path, "listing")
    if result.stdout_truncated:
        raise SandboxError(
            f"{path!r} holds more entries than one listing returns ({LIST_OUTPUT_BYTES} bytes of names); list "
            "part of it with a command such as find or ls piped to head."
        )
    entries = [(item[2:], item[0] == "d") for item in result.stdout.split("\0") if len(item) >= 3]
    return sorted(entries)


def write_through_temp(
    *,
    start: Callable[[], str],
    fill: Callable[[str], int],
    commit: Callable[[str], object],
    abort: Callable[[str], object],
) -> int:
    """
    The rule every write keeps: ``start()`` makes a temporary sibling of the target and returns its
    path, ``fill(temp)`` writes the bytes into it and returns how many, ``commit(temp)`` renames it
    over the target. If anything fails (or is interrupted), ``abort(temp)`` removes the temporary
    file and the first failure is raised, so a reader never sees half a file. Returns what ``fill`` did.
    """
    temp = start()
    try:
        total = fill(temp)
        commit(temp)
    except BaseException:
        try:
            abort(temp)
        except Exception:  # the first failure is the one to report
            pass
        raise
    return total


def write_step_error(path: str, stderr: str, fallback: str) -> SandboxError:
    """The error for a failed step of writing ``path``: the last line of its ``stderr``, else ``fallback``."""
    return SandboxError(f"Could not write {path!r}: {(stderr.strip().splitlines() or [fallback])[-1]}")


class CountingReader:
    """A read-only binary stream over ``source`` that counts the bytes read through it (``total``)."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source = source
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size) or b""
        self.total += len(data)
        return data


class ShellFiles:
    """
    Mixin: file operations over the backend's ``run_command`` and the shell guest programs.

    Needs ``sh``, ``stat``, ``head``, ``tail``, ``find``, ``mktemp`` and ``base64`` in the guest. Put it
    before :class:`~sandbox_provider.sandbox.hook.SandboxHook` in the bases.
    """

    def _shell(self, handle: str, script: str, *, max_output_bytes: int, timeout: float = FILE_OP_TIMEOUT):
        return self.run_command(handle, script, timeout=timeout, max_output_bytes=max_output_bytes)  # type: ignore[attr-defined]

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`; the size cap is enforced inside the sandbox."""
        check_byte_count(max_bytes, "max_bytes")
        check_path(path)
        script = guest.shell_command("file.sh", path, int(max_bytes), "base64")
        result = self._shell(handle, script, max_output_bytes=_b64_cap(int(max_bytes)))
        size = reported_size(result.stderr)
        if result.exit_code == guest.TOO_LARGE_STATUS:
            raise SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
        if not result.ok:
            raise file_failure(result, path, "reading")
        data = _decode(result.stdout, path)
        if len(data) > max_bytes:
            raise SandboxFileTooLargeError(path, len(data), max_bytes)
        return data

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """Stream ``source`` into ``path`` through a temporary sibling renamed into place; return the bytes."""
        check_path(path)

        def fill(temp: str) -> int:
            total = 0
            while chunk := source.read(SHELL_WRITE_CHUNK_BYTES):
                self._write_step(handle, path, "append", temp, base64.b64encode(chunk).decode())
                total += len(chunk)
            return total

        return write_through_temp(
            start=lambda: self._temp_sibling(handle, path, path),
            fill=fill,
            commit=lambda temp: self._write_step(handle, path, "commit", temp, path),
            abort=lambda temp: self._abort_temps(handle, temp),
        )

    def _temp_sibling(self, handle: str, target: str, path: str) -> str:
        """Make a temporary sibling of ``target`` with ``write.sh start``; return its path (errors name ``path``)."""
        started = self._shell(handle, guest.shell_command("write.sh", "start", target), max_output_bytes=64 * 1024)
        if not started.ok or not started.stdout.strip():
            raise file_failure(started, path, "writing")
        return started.stdout.strip().splitlines()[-1]

    def _write_step(self, handle: str, path: str, *args: object) -> None:
        """One ``write.sh`` step (``append``, ``concat``, ``commit``) of writing ``path``."""
        done = self._shell(handle, guest.shell_command("write.sh", *args), max_output_bytes=64 * 1024)
        if not done.ok:
            raise file_failure(done, path, "writing")

    def _abort_temps(self, handle: str, *temps: str) -> None:
        """Remove the temporary files of a write that failed."""
        for temp in temps:
            self._shell(handle, guest.shell_command("write.sh", "abort", temp), max_output_bytes=4096)

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """See :meth:`SandboxHook.list_directory`."""
        check_path(path)
        result = self._shell(handle, guest.shell_command("list.sh", path), max_output_bytes=LIST_OUTPUT_BYTES)
        return parse_listing(path, result)

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`; memory stays bounded by one 4 MiB piece."""
        check_byte_count(max_bytes, "max_bytes")
        check_path(path)
        checked = self._shell(
            handle, guest.shell_command("file.sh", path, int(max_bytes), "check"), max_output_bytes=4096
        )
        size = checked_size(checked, path, max_bytes, "exporting")
        copied = 0
        while True:
            script = guest.shell_command("file.sh", path, "-", "chunk", copied, SHELL_CHUNK_BYTES)
            piece = self._shell(handle, script, max_output_bytes=_b64_cap(SHELL_CHUNK_BYTES))
            if not piece.ok or piece.stdout_truncated:
                raise file_failure(piece, path, "exporting")
            data = _decode(piece.stdout, path)
            copied += len(data)
            if copied > max_bytes:
                raise SandboxFileTooLargeError(path, copied, max_bytes)
            stream.write(data)
            if len(data) < SHELL_CHUNK_BYTES:
                break
        check_export_size(path, size, copied)
        return copied


def _decode(text: str, path: str) -> bytes:
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as err:
        raise SandboxError(f"Could not decode {path!r} from the sandbox.") from err


class StreamFiles:
    """
    Mixin: file operations over the guest programs, with the bytes on the standard streams of a
    program run in the sandbox (no base64), for backends that can stream both ways. The backend
    implements :meth:`_stream_script`. Put it before :class:`ShellFiles` (which still lists
    directories) and :class:`~sandbox_provider.sandbox.hook.SandboxHook` in the bases.
    """

    #: An export runs at least this fast (bytes per second) or times out.
    min_transfer_rate: int = 8 * 1024 * 1024

    def _stream_script(
        self,
        handle: str,
        program: str,
        *args: object,
        timeout: float,
        on_stdout: Callable[[bytes], None] | None = None,
        stdin: IO[bytes] | None = None,
        stdin_size: int = 0,
    ) -> tuple[SandboxExecResult, int]:
        """
        Run the guest program ``program`` with ``args``: standard output to ``on_stdout``, and
        exactly ``stdin_size`` bytes of ``stdin`` as standard input when given. Returns the result
        (its stdout is not kept) and the bytes read from ``stdin``.
        """
        raise NotImplementedError

    def _check_path(self, path: str) -> str:
        """The backend's own path check on top of :func:`check_path`; override to add one."""
        return check_path(path)

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`; the size cap is enforced inside the sandbox."""
        self._check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        return read_capped(
            path,
            max_bytes,
            lambda keep: self._stream_script(
                handle, "file.sh", path, int(max_bytes), "head", timeout=FILE_OP_TIMEOUT, on_stdout=keep
            )[0],
        )

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`; at most ``max_bytes + 1`` bytes reach ``stream``."""
        self._check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        copied = [0]

        def write(data: bytes) -> None:
            room = max_bytes + 1 - copied[0]
            copied[0] += len(data)
            if room > 0:
                stream.write(data[:room])

        allowance = max(FILE_OP_TIMEOUT, max_bytes / self.min_transfer_rate)
        result, _ = self._stream_script(
            handle, "file.sh", path, int(max_bytes), "head", timeout=allowance, on_stdout=write
        )
        if copied[0] > max_bytes:
            raise SandboxFileTooLargeError(path, max(reported_size(result.stderr) or 0, copied[0]), max_bytes)
        check_export_size(path, checked_size(result, path, max_bytes, "exporting"), copied[0])
        return copied[0]

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        See :meth:`SandboxHook.import_file`: the bytes go to a temporary sibling renamed over
        ``path``, so a reader never sees half a file and a symlink at ``path`` is replaced. A
        source that cannot tell its size is spooled first (memory up to 8 MiB, then disk).
        """
        self._check_path(path)
        spooled: IO[bytes] | None = None
        size = _remaining_size(source)
        if size is None:
            spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115 (closed below)
            shutil.copyfileobj(source, spooled, 1024 * 1024)
            size = spooled.tell()
            spooled.seek(0)
            source = spooled
        try:
            allowance = max(FILE_OP_TIMEOUT, size / self.min_transfer_rate)
            result, read = self._stream_script(
                handle, "write.sh", "stdin", path, size, timeout=allowance, stdin=source, stdin_size=size
            )
        finally:
            if spooled is not None:
                spooled.close()
        if not result.ok:
            raise file_failure(result, path, "writing")
        if read != size:
            raise SandboxError(f"The source for {path!r} ended after {read} of the {size} bytes it reported.")
        return size


#: Sources that cannot tell their size are spooled in memory up to this size, then on disk.
SPOOL_MEMORY_BYTES = 8 * 1024 * 1024


def _remaining_size(source: IO[bytes]) -> int | None:
    """Bytes left in a seekable source, or None when it cannot tell."""
    try:
        if not source.seekable():
            return None
        here = source.tell()
        end = source.seek(0, io.SEEK_END)
        source.seek(here)
        return end - here
    except (AttributeError, OSError, ValueError):
        return None


def special_kind_of(mode: int) -> str | None:
    """What a file of ``mode`` is, in words, unless it is a regular file, a directory or a symlink."""
    for test, words in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode) else "a special file"
