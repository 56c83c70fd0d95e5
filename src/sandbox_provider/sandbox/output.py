"""Bounded output handling shared by every backend and consumer."""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "LineLog",
    "TailBuffer",
    "StreamDrain",
    "drop_head_bytes",
    "file_window",
    "format_size",
    "head_lines",
    "longest_secret_bytes",
    "mask_text",
    "tail_lines",
    "tail_text",
]


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

    def text(self, *, whole_lines: bool = False) -> str:
        """
        The kept bytes decoded as UTF-8; a character cut at the start is replaced, not fatal.

        :param whole_lines: after a cut, drop the partial first line too, when that still leaves
            most of what was kept.
        """
        data = self.getvalue()
        if whole_lines and self.truncated:
            cut = data.find(b"\n")
            if 0 <= cut < len(data) // 2:
                data = data[cut + 1 :]
        return data.decode("utf-8", errors="replace")


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


class LineLog:
    """
    An ``on_output`` callback for :meth:`~sandbox_provider.sandbox.hook.SandboxHook.run_command` that
    writes a command's output to ``logger`` line by line, as it arrives: for live task logs.

    Each stream is decoded as UTF-8 as it comes (a character split between pieces stays whole; bad
    bytes become U+FFFD), held only until its line ends, masked with Airflow's secret masker, and
    logged at INFO as ``[stdout] <line>`` or ``[stderr] <line>``. A line longer than
    ``max_line_chars`` is logged in pieces of that size, each after the first marked ``[stdout+]``,
    so memory stays bounded whatever a command prints. Safe to call from several reader threads.

    :param logger: where the lines go: the task's ``self.log``, or any logger with ``info(message, *args)``.
    :param max_line_chars: the longest piece of a line held and logged at once, in characters.
    """

    def __init__(self, logger: Any, *, max_line_chars: int = 16 * 1024) -> None:
        self._log = logger
        self._max = max(1, int(max_line_chars))
        self._lock = threading.Lock()
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
        self._held = {"stdout": "", "stderr": ""}
        self._continued = {"stdout": False, "stderr": False}

    def __call__(self, stream: str, data: bytes) -> None:
        if stream not in self._held:
            return
        with self._lock:
            text = self._held[stream] + self._decoders[stream].decode(data)
            *lines, rest = text.split("\n")
            for line in lines:
                self._emit(stream, line.removesuffix("\r"))
                self._continued[stream] = False
            while len(rest) > self._max:
                self._emit(stream, rest[: self._max])
                self._continued[stream] = True
                rest = rest[self._max :]
            self._held[stream] = rest

    def flush(self) -> None:
        """
        Log what is held of a last line that never ended (the command ended, or the task is killed).

        From a signal handler (``on_kill``) that interrupted this very object's writer on the same
        thread, the lock is never free: after a second it gives up, and only that partial line is lost.
        """
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            for stream, decoder in self._decoders.items():
                rest = self._held[stream] + decoder.decode(b"", final=True)
                self._held[stream] = ""
                if rest:
                    self._emit(stream, rest.removesuffix("\r"))
                self._continued[stream] = False
        finally:
            self._lock.release()

    def _emit(self, stream: str, line: str) -> None:
        mark = f"[{stream}+]" if self._continued[stream] else f"[{stream}]"
        self._log.info("%s %s", mark, mask_text(line))


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


def mask_text(text: str) -> str:
    """
    Replace every secret registered with Airflow's secret masker in ``text`` with ``***``.

    Mask first and cut afterwards: a cut made before masking can leave a fragment of a secret
    that no longer matches what the masker knows.
    """
    if not text:
        return text
    from airflow.sdk.log import redact

    masked = redact(text)
    return masked if isinstance(masked, str) else str(masked)


def longest_secret_bytes() -> int | None:
    """
    An upper bound on the UTF-8 length of the secrets Airflow's masker knows (0 when it knows none),
    or None when this Airflow version does not let it be read.

    A producer that cut a stream may have split a secret at the cut; the piece left is shorter than
    this, so dropping this many bytes from the start of the masked stream removes it.
    """
    try:
        from airflow.sdk._shared.secrets_masker import _secrets_masker

        patterns = _secrets_masker().patterns or ()
    except (ImportError, AttributeError):
        return None
    # Each pattern is a secret (or a variant of one) escaped for a regex: never shorter than it.
    return max((len(p.encode("utf-8")) for p in patterns if isinstance(p, str)), default=0)


def _utf8_tail(text: str, max_bytes: int) -> str:
    """The longest suffix of ``text`` whose UTF-8 encoding fits in ``max_bytes``."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[len(data) - max_bytes :].decode("utf-8", errors="ignore")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def tail_lines(text: str, *, max_lines: int, max_bytes: int, already_cut: bool = False) -> str:
    """
    Keep the end of ``text`` under both ``max_lines`` lines and ``max_bytes`` UTF-8 bytes.

    Whole lines are kept, newest last; only when the last line alone is wider than ``max_bytes``
    is its tail kept instead. Anything dropped (or ``already_cut``, when the producer dropped
    bytes before this saw them) is announced on a first line that says how to see more.

    :param max_lines: lines kept at most (positive).
    :param max_bytes: bytes kept at most, newlines included (positive).
    :returns: ``text`` unchanged when it fits and nothing was cut upstream.
    """
    if not text:
        return text
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
        trailing_newline = True
    else:
        trailing_newline = False
    newest_first, dropped = head_lines(lines[::-1], max_lines=max_lines, max_bytes=max_bytes)
    kept = newest_first[::-1]
    if not kept and lines:
        kept = [_utf8_tail(lines[-1], max_bytes)]
        dropped = len(lines) - 1
        partial = True
    else:
        partial = False
    if not dropped and not partial and not already_cut:
        return text
    body = "\n".join(kept) + ("\n" if trailing_newline and kept else "")
    if dropped or partial:
        what = f"{dropped} earlier line(s)" if dropped else "the start of the last line"
        if dropped and partial:
            what += " and the start of the last one"
        note = (
            f"[... {what} not shown; limits are {max_lines} lines and {format_size(max_bytes)}. "
            "Send the output to a file and read it in parts, or filter it with grep, head or tail.]"
        )
    else:
        note = "[... the sandbox dropped the start of this output to keep within its limit]"
    return f"{note}\n{body}"


def file_window(text: str, *, offset: int = 1, limit: int | None = None, max_lines: int, max_bytes: int) -> str:
    """
    Render lines of ``text`` starting at line ``offset`` (1-based), at most ``limit`` of them,
    under ``max_lines`` lines and ``max_bytes`` UTF-8 bytes.

    When lines remain after the window, a last line says how many and which ``offset`` reads on.
    An ``offset`` past the end says how many lines the file has; a first line wider than
    ``max_bytes`` is not shown and the text says how to read part of it.
    """
    lines = text.splitlines()
    total = len(lines)
    if total == 0:
        return "(empty file)"
    if offset > total:
        return f"(nothing at offset {offset}: the file has {total} line(s))"
    wanted = min(max_lines, limit) if limit is not None else max_lines
    start = offset - 1
    kept, _ = head_lines(lines[start:], max_lines=wanted, max_bytes=max_bytes)
    if not kept:
        return (
            f"Line {offset} is wider than the {format_size(max_bytes)} output limit. Read part of it with a "
            f"shell command instead, e.g. sed -n '{offset}p' FILE | cut -c1-2000, or head -c."
        )
    body = "\n".join(kept)
    remaining = total - start - len(kept)
    if remaining:
        body += f"\n[... {remaining} more line(s); read on with offset={offset + len(kept)}]"
    return body


def head_lines(lines: list[str], *, max_lines: int, max_bytes: int) -> tuple[list[str], int]:
    """
    Keep the first of ``lines`` under ``max_lines`` lines and ``max_bytes`` UTF-8 bytes (a newline
    counted between lines); return ``(kept, number dropped)``.
    """
    kept: list[str] = []
    used = 0
    for line in lines:
        cost = _utf8_len(line) + (1 if kept else 0)
        if len(kept) >= max_lines or used + cost > max_bytes:
            break
        kept.append(line)
        used += cost
    return kept, len(lines) - len(kept)


#: The most bytes :func:`mask_stream` drops from the start of a stream its producer cut.
MASK_MARGIN_BYTES = 4096


def mask_stream(text: str, *, cut: bool) -> str:
    """
    Mask the secrets in the tail of a stream, also when the producer cut its start.

    A cut at the start of a stream may split a secret, and the piece left no longer matches what
    the masker knows. That piece lies within the first bytes, shorter than the longest secret, so
    those bytes are dropped (at most :data:`MASK_MARGIN_BYTES`; ask the producer for that much more
    than you show, and the drop costs no output).
    """
    text = mask_text(text)
    if cut:
        longest = longest_secret_bytes()
        text = drop_head_bytes(text, MASK_MARGIN_BYTES if longest is None else min(MASK_MARGIN_BYTES, longest))
    return text


def drop_head_bytes(text: str, n: int) -> str:
    """Drop the first ``n`` UTF-8 bytes of ``text`` (a character split at the cut is dropped too)."""
    data = text.encode("utf-8")
    return data[n:].decode("utf-8", errors="ignore") if len(data) > n else ""
