"""
Commands and file operations of the Docker backend, as a mixin of
:class:`~sandbox_provider.hooks.docker.DockerSandboxHook`: every program runs through exec as the
sandbox's command user, one at a time per sandbox, and the sandbox is swept after it.

- A command runs under the runner (``guest/docker_run.sh``), whose closing ``kill(-1)`` ends
  everything else of the command user; a runner that did not end by itself has the keeper sweep.
- A file operation runs a shared guest program under ``guest/docker_op.sh``; its bytes travel on
  the exec's standard streams (see :mod:`~sandbox_provider.hooks.docker.exec`), never through a tail
  buffer.
- A batch (``import_batch``, ``export_batch``, files staged with a command) is one exec per
  direction: tar through the exec, as the command user (see :mod:`~sandbox_provider.sandbox.batch_stream`).
  Not the Engine's archive API: it runs as root, outside the sandbox's view, so it would write where
  the command user cannot and follow symbolic links by its own rules, and a command could plant a link
  that turns a later transfer against the keeper's own files.
- The first program in a new sandbox waits inside for the keeper (``guest/docker_wait.sh``), so
  creating a sandbox costs no request to look for it. Where the command user cannot pass the root
  directory until the keeper opens it (btrfs), the Engine may find no program to start: that first
  try is dropped and the program started again once the keeper is ready (``_StartGate``).
- A staged command can read back the file its caller reads next (``run_command(read_back=...)``,
  what ``@task.sandbox`` does with its return value): once the command succeeded and nothing of it
  is left, its runner reads the file as the command user and sends it on its status trailer, which
  the command cannot forge; :meth:`DockerExec.read_file` serves that copy, and reads on its own
  whatever the copy cannot serve.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, cast

from sandbox_provider.hooks.docker import driver
from sandbox_provider.hooks.docker import exec as docker_exec
from sandbox_provider.sandbox import batch_stream as batch
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.batch import (
    ImportEntry,
)
from sandbox_provider.sandbox.batch_stream import check_utf8_command
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, OutputSink, RunOutcome
from sandbox_provider.sandbox.spec import WORKDIR_TAG, check_byte_count

log = logging.getLogger(__name__)

__all__ = ["DockerExec"]


def _engine_errors() -> tuple[type[BaseException], ...]:
    import docker.errors
    import requests

    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def _check_whole(handle: str, end: docker_exec.ExecEnd) -> None:
    """
    Refuse the output of a program that writes a status trailer last (the runner, a file operation,
    a control program under docker_op.sh) when it exited by itself (a status under 128) and no
    trailer came: its output was cut short on the way.

    :raises SandboxError: saying so.
    """
    if end.exit_code is not None and end.exit_code < 128 and not (end.trailed or end.swept or end.error):
        raise SandboxError(
            f"The output of a program in sandbox {handle} was cut short: it exited with status {end.exit_code}, "
            "but its output stream from the Docker Engine ended before the program's last line. What it printed "
            "may be incomplete, so none of it is used; run it again (the sandbox is unharmed)."
        )


class _StartGate:
    """
    The output of a new sandbox's first program, which ``docker_wait.sh`` starts: held until the
    wait's mark (:data:`~sandbox_provider.hooks.docker.driver.STARTED_MARK`, first on standard
    output) shows that the program runs, then passed on without the mark. What comes before it is
    not the program's: the Engine's refusal to start it, or the wait's note that the keeper never
    got ready. Standard input (:meth:`hold`) is held as well, so a program that never started read
    none of it. Call :meth:`close` once the exec ended, then :meth:`release` (the held output) unless
    the exec is tried again.
    """

    #: Output held without a mark before it is passed on anyway (the wait writes none: a safeguard).
    MAX_HELD_BYTES = 64 * 1024

    def __init__(self, on_output: Callable[[int, bytes], None]) -> None:
        self._on_output = on_output
        self._held: list[tuple[int, bytes]] = []
        self._head = b""
        self._decided = threading.Event()  # the mark came, or cannot come any more
        self.started = False  # the mark came: the program runs
        self.opened = False  # output goes straight on

    def __call__(self, stream: int, data: bytes) -> None:
        if self.opened:
            self._on_output(stream, data)
            return
        if self._decided.is_set() or stream != 1:
            # The Engine copies the two streams apart: the program's standard error may come before
            # the mark, and is held until it comes.
            self._held.append((stream, data))
            if sum(len(piece) for _, piece in self._held) > self.MAX_HELD_BYTES:
                self.release()
            return
        self._head += data
        mark = driver.STARTED_MARK
        if self._head.startswith(mark):
            held, self._held, rest, self._head = self._held, [], self._head[len(mark) :], b""
            self.started = self.opened = True
            self._decided.set()
            for stream_held, piece in held:
                self._on_output(stream_held, piece)
            if rest:
                self._on_output(1, rest)
        elif not mark.startswith(self._head):
            self._held.append((1, self._head))
            self._head = b""
            self._decided.set()

    def hold(self, source: IO[bytes]) -> IO[bytes]:
        """``source``, read only once the program runs; empty if it never does."""
        gate = self

        class Held:
            def read(self, n: int = -1) -> bytes:
                gate._decided.wait()
                return source.read(n) if gate.started else b""

        return cast(IO[bytes], Held())

    def close(self) -> None:
        """The exec ended: a reader of the held input waits no more."""
        self._decided.set()

    def release(self) -> None:
        """Pass on what was held (nothing once the mark came), and everything after it."""
        held, self._held = self._held, []
        if self._head:  # a part of the mark, and then the stream ended
            held.append((1, self._head))
            self._head = b""
        self._decided.set()
        self.opened = True
        for stream, data in held:
            self._on_output(stream, data)


class DockerExec(batch.ExecTransfers):
    """Mixin: ``_run``, file operations and batch transfers over exec; put it first in the bases."""

    if TYPE_CHECKING:
        workdir: str
        min_transfer_rate: int
        _where: str
        _read_back_paths: dict[str, str]
        _read_backs: dict[str, tuple[str, bytes]]
        _destroyed_because: dict[str, str]

        def _client(self) -> Any: ...
        def _labels(self, handle: str) -> dict[str, str]: ...
        def _resolved(self) -> dict[str, Any]: ...
        def _engine_error(self, err: BaseException, doing: str, handle: str | None = None) -> SandboxError: ...
        def _destroy(self, handle: str) -> None: ...
        def _forget(self, handle: str) -> None: ...
        def _keeper_log(self, container: str) -> str: ...
        def _deadline(self, handle: str, timeout: float) -> float: ...
        def check_handle(self, handle: Any) -> str: ...
        def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int: ...

    def _exec(
        self,
        handle: str,
        argv: list[str],
        *,
        timeout: float,
        on_output: Callable[[int, bytes], None],
        stdin: IO[bytes] | None = None,
        stdin_size: int = 0,
        read_back: str | None = None,
        command_seconds: float | None = None,
    ) -> tuple[RunOutcome, int]:
        """
        Run ``argv`` in the sandbox as its command user, one at a time per sandbox, and sweep after;
        output goes to ``on_output(1 | 2, bytes)``. ``read_back``: the path the runner reads back
        (``runner_argv``); its bytes are kept for the next :meth:`read_file` of it.
        ``command_seconds``: the command's own deadline when ``timeout`` also allows for staging (a
        status of 124 or 137 past it is a timeout).

        Returns the outcome and the bytes read from ``stdin``. A sandbox that cannot be swept is
        destroyed, and the outcome says it ended.
        """
        self._read_backs.pop(handle, None)  # what the sandbox held before this program may change now
        labels = self._labels(handle)
        api = self._client().api
        first = bytearray()

        def deliver(stream: int, data: bytes) -> None:
            if len(first) < 1024:
                first.extend(data[: 1024 - len(first)])
            on_output(stream, data)

        with driver.sandbox_lock(handle):
            self._sweep_first(handle)
            driver.mark_swept(handle, False)
            fresh = driver.is_fresh(handle)
            began = time.monotonic()
            end = self._launch(
                handle,
                argv,
                timeout=timeout,
                on_output=deliver,
                sweep=lambda: driver.sweep(api, handle),
                stdin=stdin,
                stdin_size=stdin_size,
                trust_status=labels[driver.USER_LABEL] != "0:0",
            )
            terminated = self._settle(handle, end, read_back)
        if fresh:
            self._check_keeper(handle, end, first)
        elapsed = time.monotonic() - began
        return self._outcome(handle, end, first, elapsed, command_seconds or timeout, terminated), end.stdin_read

    def _launch(
        self, handle: str, argv: list[str], *, timeout: float, on_output: Any, sweep: Any, **options: Any
    ) -> docker_exec.ExecEnd:
        """
        One exec of ``argv`` as the command user, in the workdir. The first program in a new sandbox
        waits in it for the keeper (``wait_argv``); one the Engine could not start as the command
        user is started once more when the keeper is ready, with nothing of the first try passed on.
        """
        labels = self._labels(handle)
        fresh = driver.is_fresh(handle)
        user = labels[driver.USER_LABEL]
        api = self._client().api
        stdin = options.get("stdin")
        for again in (False, True):
            gate = _StartGate(on_output) if fresh else None
            try:
                end = docker_exec.run_exec(
                    api,
                    handle,
                    driver.wait_argv(argv) if fresh else argv,
                    user=user,
                    workdir=labels.get(WORKDIR_TAG) or self.workdir,
                    deadline=timeout,
                    on_output=gate or on_output,
                    sweep=sweep,
                    **{**options, "stdin": gate.hold(stdin) if gate and stdin is not None else stdin},
                )
            except _engine_errors() as err:  # a task timeout or Ctrl-C raised meanwhile goes on as it is
                raise self._exec_error(err, handle, fresh) from err
            finally:
                if gate is not None:
                    gate.close()
            # Some storage drivers (btrfs) give the container's root directory mode 0700 until the
            # keeper opens it: a program started as the command user before then finds no sh at all.
            # (A program that never started read none of its input: the gate held it.)
            if gate is None or again or end.started or user == "0:0":
                break
            if not driver.wait_for_keeper(api, handle):
                break
            log.debug("Starting the first program in sandbox %s again, now that its keeper is ready", handle)
        if gate is not None:
            gate.release()
        return end

    def _settle(self, handle: str, end: docker_exec.ExecEnd, read_back: str | None) -> bool:
        """After an exec, under the sandbox's lock: mark the sandbox swept, or sweep it; True when it ended."""
        # A runner that ended by itself killed everything else of the command user, and nothing
        # could stop that but killing or stopping it (a status over 127, or the deadline).
        if not end.swept and end.error is None and end.exit_code is not None and end.exit_code < 128:
            driver.mark_swept(handle, True)
            if read_back is not None and end.read_back is not None:
                self._read_backs[handle] = (read_back, end.read_back)
            return False
        return not self._swept_after(handle, already=end.swept and not end.sweep_failed)

    def _outcome(
        self,
        handle: str,
        end: docker_exec.ExecEnd,
        first: bytes | bytearray,
        elapsed: float,
        timeout: float,
        terminated: bool,
    ) -> RunOutcome:
        if not end.started:  # the runtime could not start the program: nothing ran
            text = first.decode(errors="replace").strip()
            raise SandboxTerminalError(f"The Docker Engine could not start a process in sandbox {handle}: {text}")
        if end.error is not None and not terminated:
            raise self._engine_error(end.error, "reading a command's output", handle) from end.error
        code = end.exit_code
        if terminated or code is None:
            return RunOutcome(exit_code=-1, timed_out=end.swept, sandbox_terminated=True)
        _check_whole(handle, end)
        return RunOutcome(exit_code=code, timed_out=end.swept or (code in (124, 137) and elapsed >= timeout))

    def _check_keeper(self, handle: str, end: docker_exec.ExecEnd, first: bytes | bytearray) -> None:
        """After the first program in a new sandbox: it found the keeper ready, or the sandbox is given up."""
        if end.exit_code == driver.KEEPER_MISSING_STATUS and driver.KEEPER_MISSING_MARK in first:
            self._keeper_failed(handle)
        driver.mark_fresh(handle, False)

    def _keeper_failed(self, handle: str) -> None:
        ended = self._destroyed_because.get(handle)
        if ended is not None:  # not the keeper's doing: this worker removed the container (on_kill, say)
            raise SandboxTerminalError(f"Sandbox container {handle} is gone: {ended}.")
        logs = self._keeper_log(handle)
        self._destroy(handle)
        raise SandboxTerminalError(
            f"Sandbox container {handle} started on {self._where} but its keeper did not come up{logs}. The image "
            f"{self._resolved()['image']!r} needs sh, sleep, cp, chmod, chown, mkdir, coreutils timeout and GNU tar; "
            "name another image in the connection's image extra."
        )

    def _exec_error(self, err: BaseException, handle: str, fresh: bool) -> SandboxError:
        import docker.errors

        if fresh and isinstance(err, docker.errors.APIError) and err.status_code in (404, 409):
            driver.mark_fresh(handle, False)
            self._keeper_failed(handle)  # the keeper ended, and the container with it
        return self._engine_error(err, "starting a command", handle)

    def _sweep_first(self, handle: str) -> None:
        """Before the first operation of this process on a sandbox: end what an earlier holder left running."""
        if not driver.known_swept(handle) and not self._swept_after(handle, already=False):
            raise SandboxTerminalError(
                f"Sandbox {handle} was destroyed: its keeper did not answer, so processes left running in it by an "
                "earlier command could not be ended. Provision a new sandbox."
            )

    def _swept_after(self, handle: str, *, already: bool) -> bool:
        """
        True once the keeper has swept the sandbox (or ``already`` did); False when the sandbox has
        ended, or did not answer and was destroyed.
        """
        import docker.errors

        api = self._client().api
        try:
            done = already or driver.sweep(api, handle)
        except docker.errors.APIError as err:
            if err.status_code in (404, 409):
                self._forget(handle)
                return False
            raise self._engine_error(err, "sweeping the sandbox after a command", handle) from err
        except Exception as err:
            raise self._engine_error(err, "sweeping the sandbox after a command", handle) from err
        if not done:
            if not driver.is_running(api, handle):
                self._forget(handle)
                return False
            log.warning(
                "Destroying Docker sandbox %s: its keeper did not confirm within %ss that no process of the last "
                "command is left (something in the sandbox stopped it)",
                handle,
                driver.SWEEP_TIMEOUT,
            )
            self._destroy(handle)
            return False
        driver.mark_swept(handle, True)
        return True

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        check_utf8_command(command)
        self._read_back_paths.pop(handle, None)  # read back only by a staged run's runner, whose allowance has room
        argv = driver.runner_argv(command, timeout)

        def deliver(stream: int, data: bytes) -> None:
            (output.stderr if stream == 2 else output.stdout)(data)

        outcome, _ = self._exec(handle, argv, timeout=float(driver.deadline_arg(timeout)), on_output=deliver)
        return outcome

    def _control(self, handle: str, command: str, *, timeout: float, starts: bool, output: OutputSink) -> int:
        # A detached command's control programs run bare, not under the runner: its closing kill(-1)
        # would end the job, and so would a sweep after them. The one that starts a job first ends
        # what an earlier holder left running, as any command does; the job then runs unswept until
        # a later command or file operation of a process that did not start it sweeps it (the task
        # resuming after the job ended, say).
        def deliver(stream: int, data: bytes) -> None:
            (output.stderr if stream == 2 else output.stdout)(data)

        with driver.sandbox_lock(handle):
            if starts:
                self._sweep_first(handle)
                driver.mark_swept(handle, False)
            fresh = driver.is_fresh(handle)
            # A control program past its deadline is left as it is: the job must live on.
            # Under docker_op.sh, which ends the output with a trailer once the program returns. Its
            # status is the Engine's: the job it checks on runs beside it, as the same user.
            end = self._launch(
                handle,
                driver.op_argv(command, "sandbox-control"),
                timeout=timeout,
                on_output=deliver,
                sweep=lambda: True,
                trust_status=False,
            )
        if fresh:
            self._check_keeper(handle, end, output.err.getvalue())
        if end.error is not None:
            raise self._engine_error(end.error, "checking on a detached command", handle) from end.error
        if end.exit_code is None or end.swept:
            if not driver.is_running(self._client().api, handle):
                self._forget(handle)
                raise SandboxTerminalError(f"Sandbox {handle} ended while a detached command was checked on.")
            raise SandboxError(f"Checking on a detached command in sandbox {handle} took longer than {timeout:g}s.")
        _check_whole(handle, end)
        return end.exit_code

    def _op_argv(self, program: str, args: Sequence[str]) -> list[str]:
        return driver.op_argv(guest.program(program), program, *args)

    def _archive_owner(self, handle: str) -> tuple[int, int]:
        uid, _, gid = self._labels(handle)[driver.USER_LABEL].partition(":")
        return int(uid), int(gid or uid)

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """
        List the entries of the directory at ``path`` as ``(name, is_directory)`` pairs, sorted by name.

        :raises SandboxError: if ``path`` is unusable, missing or not a directory.
        """
        return super().list_directory(handle, self._check_path(path))  # type: ignore[misc]

    # -- batch transfers: one exec per direction (see sandbox/batch_stream.py) -------------------------

    def _read_back_hint(self, handle: str, path: str) -> None:
        # The runner of the next command reads the file back on its trailer, which only a command
        # user's runner can vouch for (a root command could read its token and forge it).
        if self._labels(handle)[driver.USER_LABEL] != "0:0" and batch.is_utf8(path):
            self._read_back_paths[handle] = path

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of ``path``: the copy the last command's runner read back when it was
        asked to (``run_command(read_back=path)``) and it fits ``max_bytes``, or else read now.

        :raises SandboxFileTooLargeError: over ``max_bytes``; :raises SandboxError: for a missing,
            unreadable or not regular file; :raises SandboxTerminalError: if the sandbox is gone.
        """
        handle = self.check_handle(handle)
        self._check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        kept = self._read_backs.get(handle)
        if kept is not None and kept[0] == path and len(kept[1]) <= max_bytes:
            return kept[1]
        return super().read_file(handle, path, max_bytes=max_bytes)  # type: ignore[misc]

    def _run_staged(
        self, handle: str, command: str, stage: Sequence[ImportEntry], *, timeout: float, output: OutputSink
    ) -> RunOutcome:
        # The files and the command in one exec: the runner extracts the archive, then runs the
        # command, then reads back the file the caller reads next, if it named one.
        read_back = self._read_back_paths.pop(handle, None)
        archive = self._archive(handle, stage)
        errors = batch.StagedErrors(output)
        argv = driver.runner_argv(command, timeout, staged=True, read_back=read_back)
        allowance = float(driver.deadline_arg(timeout)) + max(FILE_OP_TIMEOUT, archive.size / self.min_transfer_rate)
        outcome, _ = self._exec(
            handle,
            argv,
            timeout=allowance,
            on_output=errors.deliver,
            stdin=cast(IO[bytes], archive),
            stdin_size=archive.size,
            read_back=read_back,
            command_seconds=float(driver.deadline_arg(timeout)),
        )
        errors.check(stage, archive, outcome.exit_code)
        return outcome
