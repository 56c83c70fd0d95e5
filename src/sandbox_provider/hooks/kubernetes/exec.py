"""
Exec streams of the Kubernetes backend: one program run in a sandbox's container through the Pod's
``exec`` subresource, over the websocket that the official client's ``kubernetes.stream.stream``
opens (authentication, TLS and the channel protocol are the client's).

The channel protocol (``v4.channel.k8s.io``, the one a 1.20 API server speaks; ``v5`` adds a way to
close standard input, which v4 lacks) sends one binary frame per piece, its first byte the channel:
0 standard input, 1 standard output, 2 standard error, 3 the status once the program has ended (a
``Status`` object: ``Success``, or ``NonZeroExitCode`` with the exit status in its causes). The
frames are read straight off the websocket in a thread of their own and handed on as they come: the
client's own reader would keep a second copy of every byte, which a 1 GiB export cannot afford.

Standard input cannot be closed on v4, so a program that reads it is told how many bytes to read,
and exactly that many are sent. Closing the websocket does not end the program in the container:
deadlines are kept by the runner inside (``guest/k8s_run.sh``) and, when that does not end in
time, by the hook's sweep (a second exec ending every process of the sandbox's user).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from sandbox_provider.hooks.kubernetes.driver import exit_status

__all__ = ["ExecEnd", "run_exec"]

STDIN, STDOUT, STDERR, STATUS = 0, 1, 2, 3
#: Seconds past a program's deadline before the hook stops waiting for its status and sweeps.
DEADLINE_GRACE = 2.0
#: Seconds the stream may stay open after a sweep, or after the hook stopped waiting, before it is closed.
STREAM_CLOSE_WAIT = 5.0
#: Bytes of standard input per frame.
STDIN_FRAME_BYTES = 256 * 1024
#: The most bytes of the status channel kept (the API server sends one small JSON object).
STATUS_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class ExecEnd:
    """
    How an exec ended.

    :param exit_code: the status the cluster reported, or None when none came (the stream broke, or
        the status named no exit code: ``message`` says why).
    :param message: the status's message when it named no exit code, or what broke the stream.
    :param overran: the deadline and its grace passed (or the output callback raised) before the
        program ended, so the hook swept the sandbox.
    :param swept: that sweep ran.
    :param error: what broke the stream, if anything did.
    :param stdin_read: bytes read from the standard input source (the rest sent was padding).
    """

    exit_code: int | None
    message: str
    overran: bool
    swept: bool
    error: BaseException | None
    stdin_read: int = 0


def run_exec(
    open_stream: Callable[[], Any],
    *,
    deadline: float,
    on_output: Callable[[int, bytes], None],
    sweep: Callable[[], bool],
    stdin: IO[bytes] | None = None,
    stdin_size: int = 0,
) -> ExecEnd:
    """
    Open an exec with ``open_stream()`` (a ``WSClient`` of the official client, opened with
    ``binary=True`` and ``_preload_content=False``) and stream its output to ``on_output(1 | 2, bytes)``.

    ``stdin`` feeds exactly ``stdin_size`` bytes to standard input (padded with NULs if it ends early).
    When no status has come ``deadline`` seconds after the start plus :data:`DEADLINE_GRACE`, or when
    ``on_output`` raises, ``sweep()`` is called (it ends the program in the container), and the
    stream is then given :data:`STREAM_CLOSE_WAIT` seconds to end. An exception raised in the calling
    thread while it waits (a task timeout, Ctrl-C) sweeps the same way, then propagates.

    :raises kubernetes.client.ApiException: when the exec cannot be opened.
    """
    client = open_stream()
    pump = _Pump(client.sock, on_output)
    reader = threading.Thread(target=pump.run, daemon=True, name="k8s-exec-output")
    reader.start()
    read = [0]
    if stdin is not None:
        threading.Thread(
            target=_feed, args=(client.sock, stdin, stdin_size, read), daemon=True, name="k8s-exec-input"
        ).start()
    try:
        ended = pump.done.wait(deadline + DEADLINE_GRACE)
    except BaseException:
        _sweep_quietly(sweep)
        _close(client, reader)
        raise
    overran = not ended or pump.callback_failed
    swept = overran and _sweep_quietly(sweep)
    if overran:
        pump.done.wait(STREAM_CLOSE_WAIT)
    _close(client, reader)
    code, message = pump.status()
    if code is None and not message and pump.failure is not None:
        message = f"{type(pump.failure).__name__}: {pump.failure}"
    return ExecEnd(code, message, overran, swept, pump.failure, read[0])


class _Pump:
    """Reads an exec's frames into ``on_output`` until the stream ends, or until ``on_output`` raises."""

    def __init__(self, sock: Any, on_output: Callable[[int, bytes], None]) -> None:
        self.sock, self.on_output = sock, on_output
        self.done = threading.Event()
        self.failure: BaseException | None = None
        self.callback_failed = False
        self._status = bytearray()

    def run(self) -> None:
        from websocket import ABNF

        try:
            while True:
                opcode, frame = self.sock.recv_data_frame(True)
                if opcode == ABNF.OPCODE_CLOSE:
                    break
                data = frame.data
                if len(data) < 2:
                    continue
                channel = data[0]
                if channel == STATUS:
                    self._status.extend(data[1 : 1 + STATUS_MAX_BYTES - len(self._status)])
                elif channel in (STDOUT, STDERR) and not self._deliver(channel, data[1:]):
                    return
        except Exception as exc:  # reported to the caller; a closed socket ends here too
            self.failure = exc
        finally:
            self.done.set()

    def _deliver(self, channel: int, data: bytes) -> bool:
        try:
            self.on_output(channel, data)
        except BaseException:  # the caller's to raise (OutputSink keeps it); the program is swept
            self.callback_failed = True
            return False
        return True

    def status(self) -> tuple[int | None, str]:
        """The exit status and message of the status channel; ``(None, "")`` when it sent nothing."""
        if not self._status:
            return None, ""
        try:
            return exit_status(json.loads(bytes(self._status)))
        except (ValueError, TypeError, AttributeError):
            return None, f"unreadable exec status: {bytes(self._status[:200])!r}"


def _feed(sock: Any, source: IO[bytes], size: int, read: list[int]) -> None:
    from websocket import ABNF

    sent = 0
    try:
        while sent < size:
            want = min(STDIN_FRAME_BYTES, size - sent)
            piece = source.read(want) if read[0] == sent else b""
            read[0] += len(piece)
            piece = piece or bytes(want)  # a source that shrank: pad, and the caller refuses the write
            sock.send(bytes((STDIN,)) + piece, opcode=ABNF.OPCODE_BINARY)
            sent += len(piece)
    except Exception:  # the program ended early (its error is in its output) or the stream was closed
        pass


def _sweep_quietly(sweep: Callable[[], bool]) -> bool:
    try:
        return sweep()
    except Exception:  # the sandbox may be gone; the caller finds out
        return False


def _close(client: Any, reader: threading.Thread) -> None:
    try:
        client.close()
    except Exception:  # already closed by the server
        pass
    reader.join(STREAM_CLOSE_WAIT)
