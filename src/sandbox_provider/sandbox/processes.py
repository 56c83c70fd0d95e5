"""Processes of the worker's own host, as ``/proc`` shows them."""

from __future__ import annotations

__all__ = ["running"]


def running(pid: int) -> bool:
    """
    Whether process ``pid`` exists and has not finished exiting: False once it is gone, a zombie, or
    (for a process whose main thread has exited while other threads run) its main thread is.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
