"""
Watching the task's supervisor: a sandbox must not keep working for a task process nobody supervises.

Airflow runs a task in a process forked by its supervisor, which heartbeats, relays logs and reports
the outcome. When the supervisor is killed, the task process lives on, unsupervised: its log goes
nowhere and the scheduler will start a new try beside it. :class:`SupervisorWatch` notices the
supervisor's exit the moment it happens (a pidfd, no polling) and calls back, so the session can end
the sandbox instead of letting its command run on for as long as its timeout allows.

The task log goes with the supervisor, which relays it, so what the session says then would reach
nobody: :meth:`SupervisorWatch.tell_worker` writes it to the standard error of the process that
started the supervisor (the worker: the LocalExecutor's scheduler, a Celery worker), opened while the
supervisor still lived, which is the worker's own log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from sandbox_provider.sandbox.output import format_time

log = logging.getLogger(__name__)

__all__ = ["SupervisorWatch", "supervisor_pid"]


def supervisor_pid() -> int | None:
    """
    The pid of the supervisor of this task process, or None when this is not a supervised task
    process (``dag.test()`` runs tasks in the supervisor's own process; a script has no supervisor).
    """
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.comms import CommsDecoder
    except ImportError:
        return None
    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
    if not isinstance(comms, CommsDecoder):
        return None
    parent = os.getppid()
    return parent if parent > 1 else None


class SupervisorWatch:
    """
    Call ``on_gone()`` once, from a daemon thread, when the process ``pid`` exits.

    :param pid: the process to watch (the supervisor).
    :param on_gone: what to do then; its exceptions are logged.
    """

    def __init__(self, pid: int, on_gone: Callable[[], None]) -> None:
        self.pid = pid
        self._on_gone = on_gone
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._worker_stderr: int | None = None
        self.fired = False

    def start(self) -> SupervisorWatch:
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pidfd = None
        except OSError:  # no pidfds on this kernel: no watch, as before
            log.debug("Cannot watch the supervisor %d on this kernel", self.pid, exc_info=True)
            self._close_pipe()
            return self
        if pidfd is not None and os.getppid() != self.pid:
            # Reparented already: the supervisor is gone, and the pid may name another process now.
            os.close(pidfd)
            pidfd = None
        if pidfd is not None:
            self._worker_stderr = _open_parent_stderr(self.pid)
        self._thread = threading.Thread(target=self._wait, args=(pidfd,), daemon=True, name="sandbox-supervisor")
        self._thread.start()
        return self

    def _wait(self, pidfd: int | None) -> None:
        try:
            if pidfd is not None:
                ready, _, _ = select.select([pidfd, self._stop_r], [], [])
                if self._stop_r in ready:
                    return
            # The supervisor exited (or had already, before the watch began: the pid is no parent now).
            self.fired = True
            try:
                self._on_gone()
            except Exception:
                log.warning("Could not end the sandbox after the task's supervisor exited", exc_info=True)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def tell_worker(self, message: str) -> bool:
        """
        Write ``message`` as one line, stamped with the time and this process, to the standard error of
        the worker that started the supervisor; returns whether it went anywhere.
        """
        fd = self._worker_stderr
        if fd is None:
            return False
        line = f"{format_time(time.time())} airflow-sandbox (task process {os.getpid()}): {message}\n"
        try:
            os.write(fd, line.encode("utf-8", errors="replace"))
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """Stop watching; safe to call more than once."""
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._stop_r, self._stop_w, self._worker_stderr):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._stop_r = self._stop_w = -1
        self._worker_stderr = None


def _open_parent_stderr(pid: int) -> int | None:
    """
    A descriptor for appending to the standard error of ``pid``'s parent, or None: no such process
    that this one may write to, or the parent is init (whose standard error is nobody's log).
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            parent = int(stat.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    if parent <= 1:
        return None
    try:
        return os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
