"""Bounded output handling shared by every backend and consumer."""

from __future__ import annotations

import threading
from typing import IO

__all__ = ["TailBuffer", "drain_into", "format_size", "tail_text"]


class TailBuffer:
    """
    Keep the last ``limit`` bytes written to it, and remember whether anything was dropped.

    Memory stays within about twice ``limit`` however much is written, so a command that prints
    gigabytes costs the worker a bounded amount.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self._buf = bytearray()
        self.total = 0
        self.truncated = False

    def write(self, data: bytes) -> None:
        self.total += len(data)
        if len(data) >= self.limit:
            if self._buf or len(data) > self.limit:
                self.truncated = True
            self._buf = bytearray(data[len(data) - self.limit :]) if self.limit else bytearray()
            return
        self._buf += data
        if len(self._buf) > 2 * self.limit:
            del self._buf[: len(self._buf) - self.limit]
            self.truncated = True

    def getvalue(self) -> bytes:
        if len(self._buf) > self.limit:
            self.truncated = True
            return bytes(self._buf[len(self._buf) - self.limit :])
        return bytes(self._buf)

    def text(self) -> str:
        """The kept bytes decoded as UTF-8; a character cut at the start is replaced, not fatal."""
        return self.getvalue().decode("utf-8", errors="replace")


def drain_into(stream: IO[bytes], sink: TailBuffer, chunk: int = 65536) -> threading.Thread:
    """Start a daemon thread that reads ``stream`` to its end into ``sink``; return the thread."""

    def _pump() -> None:
        try:
            while True:
                data = stream.read1(chunk) if hasattr(stream, "read1") else stream.read(chunk)
                if not data:
                    break
                sink.write(data)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=_pump, daemon=True, name="sandbox-output")
    thread.start()
    return thread


def tail_text(text: str, max_chars: int) -> str:
    """Return at most the last ``max_chars`` characters of ``text``, marking a cut with an ellipsis line."""
    if len(text) <= max_chars:
        return text
    return "[... earlier output cut]\n" + text[len(text) - max_chars :]


def format_size(n: int) -> str:
    """Format a byte count for people: ``512B``, ``1.5KB``, ``5.0MB`` (1024-based)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{int(size)}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TB"
