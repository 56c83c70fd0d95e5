"""
Commands and file operations of the Kubernetes backend, as a mixin of
:class:`~sandbox_provider.hooks.kubernetes.hook.KubernetesSandboxHook`: every program runs through
the Pod's exec subresource as the Pod's user, one at a time per sandbox in this process.

- A command runs under the runner (``guest/k8s_run.sh``), whose closing ``kill(-1)`` ends every
  other process of the sandbox's user but the keeper. When the runner did not end by itself (a status
  over 127, no status at all, or no end by the deadline), the hook sweeps: a second exec that does the
  same ``kill(-1)``.
- A file operation runs a shared guest program under ``guest/k8s_op.sh``; its bytes travel on the
  exec's standard streams (see :mod:`~sandbox_provider.hooks.kubernetes.exec`), never through a tail buffer.
- A batch (``import_batch``, ``export_batch``, files staged with a command) is one exec per direction:
  one tar stream, extracted or written by GNU ``tar`` as the Pod's user (see
  :mod:`~sandbox_provider.sandbox.batch_stream`, shared with the Docker backend).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, cast

from sandbox_provider.hooks.kubernetes import driver
from sandbox_provider.hooks.kubernetes.exec import ExecEnd, run_exec
from sandbox_provider.sandbox import batch_stream as batch
from sandbox_provider.sandbox.batch import ImportEntry
from sandbox_provider.sandbox.batch_stream import check_utf8_command
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, OutputSink, RunOutcome

log = logging.getLogger(__name__)

__all__ = ["KubernetesExec"]

#: The lock one command or file operation at a time holds on a sandbox, by handle (per process).
_LOCKS: dict[str, threading.Lock] = {}
_GUARD = threading.Lock()


def sandbox_lock(handle: str) -> threading.Lock:
    """The lock that one program at a time holds on sandbox ``handle`` in this process."""
    with _GUARD:
        return _LOCKS.setdefault(handle, threading.Lock())


class KubernetesExec(batch.ExecTransfers):
    """
    Mixin: ``_run``, and (through :class:`~sandbox_provider.sandbox.batch_stream.ExecTransfers`) file
    operations and batch transfers over exec; put it first in the bases.
    """

    if TYPE_CHECKING:
        workdir: str

        def _open_exec(self, handle: str, argv: list[str], *, stdin: bool) -> Any: ...
        def _resolved(self) -> dict[str, Any]: ...
        def _running_pod(self, handle: str) -> dict[str, Any]: ...
        def _ended(self, handle: str, *, settle: float = 0.0) -> str | None: ...
        def _forget(self, handle: str) -> None: ...
        def _deadline(self, handle: str, timeout: float) -> float: ...
        def check_handle(self, handle: Any) -> str: ...

    def _exec(
        self,
        handle: str,
        argv: list[str],
        *,
        timeout: float,
        on_output: Callable[[int, bytes], None],
        stdin: IO[bytes] | None = None,
        stdin_size: int = 0,
        command_seconds: float | None = None,
    ) -> tuple[RunOutcome, int]:
        """
        Run ``argv`` in the sandbox, one program at a time per sandbox, and sweep after it when it did
        not end by itself; output goes to ``on_output(1 | 2, bytes)``. ``command_seconds``: the
        command's own deadline when ``timeout`` also allows for staging (a status of 124 or 137 past
        it is a timeout). Returns the outcome and the bytes read from ``stdin``.
        """
        self._running_pod(handle)
        with sandbox_lock(handle):
            began = time.monotonic()
            end = run_exec(
                lambda: self._open_exec(handle, argv, stdin=stdin is not None),
                deadline=timeout,
                on_output=on_output,
                sweep=lambda: self._sweep(handle),
                stdin=stdin,
                stdin_size=stdin_size,
            )
            elapsed = time.monotonic() - began
            ended = None
            if end.exit_code is None or end.exit_code > 127 or (end.overran and not end.swept):
                # The runner did not end by itself: sweep, unless the sandbox itself ended (at its lifetime).
                # A sweep that cannot even start means the container is going: wait for the Pod to say so.
                if end.swept:
                    settle: float | None = 0.0
                else:
                    settle = None if self._sweep(handle) else driver.ENDING_SETTLE_SECONDS
                if settle is not None:
                    ended = self._ended(handle, settle=settle)
        return self._outcome(handle, end, elapsed, command_seconds or timeout, ended), end.stdin_read

    def _sweep(self, handle: str) -> bool:
        """End every process of the sandbox's user but the keeper, with an exec of its own; False when it could not."""
        try:
            end = run_exec(
                lambda: self._open_exec(handle, driver.SWEEP_ARGV, stdin=False),
                deadline=FILE_OP_TIMEOUT,
                on_output=lambda stream, data: None,
                sweep=lambda: False,
            )
        except Exception:  # the sandbox is gone, or the API server does not answer: the caller finds out
            log.debug("Could not sweep sandbox %s", handle, exc_info=True)
            return False
        return end.exit_code == 0

    def _outcome(self, handle: str, end: ExecEnd, elapsed: float, timeout: float, ended: str | None) -> RunOutcome:
        if end.exit_code is None:
            ended = ended or self._ended(handle)
            if ended is None and not end.overran:
                raise SandboxError(f"Sandbox {handle} could not run the program: {end.message}")
        if ended is not None:
            self._forget(handle)
            return RunOutcome(exit_code=-1, timed_out=end.overran, sandbox_terminated=True)
        if end.exit_code is None:
            return RunOutcome(exit_code=-1, timed_out=True)
        code = end.exit_code
        return RunOutcome(exit_code=code, timed_out=end.overran or (code in (124, 137) and elapsed >= timeout))

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        argv = driver.runner_argv(check_utf8_command(command), timeout, self.workdir)

        def deliver(stream: int, data: bytes) -> None:
            (output.stderr if stream == 2 else output.stdout)(data)

        outcome, _ = self._exec(handle, argv, timeout=timeout, on_output=deliver)
        return outcome

    def _control(self, handle: str, command: str, *, timeout: float, starts: bool, output: OutputSink) -> int:
        # A detached command's control programs run bare, in the workdir, not under the runner: its
        # closing kill(-1) would end the job, and so would a sweep after them.
        self._running_pod(handle)

        def deliver(stream: int, data: bytes) -> None:
            (output.stderr if stream == 2 else output.stdout)(data)

        argv = ["sh", "-c", 'cd -- "$1" && exec sh -c "$2"', "sandbox-job", self.workdir, check_utf8_command(command)]
        with sandbox_lock(handle):
            # A control program past its deadline is left as it is: the job must live on.
            end = run_exec(
                lambda: self._open_exec(handle, argv, stdin=False),
                deadline=timeout,
                on_output=deliver,
                sweep=lambda: True,
            )
        if end.exit_code is None:
            if self._ended(handle) is not None:
                self._forget(handle)
                raise SandboxTerminalError(f"Sandbox {handle} ended while a detached command was checked on.")
            raise SandboxError(f"Checking on a detached command in sandbox {handle} failed: {end.message}")
        return end.exit_code

    def _op_argv(self, program: str, args: Sequence[str]) -> list[str]:
        return driver.op_argv(self.workdir, program, *args)

    def _archive_owner(self, handle: str) -> tuple[int, int]:
        uid = int(self._resolved()["sandbox_uid"])
        return uid, uid

    # -- batch transfers: one exec per direction ----------------------------------------------------------

    def _run_staged(
        self, handle: str, command: str, stage: Sequence[ImportEntry], *, timeout: float, output: OutputSink
    ) -> RunOutcome:
        # The files and the command in one exec: the runner extracts the archive, then runs the command.
        archive = self._archive(handle, stage)
        errors = batch.StagedErrors(output)
        argv = driver.runner_argv(check_utf8_command(command), timeout, self.workdir, staged=True)
        allowance = timeout + max(FILE_OP_TIMEOUT, archive.size / self.min_transfer_rate)
        outcome, _ = self._exec(
            handle,
            argv,
            timeout=allowance,
            on_output=errors.deliver,
            stdin=cast(IO[bytes], archive),
            stdin_size=archive.size,
            command_seconds=timeout,
        )
        errors.check(stage, archive, outcome.exit_code)
        return outcome
