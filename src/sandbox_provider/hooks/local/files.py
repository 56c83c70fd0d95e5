"""
File operations of ``LocalSandboxHook``, each resolved inside the sandbox, so a path (and any
symlink on it) resolves the way the sandbox sees it. A link pointing at a host path leads to what
the sandbox can see there, which is nothing of the worker's. Listing comes from ``ShellFiles``.

Bytes cross a launch's standard streams: in through a pipe a worker thread fills (``sendfile`` from
a local source file, :mod:`~sandbox_provider.hooks.local.transfer`), out into the destination's own descriptor (a local
file: ``cat`` in the sandbox writes it, no byte passes the worker) or a pipe. A batch moves as one
tar stream through one launch each way; a big local source file goes in by its own descriptor
(``cat`` copies it in the kernel), and directory exports to local storage are written by the
sandbox into their ``.partial`` directories and checked there (the last part of this module).
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
import re
import stat
from collections.abc import Callable, Sequence
from typing import IO, Any, cast

from sandbox_provider.hooks.local import driver, state, transfer
from sandbox_provider.hooks.local import guest as local_guest
from sandbox_provider.hooks.local import plan as plans
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.batch import (
    ExportBudget,
    ExportLimits,
    ExportRequest,
    ExportSink,
    ImportEntry,
    glob_base,
    joined_name,
)
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import check_export_size, checked_size, file_failure, read_capped, special_kind_of
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, OutputSink, RunOutcome
from sandbox_provider.sandbox.nofollow import DIR_FLAGS, remove_tree
from sandbox_provider.sandbox.spec import SandboxExecResult, check_byte_count, check_path

__all__ = ["EXPORT_MOUNT", "LocalFiles", "adopt_in_place", "prepare_in_place"]

_EXPORT_MIN_RATE = 1024 * 1024  # bytes per second a local export is allowed to be slow to
_BATCH_TIMEOUT = 3600.0  # seconds a batch may take (cut to the sandbox's lifetime left)
#: A command's staged files go in with it, in one launch, up to this many bytes; more go in first.
STAGE_WITH_COMMAND_BYTES = 64 * 1024 * 1024
#: A stage this small (files, bytes) is written by the worker straight into a workspace where its names are new.
SMALL_STAGE_FILES, SMALL_STAGE_BYTES = 16, 256 * 1024
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
    _plan: Callable[[str], Any]
    workdir: str

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
        """Tree and glob requests to local storage: written into their ``.partial`` directories (see below)."""
        args = _tree_args(requests)
        held = prepare_in_place(directories, self.uid_of(handle) if os.geteuid() == 0 else None)
        try:
            caps = in_place_caps(limits)
            tree = guest.program("export_tree.sh")
            script = local_guest.shell_command("export_into.sh", EXPORT_MOUNT, tree, *caps, *args)
            result = self._script(  # the base environment only: no program the Dag's PATH names runs here
                handle,
                script,
                timeout=_BATCH_TIMEOUT,
                binds=[(fd, f"{EXPORT_MOUNT}/{index}") for index, fd in enumerate(held)],
                max_file_bytes=limits.max_file_bytes + 1,
                base_env_only=True,
            )
            if result.sandbox_terminated:
                raise SandboxTerminalError(f"The sandbox ended while exporting {requests[0].path!r}.")
            check_in_place_caps(result, requests, limits)
            check_still_in_place(directories, held)
            adopted = adopt_in_place(held, requests, limits)  # checks first: a big file ends tar
            if not result.ok:
                raise _export_failure(result, requests)
        except BaseException:
            remove_in_place(directories, held)
            raise
        finally:
            for fd in held:
                os.close(fd)
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
        stage, written = self._write_small(handle, stage)
        if written:  # in place already: the command alone, without stage.sh's shell and tar
            return self._exec(handle, ["/bin/sh", "-c", command], timeout=timeout, output=output)
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

    def _write_small(self, handle: str, stage: Sequence[ImportEntry]) -> tuple[Sequence[ImportEntry], bool]:
        """
        A tiny stage (:data:`SMALL_STAGE_FILES` files, :data:`SMALL_STAGE_BYTES` bytes at most, all in
        the workdir) written by the worker straight into the workspace: each file new
        (``O_EXCL``), every directory on its way new or a plain directory, reached by descriptor
        and never through a link, owned by the sandbox's user (files 0644, directories 0755, as
        ``stage.sh``'s ``tar`` would leave them). Anything else (a name taken, a link on the way, a
        bigger stage) is left to ``stage.sh``, which replaces what is there as the sandbox sees it.

        Returns the stage (its sources read, so a fallback reads them again from memory) and
        whether it is written.
        """
        if len(stage) > SMALL_STAGE_FILES or sum(entry.size for entry in stage) > SMALL_STAGE_BYTES:
            return stage, False
        names = [_in_workdir(entry.path, self.workdir) for entry in stage]
        read: list[ImportEntry] = []
        for entry in stage:
            try:
                with entry.open() as source:
                    data = source.read(entry.size + 1)
            except Exception as err:  # the fallback's launch reports it, naming the entry
                read.append(dataclasses.replace(entry, open=_raiser(err), local_path=None, walked=None))
                names = [None]
                continue
            read.append(dataclasses.replace(entry, open=_bytes_source(data), local_path=None, walked=None))
            if len(data) != entry.size:
                names = [None]  # a source that lies about its size: stage.sh's path names it
        if any(name is None for name in names):
            return read, False
        plan = self._plan(handle)
        workspace = os.path.join(state.box_path(plan.path, plan.limits), "workspace")
        owner = plan.uid if os.geteuid() == 0 else None
        try:
            top = os.open(workspace, DIR_FLAGS)
        except OSError:
            return read, False
        try:
            for entry, name in zip(read, names, strict=True):
                with entry.open() as source:
                    if not _write_new(top, cast(str, name), source.read(), owner):
                        return read, False
        finally:
            os.close(top)
        return read, True

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
        directories = in_place_directories(sink, requests)
        if directories is not None and plans.binds_by_descriptor(self._bwrap()):
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


def _in_workdir(path: str, workdir: str) -> str | None:
    """``path`` relative to the workdir, when it lies in it (``a/b``, ``/workspace/a/b``); else None."""
    if path.startswith("/"):
        if not path.startswith(workdir.rstrip("/") + "/"):
            return None
        path = path[len(workdir.rstrip("/")) + 1 :]
    parts = path.split("/")
    if not path or any(part in ("", ".", "..") for part in parts):
        return None
    return path


def _bytes_source(data: bytes) -> Callable[[], IO[bytes]]:
    return lambda: io.BytesIO(data)


def _raiser(err: BaseException) -> Callable[[], IO[bytes]]:
    def fail() -> IO[bytes]:
        raise err

    return fail


def _write_new(top: int, name: str, data: bytes, owner: int | None) -> bool:
    """
    Write ``data`` to the new file ``name`` below the directory ``top`` (a descriptor), making the
    directories on the way; False, having written nothing of that file, when a name on the way is
    not a plain directory or the file exists.
    """
    *dirs, leaf = name.split("/")
    held: list[int] = []
    at = top
    try:
        for part in dirs:
            try:
                os.mkdir(part, 0o755, dir_fd=at)
                made = True
            except FileExistsError:
                made = False
            # A link (ELOOP) or not a directory fails here: stage.sh meets it as the sandbox does.
            fd = os.open(part, DIR_FLAGS, dir_fd=at)
            held.append(fd)
            if made:
                os.fchmod(fd, 0o755)
                if owner is not None:
                    os.fchown(fd, owner, owner)
            at = fd
        out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=at)
        try:
            if owner is not None:
                os.fchown(out, owner, owner)
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
            os.fchmod(out, 0o644)
        finally:
            os.close(out)
        return True
    except OSError:  # a name taken, a link on the way, a full disk budget: stage.sh writes it (or says why not)
        return False
    finally:
        for fd in held:
            os.close(fd)


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


# -- exports written in place -------------------------------------------------------------------------
#
# Directory exports of the local backend that the sandbox writes straight into their destination's
# ``.partial`` directory, when every destination of the batch is local storage.
#
# Each request's ``.partial`` directory (made empty and owned by the sandbox's user) is mounted into
# one launch at ``/.airflow-export/<index>`` by the descriptor the worker opened when it made it
# (``bwrap --bind-fd``; a bubblewrap without it exports through the worker instead), so a link put at
# its name meanwhile by whoever can write its parent leads the sandbox nowhere; the checks walk the
# same descriptor, and a name that no longer leads to it fails the export. ``export_into.sh`` extracts what
# ``export_tree.sh`` packs (symlinks followed as the sandbox sees them), so the bytes never pass
# through the worker and no archive is parsed in Python. The launch's file-size limit stops a file one
# byte past ``max_file_bytes``; ``export_into.sh`` stops tar once the members' sizes pass the batch's
# total or their number twice its file limit (:func:`in_place_caps`), so no more than that lands on the
# worker's disk before the exact checks below.
#
# Nothing written there is trusted: once the launch has ended, and with it the only mount of those
# directories any sandbox process had (a destination inside what the sandbox sees otherwise, its own
# workspace say, it could change at any time, whichever way the export went), :func:`adopt_in_place`
# walks each one without following anything, refuses all but directories and regular files, checks the batch's limits, and gives every entry to
# the worker (owner, mode 0644 or 0755, no set-id bits) before the engine publishes it. On any failure
# the directories are removed whole (iteratively: depth and permissions set inside cannot stop it).

#: Where a request's directory is bound in the export's launch: ``/.airflow-export/<index>``.
EXPORT_MOUNT = "/.airflow-export"
_LONGEST_NAME = 4095  # bytes of a relative name that a later rename can still take (PATH_MAX)


def in_place_directories(sink: Any, requests: Sequence[ExportRequest]) -> list[str] | None:
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


def in_place_caps(limits: ExportLimits) -> tuple[int, int]:
    """
    ``(bytes of the members' data, members)`` that ``export_into.sh`` lets tar extract before it
    stops it: the batch's total, and its file limit with room for directories (counted as members
    too), so a batch within its limits always fits and one past them stops within one member.
    """
    return limits.max_total_bytes, 2 * limits.max_files + 16


def check_in_place_caps(result: Any, requests: Sequence[ExportRequest], limits: ExportLimits) -> None:
    """
    :raises SandboxFileTooLargeError: the archive passed its byte cap (so the batch's total limit);
    :raises SandboxError: it passed its member cap (so the batch's file limit).
    """
    where = requests[0].path if len(requests) == 1 else ", ".join(r.path for r in requests)
    if result.exit_code == _OVER_BYTES:
        raise SandboxFileTooLargeError(where, in_place_caps(limits)[0], limits.max_total_bytes)
    if result.exit_code == _OVER_ENTRIES:
        raise SandboxError(
            f"The export of {where!r} holds more than {limits.max_files} files; export fewer (a narrower glob, "
            "say), or pack them into one archive in the sandbox and export that."
        )


def prepare_in_place(directories: Sequence[str], uid: int | None) -> list[int]:
    """
    Make each directory, empty, mode 0700, owned by ``uid`` (None: the worker); return a descriptor
    of each, for the launch to mount and the checks to walk (the caller closes them). Whoever can
    write a directory's parent could put a link (or another directory) at its name at any time:
    from here on it is reached through its descriptor only, never by name.

    :raises SandboxError: when one cannot be made (something is already there, say), or what was
        opened is not the directory just made; the ones made before it are removed.
    """
    held: list[int] = []
    try:
        for directory in directories:
            held.append(_make_held(directory, uid))
    except BaseException:
        remove_in_place(directories[: len(held)], held)  # the ones made so far: nothing is left half prepared
        for fd in held:
            os.close(fd)
        raise
    return held


def _make_held(directory: str, uid: int | None) -> int:
    """One directory of :func:`prepare_in_place`, made and opened; what was opened is checked to be it."""
    try:
        os.mkdir(directory, 0o700)
        fd = os.open(directory, DIR_FLAGS)  # a link put in its place meanwhile is not followed
    except OSError as err:
        raise SandboxError(f"Could not make the export directory {directory}: {err.strerror}") from err
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077 or os.listdir(fd):
            # Not the one made (that one was moved away): neither is removed, neither is the worker's to remove.
            raise SandboxError(
                f"The export directory {directory} was replaced as soon as it was made (someone else can write "
                f"{os.path.dirname(directory)}); export to a directory only this task's user can write."
            )
        if uid is not None:
            os.fchown(fd, uid, uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same_directory(path: str, fd: int) -> bool:
    """Whether ``path`` (not followed) is still the directory open as ``fd``."""
    try:
        named = os.lstat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def check_still_in_place(directories: Sequence[str], held: Sequence[int]) -> None:
    """
    :raises SandboxTerminalError: when a directory's name no longer leads to the directory the launch
        wrote (moved away, a link put there): the engine publishes by that name, so nothing is.
    """
    for directory, fd in zip(directories, held, strict=True):
        if not _same_directory(directory, fd):
            raise SandboxTerminalError(
                f"The export directory {directory} was moved or replaced while the sandbox wrote into it (someone "
                f"else can write {os.path.dirname(directory)}); nothing was published, and what the sandbox wrote "
                f"stays in the directory moved away ({_where(fd)}). Export to a directory only this task's user "
                "can write."
            )


def _where(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "no longer reachable"


def remove_in_place(directories: Sequence[str], held: Sequence[int] | None = None) -> None:
    """
    Remove each directory and everything in it (without following a link); with ``held``, only
    where its name still leads to the directory held (one moved away is left where it went). What
    cannot be removed is left for the engine to name.
    """
    for index, directory in enumerate(directories):
        if held is not None and index < len(held) and not _same_directory(directory, held[index]):
            continue
        try:
            remove_tree(directory)
        except OSError:
            pass


def adopt_in_place(
    directories: Sequence[str | int], requests: Sequence[ExportRequest], limits: ExportLimits
) -> list[dict[str, int]]:
    """
    Check what the launch wrote into each request's directory (a path, or a descriptor of it: the
    one the launch mounted) and hand it to the worker; return,
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
    top: str | int, request: ExportRequest, budget: ExportBudget, owner: tuple[int, int] | None, modes: tuple[int, int]
) -> dict[str, int]:
    """
    Depth first, holding open only the directories on the way down (one per level), so a directory
    of many subdirectories costs no more descriptors than a narrow one.
    """
    files: dict[str, int] = {}
    stack: list[tuple[str, int, list[str]]] = []
    try:
        fd = _enter(os.dup(top) if isinstance(top, int) else os.open(top, DIR_FLAGS), owner, modes[1])
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
