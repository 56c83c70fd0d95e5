"""
The producer half of output handling: what a backend uses while a command runs (a bounded tail of
each stream, a thread that drains a stream into it) and the words a message needs. What a consumer
shows of the output (tails for a model, task-log lines, masks, file windows) is in
:mod:`sandbox_provider.engine.output`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["StreamDrain", "TailBuffer", "format_size", "format_time", "listing"]


_NEWLINE = 0x0A


class TailBuffer:
    """
    Keep the last ``limit`` bytes written to it, and remember whether anything was dropped.

    Memory stays within about twice ``limit`` however much is written, so a command that prints
    gigabytes costs the worker a bounded amount. It also counts everything written (``total``
    bytes, :attr:`lines`) and whether the kept tail begins at the start of a line, so a reader can
    say exactly what the tail leaves out.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self._buf = bytearray()
        self.total = 0
        self.newlines = 0
        self.truncated = False
        self._last: int | None = None  # the last byte written, None before any
        self._head_at_line = True  # the first kept byte starts a line

    def write(self, data: bytes) -> None:
        if not data:
            return
        before = self._last
        self.total += len(data)
        self.newlines += data.count(b"\n")
        self._last = data[-1]
        if len(data) >= self.limit:
            if self._buf or len(data) > self.limit:
                self.truncated = True
            cut = len(data) - self.limit
            self._head_at_line = data[cut - 1] == _NEWLINE if cut else before in (None, _NEWLINE)
            self._buf = bytearray(data[cut:]) if self.limit else bytearray()
            return
        self._buf += data
        if len(self._buf) > 2 * self.limit:
            cut = len(self._buf) - self.limit
            self._head_at_line = self._buf[cut - 1] == _NEWLINE
            del self._buf[:cut]
            self.truncated = True

    def account(self, *, total_bytes: int, newlines: int) -> None:
        """
        Take a producer's count of the whole stream, when what was written here is only its tail
        (a guest program that keeps the output and replays the end): ``total_bytes`` bytes and
        ``newlines`` newline characters in all. Whether that tail began a line is then not known,
        so it is taken as not.
        """
        if total_bytes > self.total:
            self.truncated = True
            self._head_at_line = False
        self.total = max(self.total, int(total_bytes))
        self.newlines = max(self.newlines, int(newlines))

    def restate(self, data: bytes, *, total_bytes: int, newlines: int) -> None:
        """
        Hold ``data`` in place of everything written so far: the last ``len(data)`` bytes of a stream of
        ``total_bytes`` bytes and ``newlines`` newline characters in all, read once the stream ended (a
        backend whose live stream reshaped the output). Give one byte more than ``limit`` when the
        stream is longer: that byte says whether the kept tail begins a line.
        """
        self._buf, self.total, self.newlines, self.truncated = bytearray(), 0, 0, False
        self._last, self._head_at_line = None, True
        self.write(data)
        if total_bytes > len(data) and len(data) <= self.limit:
            self.truncated, self._head_at_line = True, False
        self.total, self.newlines = int(total_bytes), int(newlines)

    @property
    def lines(self) -> int:
        """Lines written: newline characters, plus one for a last line without one."""
        return self.newlines + (1 if self._last not in (None, _NEWLINE) else 0)

    def _kept(self) -> tuple[bytes, bool]:
        """The kept bytes (at most ``limit``) and whether they begin at the start of a line."""
        if len(self._buf) <= self.limit:
            return bytes(self._buf), self._head_at_line
        self.truncated = True
        cut = len(self._buf) - self.limit
        return bytes(self._buf[cut:]), self._buf[cut - 1] == _NEWLINE

    def getvalue(self) -> bytes:
        return self._kept()[0]

    def tail(self, *, whole_lines: bool = False) -> tuple[str, bool]:
        """
        The kept bytes decoded as UTF-8 (a character cut at the start is replaced, not fatal), and
        whether that text begins at the start of a line.

        :param whole_lines: drop a partial first line, when that still leaves most of what was kept.
        """
        data, at_line = self._kept()
        if whole_lines and not at_line:
            cut = data.find(b"\n")
            if 0 <= cut < len(data) // 2:
                data, at_line = data[cut + 1 :], True
        return data.decode("utf-8", errors="replace"), at_line

    def text(self, *, whole_lines: bool = False) -> str:
        """The kept bytes decoded as UTF-8; see :meth:`tail`."""
        return self.tail(whole_lines=whole_lines)[0]


class StreamDrain(threading.Thread):
    """
    A daemon thread that reads an iterable of chunks (bytes, or text encoded as UTF-8) to its end,
    handing each to ``write``. An exception from the stream ends the thread and is kept in ``error``
    for the caller to judge.
    """

    def __init__(self, chunks: Iterable[bytes | str], write: Callable[[bytes], None]) -> None:
        super().__init__(daemon=True, name="sandbox-output")
        self._chunks = chunks
        self._write = write
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self._chunks:
                self._write(chunk.encode() if isinstance(chunk, str) else chunk)
        except BaseException as err:  # noqa: BLE001 - handed to the caller, which decides
            self.error = err


def listing(items: list[str]) -> str:
    """Join words for a sentence: ``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def format_size(n: int) -> str:
    """Format a byte count for people: ``512B``, ``1.5KB``, ``5.0MB`` (1024-based)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{int(size)}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TB"


def format_time(unix_seconds: float) -> str:
    """A moment as every log line and message of the provider writes it: UTC, to the second, ``2026-12-04T08:19:31Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_seconds))
