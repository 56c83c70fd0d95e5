"""
The one thread that starts every local sandbox command, so that it starts where it must, at no cost
of a program of its own:

- in a fresh, empty session keyring: kernel credentials, the session keyring among them, belong to
  a thread, and a child gets those of the thread that forked it. Before each command this thread
  joins a new anonymous session keyring (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``), which
  changes nothing for the worker's other threads. The command holds that keyring alone: the
  worker's own keyrings, and every other command's, are out of its reach;
- in its sandbox's cgroup, on cgroup v1: the thread moves itself into the sandbox's cgroups
  (``tasks``: a thread moving itself is the case the kernel does without a global lock), forks,
  and moves itself back, so the command's first process is born there.

``bwrap --die-with-parent`` kills a command when the thread that started it ends: this one lives
as long as the worker process. A forked worker (LocalExecutor forks its task runners) starts its
own. A worker that may not make keyrings (one under a system-call filter of its own, as in a
Docker container) says so once in its log and starts commands with the keyring it has; the
sandbox's filter refuses every keyring call all the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import queue
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from sandbox_provider.hooks.local.seccomp import syscall_number

log = logging.getLogger(__name__)

__all__ = ["Placement", "join_new_session_keyring", "placing", "spawn"]

#: Called in the spawning thread: the (file to move into, file to move back to) pairs of a command.
Placement = Callable[[], Sequence[tuple[str, str]]]

_KEYCTL_JOIN_SESSION_KEYRING = 1
_lock = threading.Lock()
_requests: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_warned = False
#: Held while the spawner thread sits in a sandbox's cgroup (v1): a kill of that cgroup in this process
#: takes it too, so it never finds the worker itself among the sandbox's processes.
placing = threading.Lock()


@functools.lru_cache(maxsize=1)
def _keyctl():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc, syscall_number("keyctl")


def join_new_session_keyring() -> int | None:
    """Give the calling thread a new, empty anonymous session keyring; return its id, or None if refused."""
    global _warned
    libc, number = _keyctl()
    serial = libc.syscall(ctypes.c_long(number), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), None)
    if serial >= 0:
        return int(serial)
    if not _warned:
        _warned = True
        log.warning(
            "This worker may not make kernel keyrings (errno %d); local sandbox commands start with its session "
            "keyring, which their system-call filter keeps them from using.",
            ctypes.get_errno(),
        )
    return None


def _move_self(path: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def _start(argv: list[str], placement: Placement | None, kwargs: dict[str, Any]) -> subprocess.Popen:
    join_new_session_keyring()
    if placement is None:
        return subprocess.Popen(argv, **kwargs)
    moved: list[str] = []
    with placing:
        try:
            for enter, back in placement():
                _move_self(enter)
                moved.append(back)
            return subprocess.Popen(argv, **kwargs)
        finally:
            for back in reversed(moved):
                try:
                    _move_self(back)
                except OSError:
                    log.warning("The sandbox spawner could not move back to its cgroup %s", back, exc_info=True)


def _serve() -> None:
    while True:
        argv, placement, kwargs, future = _requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(_start(argv, placement, kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)


def _kill_late(future: Future) -> None:
    """A command its caller stopped waiting for (interrupted): it must not run unwatched."""
    if future.exception() is None:
        proc = future.result()
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()


def _after_fork_in_child() -> None:
    global _lock, _requests, _thread, placing
    _lock, _requests, _thread, placing = threading.Lock(), queue.SimpleQueue(), None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def spawn(argv: list[str], *, placement: Placement | None = None, **kwargs: Any) -> subprocess.Popen:
    """
    :class:`subprocess.Popen` ``argv`` with ``kwargs`` from the spawner thread: in a new session
    keyring of its own, and, with ``placement``, born in the cgroups it names.

    :raises OSError: as Popen does, or when the thread cannot move into the sandbox's cgroup.
    """
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="sandbox-spawner", daemon=True)
            _thread.start()
    future: Future = Future()
    _requests.put((argv, placement, kwargs, future))
    try:
        return future.result()
    except BaseException:
        if not future.cancel() and not future.done():  # interrupted while it starts
            future.add_done_callback(_kill_late)
        raise
