"""
A command's output in the task log, without ever slowing the command down.

A task log takes lines slowly (in a real task each line crosses to the supervisor and is written
there: about 0.4 ms a line on a loaded worker), and a command can print far faster. So the reader of
the command's output hands whole lines to a bounded queue and returns at once, and a writer thread
of the task logs them. When the queue is full, lines are counted and left out of the log (never out
of the result's tails, which the backend keeps apart), and a line in the log says how many and why.

What reaches the log is the task's :class:`LogPolicy`: every line (``"all"``, the default), the
first and last ``log_output_lines`` lines with a line saying how many were left out between them
(``"head_tail"``), or none, with one line counting them (``"none"``); and at most
``log_output_max_bytes`` bytes of output per task in any mode. The same three names are
:class:`~sandbox_provider.operators.sandbox.SandboxOperator` arguments and connection extras
(:data:`~sandbox_provider.sandbox.settings.TASK_SETTINGS`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_provider.engine.output import mask_text
from sandbox_provider.sandbox.output import format_size
from sandbox_provider.sandbox.settings import TASK_SETTINGS

__all__ = ["LogPolicy", "TaskLog", "log_policy"]

#: Lines waiting for the task log at most; past them (or past :data:`QUEUE_BYTES`), lines are left out.
QUEUE_LINES = 500
#: Bytes of output waiting for the task log at most.
QUEUE_BYTES = 512 * 1024
#: The longest piece of a line logged at once, in bytes; a longer line is logged in pieces.
MAX_LINE_BYTES = 16 * 1024
_STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class LogPolicy:
    """
    What of a command's output reaches the task log.

    :param mode: ``"all"``, ``"head_tail"`` or ``"none"``.
    :param lines: with ``"head_tail"``, how many lines are logged at the start and at the end.
    :param max_bytes: the most bytes of output (as the command wrote them, newlines included) the log
        takes per task, in any mode; None for no ceiling.
    """

    mode: str = "all"
    lines: int = 100
    max_bytes: int | None = None

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> LogPolicy:
        return cls(values["log_output"], values["log_output_lines"], values["log_output_max_bytes"])


def log_policy(arguments: Mapping[str, Any], hook: Any, backend: Any) -> LogPolicy:
    """
    The task's policy: each of ``arguments`` (``log_output``, ``log_output_lines``,
    ``log_output_max_bytes``; None for not given), else the extra of the same name of the backend's
    connection (``backend`` when it is a connection id, else the connection ``hook`` reads, its
    default one included), else the default. A connection that does not exist gives no extras.

    :raises ValueError: for an extra of the wrong kind or out of bounds, naming the connection.
    """
    conn_id = backend if isinstance(backend, str) else None
    if conn_id is None and hook is not None:
        conn_id = getattr(hook, getattr(hook, "conn_name_attr", ""), None) or getattr(hook, "default_conn_name", None)
    extra: Mapping[str, Any] = {}
    if conn_id:
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException

        lookup = getattr(hook, "connection_or_none", None)
        try:
            if lookup is not None and not isinstance(backend, str):
                conn = lookup()  # the hook's own: a default connection found missing is not asked for again
            else:
                conn = BaseHook.get_connection(conn_id)
            extra = conn.extra_dejson if conn is not None else {}
        except AirflowNotFoundException:
            extra = {}
    wanted = {name: extra[name] for name in TASK_SETTINGS.names if name in extra}
    return LogPolicy.from_settings(TASK_SETTINGS.resolve(arguments, wanted, conn_id=conn_id))


class _Gap:
    """Lines left out of the log at one place, by stream, and why (``behind``, ``ceiling``, ``middle``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.counts = {stream: [0, 0] for stream in _STREAMS}

    def add(self, stream: str, lines: int, size: int) -> None:
        self.counts[stream][0] += lines
        self.counts[stream][1] += size


class TaskLog:
    """
    An ``on_output`` callback for :meth:`~sandbox_provider.sandbox.hook.SandboxHook.run_command` that
    logs a command's output to ``logger`` as :class:`LogPolicy` says, one ``[stdout] <line>`` or
    ``[stderr] <line>`` at INFO per line (masked with Airflow's secret masker), without ever blocking
    the reader that calls it.

    Each call splits what arrived into whole lines (a line longer than ``max_line_bytes`` goes in
    pieces, each after the first marked ``[stdout+]``) and queues them; a writer thread logs them.
    :meth:`flush` (the command ended) logs what is held of an unended last line, the last lines of
    ``"head_tail"`` and the count of what was left out, and waits for the writer. Safe to call from
    several reader threads.

    :param logger: where the lines go: the task's ``self.log``, or any logger with ``info(message, *args)``.
    :param policy: what reaches the log; default every line.
    :param queue_lines: lines that may wait for the log; past them lines are left out.
    :param queue_bytes: bytes that may wait for the log.
    :param inline: log in the calling thread, as each call returns, with no writer thread and nothing
        left out for falling behind: for a reader that may wait (the triggerer relaying output the
        sandbox keeps, which must be logged before it moves past it).
    """

    def __init__(
        self,
        logger: Any,
        policy: LogPolicy | None = None,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        queue_lines: int = QUEUE_LINES,
        queue_bytes: int = QUEUE_BYTES,
        inline: bool = False,
    ) -> None:
        self._log = logger
        self._inline = inline
        self.policy = policy or LogPolicy()
        self._max_line = max(4, int(max_line_bytes))
        self._queue_limits = (max(1, queue_lines), max(1, queue_bytes))
        self._lock = threading.Condition(threading.Lock())  # not reentrant: see flush()
        self._queue: collections.deque[Any] = collections.deque()
        self._queued = [0, 0]  # lines, bytes handed over and not yet logged
        self._writer: threading.Thread | None = None
        self._held = {stream: b"" for stream in _STREAMS}
        self._continued = dict.fromkeys(_STREAMS, False)
        self._tail: collections.deque[tuple[str, bytes, int, bool]] = collections.deque()
        self._tail_lines = 0
        self._middle: _Gap | None = None
        self._flushed = True  # nothing arrived since the last flush
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.seen = {stream: [0, 0] for stream in _STREAMS}  #: lines and bytes each stream wrote
        self.left_out = [0, 0]  #: lines and bytes of output left out of the log, for any reason
        self._head_left = self.policy.lines
        self._logged_bytes = 0

    # -- the reader's side: never waits for the log ---------------------------------------------------

    def __call__(self, stream: str, data: bytes) -> None:
        if stream not in self._held or not data:
            return
        with self._lock:
            if self._flushed:
                self._flushed = False
                self._reset_counts()
            buf = self._held[stream] + data
            end = buf.rfind(b"\n") + 1
            if end:
                self._take(stream, buf[:end])
            rest = buf[end:]
            while len(rest) > self._max_line:
                cut = _char_boundary(rest, self._max_line)
                self._take(stream, rest[:cut] + b"\n", piece=True)
                rest = rest[cut:]
            self._held[stream] = rest
        self._write_inline()

    def _take(self, stream: str, block: bytes, *, piece: bool = False) -> None:
        """Route ``block`` (whole lines, each ending in a newline) as the policy says; the lock is held."""
        lines = block.count(b"\n")
        self.seen[stream][0] += lines
        self.seen[stream][1] += len(block) - (1 if piece else 0)
        continued, self._continued[stream] = self._continued[stream], piece
        mode = self.policy.mode
        if mode == "none":
            self.left_out[0] += lines
            self.left_out[1] += len(block)
            return
        if mode == "head_tail":
            head = _first_lines(block, self._head_left)
            if head:
                self._head_left -= head.count(b"\n")
                self._queue_block(stream, head, continued, bounded=False)
            if len(head) < len(block):
                self._keep_tail(stream, block[len(head) :], continued and not head)
            return
        self._queue_block(stream, block, continued)

    def _queue_block(self, stream: str, block: bytes, continued: bool, *, bounded: bool = True) -> None:
        """
        Queue ``block`` for the writer, within the byte ceiling and, when ``bounded``, the queue's
        limits (the head and tail of ``"head_tail"`` and a last unended line are bounded already).
        """
        ceiling = self.policy.max_bytes
        if ceiling is not None and self._logged_bytes + len(block) > ceiling:
            fits = block[: block.rfind(b"\n", 0, max(0, ceiling - self._logged_bytes)) + 1]
            if fits:
                self._queue_block(stream, fits, continued, bounded=bounded)
            self._leave_out("ceiling", stream, block[len(fits) :])
            return
        lines = block.count(b"\n")
        room_lines, room_bytes = self._queue_limits[0] - self._queued[0], self._queue_limits[1] - self._queued[1]
        if bounded and not self._inline and (lines > room_lines or len(block) > room_bytes):
            fits = _first_lines(block, room_lines)
            fits = fits[: fits.rfind(b"\n", 0, max(0, room_bytes)) + 1]
            if fits:
                self._queue_block(stream, fits, continued)
            self._leave_out("behind", stream, block[len(fits) :])
            return
        self._queued[0] += lines
        self._queued[1] += len(block)
        self._logged_bytes += len(block)
        self._queue.append((stream, block, continued))
        self._wake()

    def _leave_out(self, reason: str, stream: str, block: bytes) -> None:
        lines = block.count(b"\n")
        self.left_out[0] += lines
        self.left_out[1] += len(block)
        last = self._queue[-1] if self._queue else None
        if not (isinstance(last, _Gap) and last.reason == reason):
            last = _Gap(reason)
            self._queue.append(last)
            self._wake()
        last.add(stream, lines, len(block))

    def _keep_tail(self, stream: str, block: bytes, continued: bool) -> None:
        """Keep ``block`` among the last ``policy.lines`` lines; what falls out of them is left out."""
        self._tail.append((stream, block, block.count(b"\n"), continued))
        self._tail_lines += self._tail[-1][2]
        while self._tail_lines > self.policy.lines:
            first_stream, first, count, _ = self._tail[0]
            drop = min(count, self._tail_lines - self.policy.lines)
            dropped = _first_lines(first, drop)
            self._middle = self._middle or _Gap("middle")
            self._middle.add(first_stream, drop, len(dropped))
            self.left_out[0] += drop
            self.left_out[1] += len(dropped)
            self._tail_lines -= drop
            if drop == count:
                self._tail.popleft()
            else:
                self._tail[0] = (first_stream, first[len(dropped) :], count - drop, False)

    # -- the end of a command ---------------------------------------------------------------------------

    def flush(self, timeout: float = 60.0) -> bool:
        """
        The command ended: log what is held of a last line that never ended, the last lines of
        ``"head_tail"`` and what was left out, then wait (up to ``timeout`` seconds) until the writer
        has logged everything. Returns whether it has. :attr:`seen` and :attr:`left_out` keep this
        command's counts until the next one starts; a second flush with nothing new does nothing.

        From a signal handler (``on_kill``) that interrupted this object's reader on the same thread,
        the lock is never free: after a second it gives up, and only what was still queued is lost.
        """
        if not self._lock.acquire(timeout=1.0):
            return False
        try:
            if self._flushed:
                return True
            self._flushed = True
            for stream in _STREAMS:
                rest, self._held[stream] = self._held[stream], b""
                if rest:
                    self._take(stream, rest + b"\n", piece=True)
                self._continued[stream] = False
            if self._middle is not None:
                self._queue.append(self._middle)
            for stream, block, _, continued in self._tail:
                self._queue_block(stream, block, continued, bounded=False)
            if self.policy.mode == "none":
                self._queue.append(("summary", dict(self.seen)))
            done = threading.Event()
            self._queue.append(done)
            self._tail.clear()
            self._tail_lines, self._middle = 0, None
            self._wake()
        finally:
            self._lock.release()
        self._write_inline()
        return done.wait(timeout)

    # -- the writer ------------------------------------------------------------------------------------

    def _wake(self) -> None:
        """Start the writer if it is not running, and tell it there is work; the lock is held."""
        if self._inline:
            return
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write, name="sandbox-task-log", daemon=True)
            self._writer.start()
        self._lock.notify()

    def _write(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if not self._lock.wait(timeout=5.0):
                        self._writer = None
                        return
                item = self._queue.popleft()
            try:
                self._write_item(item)
            except Exception:  # noqa: BLE001 - a logger that failed once must not stop the rest, or flush()
                pass

    def _write_inline(self) -> None:
        """With ``inline``: log what is queued, in this thread, now."""
        while self._inline:
            with self._lock:
                if not self._queue:
                    return
                item = self._queue.popleft()
            self._write_item(item)

    def _write_item(self, item: Any) -> None:
        if isinstance(item, threading.Event):
            item.set()
        elif isinstance(item, _Gap):
            self._log.info("%s", self._gap_words(item))
        elif item[0] == "summary":
            self._log.info("%s", _none_words(item[1]))
        else:
            stream, block, continued = item
            try:
                self._log_lines(stream, block, continued)
            finally:
                with self._lock:
                    self._queued[0] -= block.count(b"\n")
                    self._queued[1] -= len(block)

    def _log_lines(self, stream: str, block: bytes, continued: bool) -> None:
        lines = block.decode("utf-8", errors="replace").split("\n")[:-1]
        for number, line in enumerate(lines):
            mark = f"[{stream}+]" if continued and number == 0 else f"[{stream}]"
            self._log.info("%s %s", mark, mask_text(line.removesuffix("\r")))

    def _gap_words(self, gap: _Gap) -> str:
        what = _counted(gap.counts)
        if gap.reason == "middle":
            why = f"log_output='head_tail' logs the first and last {self.policy.lines} lines"
        elif gap.reason == "ceiling":
            why = f"the task's log_output_max_bytes={self.policy.max_bytes} was reached"
        else:
            why = (
                "the command wrote faster than the task log takes lines (set log_output='head_tail' or "
                "log_output_max_bytes to log less)"
            )
        return f"[... {what} not logged: {why}; the result keeps the end of each stream ...]"


def _none_words(seen: Mapping[str, list[int]]) -> str:
    return f"The command printed {_counted(seen)}, not logged: log_output='none'"


def _counted(counts: Mapping[str, list[int]]) -> str:
    """``12 lines (84B) of stdout and 1 line (5B) of stderr``, naming only streams with something."""
    parts = [
        f"{lines} line{'' if lines == 1 else 's'} ({format_size(size)}) of {stream}"
        for stream, (lines, size) in counts.items()
        if lines or size
    ]
    return " and ".join(parts) or "nothing"


def _first_lines(block: bytes, count: int) -> bytes:
    """The first ``count`` lines of ``block`` (whole lines ending in newlines): all of it if it has fewer."""
    end = 0
    for _ in range(max(0, count)):
        found = block.find(b"\n", end)
        if found < 0:
            return block
        end = found + 1
    return block[:end]


def _char_boundary(data: bytes, limit: int) -> int:
    """The largest cut at or below ``limit`` that splits no UTF-8 character of ``data``."""
    cut = limit
    while cut > limit - 4 and 0x80 <= data[cut] < 0xC0:
        cut -= 1
    return cut if cut > limit - 4 else limit
