"""
Plain functions behind :mod:`sandbox_provider.hooks.sbx`: running the ``sbx`` CLI as a subprocess
with a wall clock, streaming an ``sbx exec`` as its output arrives, and reading sizes.

Every CLI call runs in its own session, so a call that overruns its wall clock is ended together
with everything it started (``os.killpg``): a hung ``sbx`` never outlives the call.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

_CHUNK = 64 * 1024
_SIZE = re.compile(r"(?i)^\s*(\d+)\s*([bkmg]?)\s*$")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class CliHung(Exception):
    """The CLI did not finish within its wall clock and was killed."""


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: bytes
    stderr: bytes

    def error_text(self) -> str:
        text = self.stderr.decode("utf-8", "replace").strip() or self.stdout.decode("utf-8", "replace").strip()
        return text[-2000:] or "no output"


def memory_bytes(value: str) -> int:
    """Bytes in a size as sbx takes it (``2g``, ``1536m``, ``1048576k``, plain bytes)."""
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"memory must be a size such as '2g' or '1536m', got {value!r}.")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def stream(
    argv: Sequence[str],
    *,
    stdin: bytes | IO[bytes],
    wall: float,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None],
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """
    Run ``argv`` with ``stdin`` (bytes, or a binary stream read in 64 KiB pieces), passing its output
    to the callbacks (in this thread) as it arrives; return its exit code.

    :raises CliHung: when it has not finished and closed its output within ``wall`` seconds; it and
        its process group have been killed by then.
    :raises FileNotFoundError: when ``argv[0]`` does not exist.
    """
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    chunks: queue.Queue = queue.Queue()
    feed_errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_feed, args=(proc.stdin, stdin, feed_errors), daemon=True),
        threading.Thread(target=_pump, args=(proc.stdout, on_stdout, chunks), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, on_stderr, chunks), daemon=True),
    ]
    for thread in threads:
        thread.start()
    deadline = clock() + wall
    try:
        _relay(chunks, deadline, clock)
        try:
            code = proc.wait(timeout=max(deadline - clock(), 0.01))
        except subprocess.TimeoutExpired:
            raise CliHung from None
        threads[0].join(timeout=max(deadline - clock(), 0.01))
        if feed_errors:
            raise feed_errors[0]
        return code
    except BaseException:
        _kill(proc)
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _relay(chunks: queue.Queue, deadline: float, clock: Callable[[], float]) -> None:
    """
    Pass each ``(callback, data)`` the two pumps queue to its callback, in this thread, until both
    pipes have closed (``data`` None).

    :raises CliHung: when ``clock()`` reaches ``deadline`` first.
    """
    open_pipes = 2
    while open_pipes:
        left = deadline - clock()
        if left <= 0:
            raise CliHung
        try:
            callback, data = chunks.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if data is None:
            open_pipes -= 1
        else:
            callback(data)


def run(argv: Sequence[str], *, wall: float, stdin: bytes = b"") -> CliResult:
    """Run ``argv`` to completion, collecting its output. Raises as :func:`stream` does."""
    out: list[bytes] = []
    err: list[bytes] = []
    code = stream(argv, stdin=stdin, wall=wall, on_stdout=out.append, on_stderr=err.append)
    return CliResult(code, b"".join(out), b"".join(err))


def _feed(pipe, data: bytes | IO[bytes], errors: list[BaseException]) -> None:
    """Write ``data`` to the process; a failure to read a source stream is kept for the caller."""
    try:
        if isinstance(data, (bytes, bytearray)):
            pipe.write(data)
        else:
            while True:
                try:
                    piece = data.read(_CHUNK)
                except BaseException as err:  # noqa: BLE001 - re-raised by stream()
                    errors.append(err)
                    break
                if not piece:
                    break
                pipe.write(piece)
    except (BrokenPipeError, ValueError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


def _pump(pipe, callback, chunks: queue.Queue) -> None:
    try:
        fd = pipe.fileno()
        while data := os.read(fd, _CHUNK):
            chunks.put((callback, data))
    except (OSError, ValueError):
        pass
    finally:
        chunks.put((callback, None))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
