"""
The one thread per worker process that finishes what ``destroy(wait=False)`` leaves: a sandbox's
files, its emptied cgroup and its user id lease, after the destroy has returned.

A destroy hands its removal over with :func:`submit`, which never waits for this thread (a new thread
per removal made each destroy wait for that thread to start). Removals run one after another, in
the order given. The worker process waits for them as it exits (``atexit``), and
:func:`wait` lets a caller that counts what is left (a test, a benchmark) wait too. A worker killed
first leaves the ``.destroyed-`` directory to the next sweep. A forked worker starts afresh: the
parent's removals stay the parent's.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["submit", "wait"]

_idle = threading.Condition()
_pending = 0
_queue: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_waited_at_exit = False


def _serve(work: queue.SimpleQueue) -> None:
    global _pending
    while True:
        removal = work.get()
        try:
            removal()
        except Exception:  # the caller's removal logs its own; this thread must go on
            log.warning("A sandbox removal failed; the next sweep removes what is left", exc_info=True)
        finally:
            with _idle:
                _pending -= 1
                if _pending == 0:
                    _idle.notify_all()


def submit(removal: Callable[[], None]) -> None:
    """
    Run ``removal()`` in this process's removal thread (started on first use); return at once.
    Where no thread can be started (the interpreter is shutting down, say), run it here and now.
    """
    global _pending, _thread, _waited_at_exit
    with _idle:
        _pending += 1
        if not _waited_at_exit:
            # Registered now, after the cgroup probe's own exit hook: run before it (last in, first out),
            # so the cgroup parents are removed once the sandboxes' cgroups are gone.
            atexit.register(wait, None)
            _waited_at_exit = True
        started = _thread is not None and _thread.is_alive()
        if not started:
            # A daemon that the process waits for at exit (above) rather than joins: it lives as long as the process.
            thread = threading.Thread(target=_serve, args=(_queue,), name="sandbox-removals", daemon=True)
            try:
                thread.start()
                _thread, started = thread, True
            except RuntimeError:
                _pending -= 1
    if started:
        _queue.put(removal)
    else:
        removal()


def wait(timeout: float | None = 60.0) -> bool:
    """Wait up to ``timeout`` seconds (None: as long as it takes) until no removal is left; return whether none is."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout)


def _after_fork_in_child() -> None:
    global _idle, _pending, _queue, _thread
    _idle, _pending, _queue, _thread = threading.Condition(), 0, queue.SimpleQueue(), None


os.register_at_fork(after_in_child=_after_fork_in_child)
