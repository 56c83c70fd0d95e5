"""
Exec streams of the Docker backend: one program run in a sandbox through the Engine's exec API,
its output demultiplexed as it arrives, its standard input fed from a stream, its exit status read
from the stream's last bytes.

**The output** arrives as the Engine's multiplexed frames (an 8-byte header, then up to 32 KiB).
The pump reads each payload straight from the socket into one new ``bytes`` (one copy per byte on
the worker) and hands it on, so an export runs at the speed the Engine delivers; it starts with
the bytes the HTTP client may already have read past the response's headers (``_read_ahead``).

**The exit status** comes as a trailer that the guest program writes on its standard error as its
very last bytes: ``\\x1esandbox-status:<token>:<status>\\n`` (the runner may add ``:<base64>``, a
file it read back after the command, see ``runner_argv``), where the token is a random value
given to that one exec in its environment. The runner of a command reads the token and removes it
from the environment before the command starts, and the command cannot read it from the runner (the
runner's shell is unreadable to the command user, so the kernel keeps its memory and environment
from that user), so a command cannot forge the end of its runner. The trailer is taken off the
output. With a trailer there is no ``exec_inspect`` request; without one (the program was killed,
or the status is not to be trusted, as with root commands that can read the runner), the Engine is
asked.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

#: Seconds past a command's deadline before the hook sweeps it itself.
DEADLINE_GRACE = 1.0
#: Seconds an exec stream may stay open after a sweep (the Engine flushes and closes it).
STREAM_CLOSE_WAIT = 5.0
#: Bytes per piece on an exec's standard input.
STDIN_CHUNK_BYTES = 1024 * 1024
#: Most bytes of one frame read at once (the Engine's frames are smaller).
READ_CHUNK_BYTES = 1024 * 1024
#: A frame's header: the stream (1 stdout, 2 stderr), three zero bytes, the length (big-endian).
FRAME_HEADER_BYTES = 8
#: The environment variable that carries an exec's status token to its guest program.
STATUS_ENV = "AIRFLOW_SANDBOX_STATUS"
#: How a status trailer begins (the token, a colon, the status and a newline follow).
STATUS_MARK = b"\x1esandbox-status:"


@dataclass(frozen=True)
class ExecEnd:
    """
    How an exec ended.

    :param exit_code: its status, or None when it was still running when the hook stopped waiting.
    :param swept: the deadline passed and the hook swept the container to end it.
    :param sweep_failed: that sweep did not happen (the keeper did not answer).
    :param error: what broke the stream before the command ended, if anything did.
    :param stdin_read: bytes read from the standard input source (the rest sent was padding).
    :param started: the Engine started the program (False: the runtime could not, and said why in
        the output).
    :param reported: the exit status came from the program's own trailer (no request was needed).
    :param read_back: the bytes of the file the runner read back on its trailer, if it did (only
        with a trusted status).
    :param trailed: a status trailer ended the output (trusted or not). A program that always
        writes one (the runner, a file operation) and exited by itself without it lost the end of
        its output on the way.
    """

    exit_code: int | None
    swept: bool
    sweep_failed: bool
    error: BaseException | None
    stdin_read: int = 0
    started: bool = True
    reported: bool = False
    read_back: bytes | None = None
    trailed: bool = False


class _Trailer:
    """Holds back what may be the status trailer at the end of standard error, and reads it."""

    def __init__(self, token: str) -> None:
        self.mark = STATUS_MARK + token.encode() + b":"
        self.held = b""
        self.status: int | None = None
        self.read_back: bytes | None = None

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` to pass on now; a possible trailer start is kept back."""
        if self.held:
            data, self.held = self.held + data, b""
        at = data.rfind(b"\x1e")
        if at >= 0 and self._may_be_trailer(data[at:]):
            data, self.held = data[:at], data[at:]
        return data

    def _may_be_trailer(self, tail: bytes) -> bool:
        if len(tail) <= len(self.mark):
            return self.mark.startswith(tail)
        rest = tail[len(self.mark) :]
        return tail.startswith(self.mark) and re.fullmatch(rb"\d{0,3}(?::[A-Za-z0-9+/=]*)?\n?", rest) is not None

    def finish(self) -> bytes:
        """At the end of the stream: read a whole trailer, or give back what was held."""
        found = re.fullmatch(re.escape(self.mark) + rb"(\d{1,3})(?::([A-Za-z0-9+/=]*))?\n", self.held)
        if found:
            self.status, self.held = int(found[1]), b""
            if found[2] is not None:
                try:
                    self.read_back = base64.b64decode(found[2], validate=True)
                except binascii.Error:  # not what file.sh writes: the file is read on its own
                    self.read_back = None
            return b""
        held, self.held = self.held, b""
        return held


def run_exec(
    api: Any,
    container: str,
    argv: list[str],
    *,
    user: str,
    workdir: str,
    deadline: float,
    on_output: Callable[[int, bytes], None],
    sweep: Callable[[], bool],
    stdin: IO[bytes] | None = None,
    stdin_size: int | None = None,
    trust_status: bool = True,
    environment: Mapping[str, str] | None = None,
) -> ExecEnd:
    """
    Run ``argv`` in ``container`` as ``user`` and stream its output to ``on_output(1 | 2, bytes)``.

    ``stdin`` (with ``stdin_size`` bytes, padded with NULs if it ends early) feeds standard input;
    the program must read exactly that many bytes, since the stream is not closed after them (a
    TLS connection cannot be half-closed). When the output has not ended ``deadline`` seconds after
    the start plus a short grace, or when ``on_output`` raises, ``sweep()`` is called, which ends
    every process but the keeper, and the stream with them. An exception raised in the calling
    thread while it waits (a task timeout, Ctrl-C) sweeps the same way, then propagates.

    The program gets a status token in ``AIRFLOW_SANDBOX_STATUS``; the status trailer it writes
    last with it is taken off standard error and, with ``trust_status``, used as the exit status.
    Whether one came is in :attr:`ExecEnd.trailed`, which a caller whose program always writes the
    trailer checks: without it, the output did not arrive whole.

    :raises docker.errors.APIError: when the exec cannot be created or started.
    """
    token = secrets.token_hex(16)
    exec_id, raw, early = _start(
        api, container, argv, user, workdir, stdin is not None, {**(environment or {}), STATUS_ENV: token}
    )
    pump = _Pump(raw, on_output, _Trailer(token), early)
    reader = threading.Thread(target=pump.run, daemon=True, name=f"exec-{container}")
    reader.start()
    read = [0]
    feeder = None
    if stdin is not None:
        feeder = threading.Thread(target=_feed, args=(raw, stdin, stdin_size or 0, read), daemon=True)
        feeder.start()
    try:
        ended = pump.done.wait(deadline + DEADLINE_GRACE)
    except BaseException:
        _stop(sweep, raw, reader)
        raise
    swept = sweep_failed = False
    # The pump's flag, not reader.is_alive(): the thread runs on a moment after setting it (longer under load).
    if not ended or pump.callback_failed:
        swept = True
        sweep_failed = not sweep()
    abandoned = _stop(None, raw, reader)
    if feeder is not None:
        feeder.join(STREAM_CLOSE_WAIT)
    error = pump.failure if not abandoned else None
    trailed = pump.trailer.status is not None
    if trust_status and trailed and not swept:
        return ExecEnd(pump.trailer.status, False, False, error, read[0], True, True, pump.trailer.read_back, True)
    code, started = _exit_status(api, exec_id)
    return ExecEnd(code, swept, sweep_failed, error, read[0], started, trailed=trailed)


def _start(
    api: Any, container: str, argv: list[str], user: str, workdir: str, stdin: bool, env: Mapping[str, str]
) -> tuple[str, Any, bytes]:
    """
    Create and start the exec; return its id, the raw socket of its stream, and the first bytes of
    the stream when the HTTP client had already read them (see :func:`_read_ahead`).
    """
    exec_id = api.exec_create(
        container, argv, stdin=stdin, stdout=True, stderr=True, tty=False, user=user, workdir=workdir, environment=env
    )["Id"]
    sock = api.exec_start(exec_id, socket=True)
    raw = getattr(sock, "_sock", sock)
    early = _read_ahead(sock, raw)
    raw.settimeout(None)  # a silent command is not a broken connection
    return exec_id, raw, early


def _read_ahead(sock: Any, raw: Any) -> bytes:
    """
    What the HTTP client read of the stream past the response's headers: it reads the socket in
    blocks through a buffer, so when the program's first frames were already there as it parsed the
    headers (a program that writes at once, on a busy worker), they are in that buffer, and reading
    the socket the SDK hands out would miss them: the output, status trailer and all, would be lost.
    Takes them from the buffer without waiting (the socket is non-blocking meanwhile); empty when
    there were none, or when the stream is not read through such a buffer (an SSH connection).
    """
    response = getattr(sock, "_response", None)
    reader = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if reader is None or not hasattr(reader, "read1"):
        return b""
    raw.setblocking(False)
    try:
        return reader.read1(READ_CHUNK_BYTES) or b""
    except OSError:  # nothing buffered and nothing arrived yet (BlockingIOError, SSLWantReadError)
        return b""
    finally:
        raw.setblocking(True)


class _Pump:
    """Reads an exec's frames into ``on_output`` until the stream ends, or until ``on_output`` raises."""

    def __init__(
        self, raw: Any, on_output: Callable[[int, bytes], None], trailer: _Trailer, early: bytes = b""
    ) -> None:
        self.raw, self.on_output, self.trailer = raw, on_output, trailer
        self.early = early  # the stream's first bytes, read before the pump started (see _read_ahead)
        self.done = threading.Event()
        self.failure: BaseException | None = None
        self.callback_failed = False

    def _recv(self, size: int) -> bytes:
        if self.early:
            data, self.early = self.early[:size], self.early[size:]
            return data
        return self.raw.recv(size)

    def _header(self) -> tuple[int, int] | None:
        """The next frame's stream (1 stdout, 2 stderr) and length; None at the end of the stream."""
        header = b""
        while len(header) < FRAME_HEADER_BYTES:
            piece = self._recv(FRAME_HEADER_BYTES - len(header))
            if not piece:
                return None
            header += piece
        return header[0], int.from_bytes(header[4:8], "big")

    def run(self) -> None:
        try:
            while True:
                frame = self._header()
                if frame is None:
                    break
                stream, left = frame
                while left > 0:
                    data = self._recv(min(left, READ_CHUNK_BYTES))
                    if not data:
                        return
                    left -= len(data)
                    if not self._deliver(stream, data):
                        return
            self._deliver(2, self.trailer.finish(), final=True)
        except Exception as exc:  # reported to the caller; a closed socket ends here too
            self.failure = exc
        finally:
            self.done.set()

    def _deliver(self, stream: int, data: bytes, *, final: bool = False) -> bool:
        if stream == 2 and not final:
            data = self.trailer.feed(data)
        if not data:
            return True
        try:
            self.on_output(stream, data)
        except BaseException:  # the caller's to raise (OutputSink keeps it); the command stops
            self.callback_failed = True
            return False
        return True


def _stop(sweep: Callable[[], bool] | None, raw: Any, reader: threading.Thread) -> bool:
    """
    End an exec's stream: sweep the container first when ``sweep`` is given, then give the stream
    a moment to end and close it. True when it had to be closed while still open.
    """
    if sweep is not None:
        try:
            sweep()
        except Exception:  # the exception being raised is the one to report
            pass
    reader.join(STREAM_CLOSE_WAIT if reader.is_alive() else 0)
    still_open = reader.is_alive()
    _close(raw)
    reader.join(STREAM_CLOSE_WAIT)
    return still_open


def _feed(raw: Any, source: IO[bytes], size: int, read: list[int]) -> None:
    sent = 0
    try:
        while sent < size:
            want = min(STDIN_CHUNK_BYTES, size - sent)
            piece = source.read(want) if read[0] == sent else b""
            read[0] += len(piece)
            piece = piece or bytes(want)  # a source that shrank: pad, and the caller refuses the write
            raw.sendall(piece)
            sent += len(piece)
    except OSError:  # the program ended early (its error is in its output) or the stream was closed
        pass


def _close(raw: Any) -> None:
    for step in (lambda: raw.shutdown(socket.SHUT_RDWR), raw.close):
        try:
            step()
        except OSError:
            pass


def _exit_status(api: Any, exec_id: str) -> tuple[int | None, bool]:
    """The exec's exit status (None while it runs) and whether it started at all (it had a process)."""
    # The stream can end a moment before the Engine records the exit status.
    info: Mapping[str, Any] = {}
    for _ in range(50):
        info = api.exec_inspect(exec_id)
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"]), bool(info.get("Pid"))
        time.sleep(0.02)
    return None, bool(info.get("Pid", 1))
