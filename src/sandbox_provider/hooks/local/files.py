"""
File operations of ``LocalSandboxHook``, each resolved inside the sandbox, so a path (and any
symlink on it) resolves the way the sandbox sees it. A link pointing at a host path leads to what
the sandbox can see there, which is nothing of the worker's. Listing comes from ``ShellFiles``.

Bytes cross a launch's standard streams: in through a pipe a worker thread fills (``sendfile`` from
a local source file, :mod:`~sandbox_provider.hooks.local.transfer`), out into the destination's own descriptor (a local
file: ``cat`` in the sandbox writes it, no byte passes the worker) or a pipe. A batch moves as one
tar stream through one launch each way; a big local source file goes in by its own descriptor
(``cat`` copies it in the kernel), and directory exports to local storage are written by the
sandbox into their ``.partial`` directories and checked there (:mod:`~sandbox_provider.hooks.local.export`).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from collections.abc import Callable, Sequence
from typing import IO, Any

from sandbox_provider.hooks.local import driver, transfer
from sandbox_provider.hooks.local import export as local_export
from sandbox_provider.hooks.local import guest as local_guest
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ExportSink, ImportEntry, glob_base, joined_name
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import check_export_size, checked_size, file_failure, read_capped
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, OutputSink, RunOutcome
from sandbox_provider.sandbox.spec import SandboxExecResult, check_byte_count, check_path

__all__ = ["LocalFiles"]

_EXPORT_MIN_RATE = 1024 * 1024  # bytes per second a local export is allowed to be slow to
_BATCH_TIMEOUT = 3600.0  # seconds a batch may take (cut to the sandbox's lifetime left)
#: A command's staged files go in with it, in one launch, up to this many bytes; more go in first.
STAGE_WITH_COMMAND_BYTES = 64 * 1024 * 1024
#: A local source file this big goes in by its own descriptor, copied in the kernel (a launch of its own).
DIRECT_COPY_BYTES = 64 * 1024 * 1024
_STAGE_FAILED = "sandbox-stage-failed"
_EXPORT_FAILED = "sandbox-export-failed:"
_MKNOD_FAILED = re.compile(r"^tar: (\d+)/(.+): Cannot mknod")


class LocalFiles:
    """Mixin of ``LocalSandboxHook``: its file operations over ``_exec`` (see the module)."""

    _exec: Callable[..., RunOutcome]
    _bwrap: Callable[[], str]
    check_handle: Callable[[str], str]
    _deadline: Callable[[str, float], float]
    uid_of: Callable[[str], int]

    def _script(
        self,
        handle: str,
        script: str,
        *,
        timeout: float = FILE_OP_TIMEOUT,
        on_stdout: Callable[[bytes], None] | None = None,
        **kwargs: Any,
    ) -> SandboxExecResult:
        handle = self.check_handle(handle)
        budget = self._deadline(handle, timeout)
        sink = OutputSink(
            64 * 1024, (lambda stream, data: on_stdout(data) if stream == "stdout" else None) if on_stdout else None
        )
        outcome = self._exec(handle, ["/bin/sh", "-c", script], timeout=budget, output=sink, **kwargs)
        return sink.result(outcome, budget)

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path``, at most ``max_bytes`` (checked in the sandbox).

        :raises SandboxFileTooLargeError: if it holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, unreadable, a directory or not a regular file.
        """
        check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        script = guest.shell_command("file.sh", path, int(max_bytes), "head")
        return read_capped(path, max_bytes, lambda keep: self._script(handle, script, on_stdout=keep))

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into ``path`` in the sandbox, creating parent directories; return the bytes.

        The bytes go to a temporary sibling first, which is then renamed over ``path``: a reader never
        sees half a file, and a symlink at ``path`` is replaced rather than followed.

        :raises SandboxError: if the path cannot be written (a directory is there, say).
        """
        check_path(path)
        counted = driver.CountingReader(source)
        script = guest.shell_command("write.sh", "stdin", path)
        result = self._script(handle, script, stdin=counted, timeout=max(FILE_OP_TIMEOUT, _BATCH_TIMEOUT))
        if not result.ok:
            raise file_failure(result, path, "writing")
        return counted.count

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Stream the regular file at ``path`` into ``stream``; return the bytes copied.

        When ``stream`` is a local file, the copy in the sandbox (a trusted ``cat``, in a process tree
        of its own, under a file-size limit) writes into it directly, and no byte passes through the
        worker; otherwise bytes come through a pipe. At most ``max_bytes + 1`` bytes are written
        before the size is checked.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed during the copy.
        """
        check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        copied = [0]

        def write(data: bytes) -> None:
            copied[0] += len(data)
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
            stream.write(data)

        allowance = max(FILE_OP_TIMEOUT, max_bytes / _EXPORT_MIN_RATE)
        out_fd = driver.local_file_fd(stream)
        if out_fd is None:
            script = guest.shell_command("file.sh", path, int(max_bytes), "head")
            result = self._script(handle, script, on_stdout=write, timeout=allowance)
        else:
            # cat copies in the kernel where it can; the file-size limit stops it one byte past
            # the budget should the file grow during the copy.
            start = os.lseek(out_fd, 0, os.SEEK_CUR)
            script = guest.shell_command("file.sh", path, int(max_bytes), "cat")
            result = self._script(
                handle, script, stdout_fd=out_fd, timeout=allowance, max_file_bytes=start + int(max_bytes) + 1
            )
            copied[0] = os.lseek(out_fd, 0, os.SEEK_CUR) - start
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
        check_export_size(path, checked_size(result, path, max_bytes, "exporting"), copied[0])
        return copied[0]

    # -- batches: one launch each way -----------------------------------------------------------------

    def import_batch(self, handle: str, entries: Sequence[ImportEntry]) -> int:
        """
        Write every entry in one launch: one file through ``write.sh`` (a temporary sibling renamed
        into place), several as one tar stream that the sandbox's ``tar -x`` extracts. A local
        source file's bytes go into the launch's pipe with ``sendfile``; one of
        :data:`DIRECT_COPY_BYTES` or more goes in by its own descriptor in a launch of its own, where
        ``cat`` copies it in the kernel (``copy_file_range``). Return the bytes written.

        :raises SandboxError: naming what could not be written; :raises SandboxTerminalError: sandbox gone.
        """
        for entry in entries:
            check_path(entry.path)
        entries, direct = _split_direct(entries)
        done = sum(self._import_direct(handle, entry) for entry in direct)
        if not entries:
            return done
        single = len(entries) == 1
        feed = transfer.ArchiveFeed(entries, archive=not single, bwrap=self._bwrap())
        if single:
            script = guest.shell_command("write.sh", "stdin", entries[0].path)
        else:
            script = guest.shell_command("stage.sh")
        result, error = transfer.run_with(
            lambda: self._script(handle, script, stdin_fd=feed.read_end, timeout=_BATCH_TIMEOUT), finish=feed.finish
        )
        where = entries[0].path if single else f"{len(entries)} files ({entries[0].path!r}, ...)"
        _raise_feed_error(error, where)
        if not result.ok:
            raise file_failure(result, where, "writing")
        return done + sum(entry.size for entry in entries)

    def _import_direct(self, handle: str, entry: ImportEntry) -> int:
        """Copy one local regular file in: the sandbox's ``cat`` reads the source's own descriptor."""
        source = entry.open()
        try:
            fd = transfer.regular_fd(source)
            if fd is None or source.tell() != 0:  # through the pipe after all, from the stream already open
                return self.import_batch(handle, [dataclasses.replace(entry, open=lambda: source, local_path=None)])
            script = guest.shell_command("write.sh", "copy", entry.path, entry.size)
            # The base environment only: nothing the Dag's environment names runs beside the worker's descriptor.
            result = self._script(handle, script, stdin_fd=os.dup(fd), timeout=_BATCH_TIMEOUT, base_env_only=True)
        finally:
            source.close()
        if result.exit_code == 3:
            raise SandboxError(f"The source for {entry.path!r} does not hold the {entry.size} bytes it reported.")
        if not result.ok:
            raise file_failure(result, entry.path, "writing")
        return entry.size

    def _export_in_place(
        self,
        handle: str,
        requests: Sequence[ExportRequest],
        sink: Any,
        directories: list[str],
        limits: ExportLimits,
    ) -> int:
        """Tree and glob requests to local storage: written into their ``.partial`` directories (``export.py``)."""
        args = _tree_args(requests)
        binds = local_export.prepare(directories, self.uid_of(handle) if os.geteuid() == 0 else None)
        try:
            caps = local_export.stream_caps(limits)
            tree = guest.program("export_tree.sh")
            script = local_guest.shell_command("export_into.sh", local_export.MOUNT, tree, *caps, *args)
            result = self._script(  # the base environment only: no program the Dag's PATH names runs here
                handle,
                script,
                timeout=_BATCH_TIMEOUT,
                binds=binds,
                max_file_bytes=limits.max_file_bytes + 1,
                base_env_only=True,
            )
            if result.sandbox_terminated:
                raise SandboxTerminalError(f"The sandbox ended while exporting {requests[0].path!r}.")
            local_export.check_caps(result, requests, limits)
            adopted = local_export.adopt(directories, requests, limits)  # checks first: a big file ends tar
            if not result.ok:
                raise _export_failure(result, requests)
        except BaseException:
            local_export.remove(directories)
            raise
        for index, files in enumerate(adopted):
            sink.adopt(index, files)
        return sum(sum(files.values()) for files in adopted)

    def _run_staged(
        self, handle: str, command: str, stage: Sequence[ImportEntry], *, timeout: float, output: OutputSink
    ) -> RunOutcome:
        """Extract ``stage`` and run ``command`` in one launch (``stage.sh``); bigger stages go in first."""
        if sum(entry.size for entry in stage) > STAGE_WITH_COMMAND_BYTES:
            self.import_batch(handle, stage)
            return self._exec(handle, ["/bin/sh", "-c", command], timeout=timeout, output=output)
        for entry in stage:
            check_path(entry.path)
        feed = transfer.ArchiveFeed(stage, archive=True, bwrap=self._bwrap())
        argv = ["/bin/sh", "-c", guest.program("stage.sh"), "stage.sh", command]
        outcome, error = transfer.run_with(
            lambda: self._exec(handle, argv, timeout=timeout, output=output, stdin_fd=feed.read_end),
            finish=feed.finish,
        )
        stage_failed = outcome.exit_code == 125 and _STAGE_FAILED in output.err.text()
        if stage_failed or (error is not None and not isinstance(error, BrokenPipeError)):
            _raise_feed_error(error, f"{len(stage)} file(s)")
            detail = output.err.text().replace(_STAGE_FAILED, "").strip()[-500:]
            raise SandboxError(f"Could not write the {len(stage)} staged file(s) into sandbox {handle}: {detail}")
        return outcome

    def export_batch(
        self, handle: str, requests: Sequence[ExportRequest], sink: ExportSink, *, limits: ExportLimits
    ) -> int:
        """
        Copy every request's files out in one launch: ``export_tree.sh`` packs them with the
        sandbox's ``tar -c -h`` (symlinks followed as the sandbox sees them), and the worker checks
        the archive as it reads it (:func:`~sandbox_provider.sandbox.batch.read_export_archive`).

        :raises SandboxFileTooLargeError: over a limit; :raises SandboxError: missing, wrong kind, hostile.
        """
        if not requests:
            return 0
        directories = local_export.local_directories(sink, requests)
        if directories is not None:
            return self._export_in_place(handle, requests, sink, directories, limits)
        if len(requests) == 1 and requests[0].kind == "file":
            # One file: its destination's own descriptor goes to cat in the sandbox (in-kernel copy).
            name = posixpath.basename(requests[0].path)
            room = min(limits.max_file_bytes, limits.max_total_bytes)
            size = self.export_file(handle, requests[0].path, sink.begin(0, name), max_bytes=room)
            sink.end(0, name, size)
            return size
        reader = transfer.ExportReader(requests, sink, limits)
        script = guest.shell_command("export_tree.sh", *_tree_args(requests))

        def launch() -> SandboxExecResult:
            return self._script(handle, script, stdout_fd=reader.write_end, timeout=_BATCH_TIMEOUT)

        def finish() -> BaseException | None:
            os.close(reader.write_end)
            return reader.finish()

        result, error = transfer.run_with(launch, finish=finish)
        if result.sandbox_terminated:
            raise SandboxTerminalError(f"The sandbox ended while exporting {requests[0].path!r}.")
        if error is not None and not (isinstance(error, transfer.ArchiveUnreadable) and not result.ok):
            raise error
        if not result.ok:
            raise _export_failure(result, requests)
        return reader.total


def _tree_args(requests: Sequence[ExportRequest]) -> list[str]:
    """``export_tree.sh``'s arguments for ``requests``: a kind and a path each."""
    args: list[str] = []
    for request in requests:
        check_path(request.path)
        if request.kind == "glob":
            base, pattern = glob_base(request.path)
            args += ["glob", f"{base}\n{'/'.join(pattern)}"]
        else:
            args += [request.kind, request.path]
    return args


def _split_direct(entries: Sequence[ImportEntry]) -> tuple[list[ImportEntry], list[ImportEntry]]:
    """``(the rest, the big local files that go in by descriptor)``; none when their paths meet the rest's."""
    direct = [e for e in entries if e.local_path is not None and e.size >= DIRECT_COPY_BYTES]
    if not direct:
        return list(entries), []
    rest = [e for e in entries if not (e.local_path is not None and e.size >= DIRECT_COPY_BYTES)]
    landing = [posixpath.normpath(e.path) for e in direct]
    if len(set(landing)) < len(landing) or set(landing) & {posixpath.normpath(e.path) for e in rest}:
        return list(entries), []
    return rest, direct


def _raise_feed_error(error: BaseException | None, where: str) -> None:
    if error is None or isinstance(error, BrokenPipeError):
        return  # a launch that stopped reading says why itself
    if isinstance(error, SandboxError):
        raise error
    raise SandboxError(f"Could not read the source of {where}: {type(error).__name__}: {error}") from error


def _failed_at(result: SandboxExecResult) -> int | None:
    for line in reversed(result.stderr.splitlines()):
        if line.startswith(_EXPORT_FAILED) and line[len(_EXPORT_FAILED) :].isdigit():
            return int(line[len(_EXPORT_FAILED) :])
    return None


def _export_failure(result: SandboxExecResult, requests: Sequence[ExportRequest]) -> SandboxError:
    index = _failed_at(result)
    request = requests[index] if index is not None and index < len(requests) else requests[0]
    if result.exit_code == guest.NOT_REGULAR_STATUS and request.kind == "tree":
        return SandboxError(f"{request.path!r} is not a directory in the sandbox; export it as a file.")
    if result.exit_code == 70:
        lines = [line for line in result.stderr.splitlines() if not line.startswith(_EXPORT_FAILED)]
        for line in lines:  # a device tar -h found behind a link: tar -x (export_into.sh) cannot make one
            found = _MKNOD_FAILED.match(line)
            if found and int(found[1]) < len(requests):
                where = joined_name(requests[int(found[1])], found[2])
                return SandboxError(
                    f"{where!r} is not a regular file in the sandbox (a device); export regular files only."
                )
        lines = [line for line in lines if "Exiting with failure status" not in line]
        detail = lines[-1] if lines else f"exit status {result.exit_code}"
        return SandboxError(f"Could not export {request.path!r}: {detail}")
    return file_failure(result, request.path, "exporting")
