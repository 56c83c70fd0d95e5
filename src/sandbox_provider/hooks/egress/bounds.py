"""
What keeps one sandbox's egress gateway (:mod:`~sandbox_provider.hooks.egress.gateway`) within fixed
bounds, whatever the sandbox does with its socket. The gateway runs on the worker, outside the
sandbox's limits, so it needs bounds of its own:

- **Threads.** proxy.py runs threadless: one acceptor process whose one event loop serves every
  connection (``--threadless --local-executor 1 --num-acceptors 1``), so the gateway is two
  processes and at most four threads however many connections come (the fourth logs refusals).
  proxy.py's ``--threaded`` mode starts a thread per connection and has no option to bound them, so
  it is not used. The price: the loop makes the upstream connection and resolves a listed name
  itself, so one slow destination holds up the sandbox's other connections for that moment
  (proxy.py gives up connecting after 10 s). Only that sandbox waits: each has its own gateway.
- **Connections.** :class:`BoundedHandler` (proxy.py's ``--work-klass``) counts the connections open
  at once; past ``max_connections`` a new one is answered ``503`` and closed as soon as its request
  came (or after :data:`REFUSAL_LINGER`), and the log gets a line (at most one a second, counting
  the refusals since the last). proxy.py's acceptor
  takes connections as fast as they come, before the loop holds or refuses them, so the gateway's
  descriptors are capped too (``RLIMIT_NOFILE``: two per connection and :data:`SPARE_FILES`); a
  sandbox that outruns that ends its own gateway's acceptor, and the gateway stops with a line in
  the log (the sandbox is then cut off; nothing else is touched).
- **Flow control.** proxy.py reads each side whenever it is ready and queues what it read for the
  other side, whether or not that side takes it, so a sandbox that never reads a download (or sends
  faster than the destination takes) would have the gateway hold everything. :class:`BoundedHandler`
  stops watching a side for reading while more than ``queue_bytes`` (or :data:`QUEUE_READS` reads of
  at most :data:`READ_BYTES`) wait for the other side, and watches it again once they have gone: the kernel's own flow control then holds the sender back.
  proxy.py's loop keeps watching a descriptor its work no longer asks for (a known gap in its
  code), so the gateway runs it with :class:`FlowExecutor`, which stops watching those.
- **Memory.** proxy.py also keeps a plain ``http://`` message's body whole while it passes (the
  first request, read before it is sent on, and each response). What all connections hold (those
  bodies and the queues) is held to ``hold_bytes``: past it, the connection that holds the most is
  closed, with a log line. The process's data is capped too (``RLIMIT_DATA``, ``memory_bytes``), in
  case anything else grows.
- **Parsing.** proxy.py's HTTP parser does work that grows with the square of a message's size;
  the gateway parses with :mod:`~sandbox_provider.hooks.egress.parsing`'s, linear, with a message's
  head held to 64 KiB and 128 lines.
- **Log.** Each attempt is a line of the gateway's log on the worker's disk; :class:`LogBudget` stops
  writing at ``log_bytes`` (one last line says so), so a sandbox cannot fill the worker's disk by
  making attempts.

:func:`configure` sets the bounds in the gateway's process before proxy.py starts its acceptor,
which is forked from it and inherits them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import resource
import selectors
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_provider.hooks.egress import parsing

__all__ = ["SPARE_FILES", "Bounds", "LogBudget", "configure", "limit_process"]

log = logging.getLogger("sandbox_provider.egress")

#: Seconds between two log lines about refused connections.
REFUSAL_LOG_EVERY = 1.0
#: Seconds a refused connection stays open for its request to come (then closed regardless).
REFUSAL_LINGER = 1.0
#: Bytes proxy.py reads from a side at once (its ``--client-recvbuf-size`` and ``--server-recvbuf-size``).
READ_BYTES = 128 * 1024
#: Reads a queue may hold before the side it comes from is no longer read.
QUEUE_READS = 16
#: Descriptors a gateway may have open besides two per connection it may hold (its own files, and
#: the connections the acceptor took that wait for the event loop to hold or refuse them).
SPARE_FILES = 1024


@dataclass(frozen=True)
class Bounds:
    """
    The bounds of one gateway.

    :param handle: the sandbox it serves, named in its log lines.
    :param max_connections: connections held at once; more are refused.
    :param queue_bytes: bytes queued for one side before the other is no longer read.
    :param hold_bytes: bytes all connections may hold together (queues and plain HTTP bodies).
    :param memory_bytes: the data each of its processes may have (``RLIMIT_DATA``).
    :param log_bytes: the size its log may grow to; later lines are left out.
    """

    handle: str
    max_connections: int
    queue_bytes: int
    hold_bytes: int
    memory_bytes: int
    log_bytes: int

    @classmethod
    def of(cls, handle: str, config: Mapping[str, Any]) -> Bounds:
        """The bounds in a gateway's configuration."""
        keys = ("max_connections", "queue_bytes", "hold_bytes", "memory_bytes", "log_bytes")
        return cls(handle, *(int(config[key]) for key in keys))


_bounds: Bounds | None = None


def configure(bounds: Bounds) -> None:
    """Set this process's bounds, and have proxy.py's acceptor run :class:`FlowExecutor` in a fork of it."""
    global _bounds
    _bounds = bounds
    # The acceptor must inherit this module's state and the executor below: a fork does, whatever
    # start method this Python would pick.
    multiprocessing.set_start_method("fork", force=True)
    from proxy.core.acceptor import acceptor

    acceptor.LocalFdExecutor = __getattr__("FlowExecutor")  # type: ignore[misc]
    acceptor.NonBlockingQueue = __getattr__("WakingQueue")  # type: ignore[misc]
    parsing.install(bounds.handle)


def limit_process(bounds: Bounds) -> None:
    """Cap this process's data and descriptors (its acceptor, started next, inherits the caps)."""
    resource.setrlimit(resource.RLIMIT_DATA, (bounds.memory_bytes, bounds.memory_bytes))
    files = 2 * bounds.max_connections + SPARE_FILES
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))


#: C0 controls, DEL and C1 controls, each to its ``\xNN`` escape.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}


class LogBudget(logging.FileHandler):
    """
    A log file that stops growing at ``max_bytes``: a line that would take it past is left out, and
    the first one left out is replaced by a line saying the limit was reached. The size is read from
    the open file, which the gateway's acceptor (a fork) shares, so both processes keep one budget
    (each may write its own closing line: the file ends at most two such lines past ``max_bytes``).

    Each record is one line: control characters (a line end, a terminal escape) in it, which a
    sandbox can put in the names it asks for, are written as ``\\xNN``, so it cannot forge lines
    of the log (or of the task log, which gets its lines) nor drive the terminal of who reads it.
    """

    def __init__(self, path: str, max_bytes: int) -> None:
        super().__init__(path, mode="a", encoding="utf-8")
        self.max_bytes = max_bytes
        self._closed_out = False

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).translate(_CONTROLS)

    def emit(self, record: logging.LogRecord) -> None:
        if self._closed_out:
            return
        if self.stream is None:
            self.stream = self._open()
        line = self.format(record).encode("utf-8", "replace")
        size = os.fstat(self.stream.fileno()).st_size
        if size + len(line) + 1 <= self.max_bytes:
            super().emit(record)
            return
        self._closed_out = True
        if size < self.max_bytes:
            self.stream.write(
                f"{self.formatter.formatTime(record, self.formatter.datefmt) if self.formatter else ''} "
                f"the egress log reached its limit of {self.max_bytes} bytes; later attempts are judged as "
                "before but not written down\n"
            )
            self.flush()


def _current() -> Bounds:
    if _bounds is None:
        raise RuntimeError("the egress gateway's bounds were not configured")
    return _bounds


class _Refusals:
    """
    Connections refused past the cap, logged at most once a second: the first of a burst at once,
    the rest by a thread of their own a second later, each line counting those since the last (a
    flood of refusals is a few lines, not one per connection).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._logged_at = -REFUSAL_LOG_EVERY
        self._reporter: threading.Thread | None = None

    def add(self) -> None:
        with self._lock:
            self._count += 1
            if time.monotonic() - self._logged_at >= REFUSAL_LOG_EVERY:
                self._log()
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report, name="egress-refusals", daemon=True)
                self._reporter.start()

    def _report(self) -> None:
        while True:
            time.sleep(REFUSAL_LOG_EVERY)
            with self._lock:
                if self._count:
                    self._log()

    def _log(self) -> None:
        bounds = _current()
        log.info(
            "sandbox %s egress refused %d connection(s): %d were open, the most it may hold at once "
            "(egress_max_connections)",
            bounds.handle,
            self._count,
            bounds.max_connections,
        )
        self._count, self._logged_at = 0, time.monotonic()


class _Holdings:
    """What each open connection holds (bytes), and their total."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self.total = 0

    def set(self, key: int, held: int) -> None:
        self.total += held - self._held.get(key, 0)
        self._held[key] = held

    def drop(self, key: int) -> None:
        self.total -= self._held.pop(key, 0)

    def most(self) -> int:
        return max(self._held.values(), default=0)


_refusals = _Refusals()
_holdings = _Holdings()


def _queued(connection: Any) -> int:
    """Bytes waiting in a proxy.py connection's queue for its side to take."""
    return sum(len(chunk) for chunk in connection.buffer)


def _held(handler: Any) -> int:
    """What a handler holds: its queues, the request being read, a plain HTTP response's body."""
    request = handler.request
    held = len(getattr(request, "head", None) or b"") + len(request.buffer or b"") + len(request.body or b"")
    held += _queued(handler.work)
    upstream = getattr(handler.plugin, "upstream", None)
    if upstream is not None:
        held += _queued(upstream)
    response = getattr(handler.plugin, "response", None)
    if response is not None:
        held += len(response.body or b"") + len(getattr(response.chunk, "body", None) or b"")
    return held


def _open_upstream(handler: Any) -> Any:
    """The handler's upstream connection while it is open, else None."""
    upstream = getattr(handler.plugin, "upstream", None)
    return upstream if upstream is not None and not upstream.closed else None


def _handler_class() -> type:
    from proxy.common.utils import build_http_response
    from proxy.http.handler import HttpProtocolHandler

    class BoundedHandler(HttpProtocolHandler):
        """proxy.py's handler of one client connection, within the gateway's bounds (module docstring)."""

        #: Connections held now, in this process (the one acceptor's event loop runs them all).
        held = 0
        _counted = False
        #: When this connection was refused (monotonic seconds); None for one held.
        _refused_at: float | None = None
        #: The descriptors this handler last asked to watch (:class:`FlowExecutor` reads it).
        watching: frozenset[int] = frozenset()

        def initialize(self) -> None:
            super().initialize()
            cap = _current().max_connections
            if BoundedHandler.held < cap:
                BoundedHandler.held += 1
                self._counted = True
                return
            body = (
                f"The sandbox's egress gateway holds {cap} connections at once, its most "
                "(egress_max_connections); close one and retry.\n"
            ).encode()
            response = build_http_response(503, reason=b"Service Unavailable", body=body, conn_close=True)
            self.work.queue(memoryview(response))
            self._refused_at = time.monotonic()
            _refusals.add()

        def _linger(self, readables: Any, writables: Any) -> bool:
            """
            A refused connection: send the answer, drop what the client sends, and close once it has
            sent something (its request) or REFUSAL_LINGER passed. Closing before its request came
            would make a forwarder that still writes it fail, and drop the answer with it.
            """
            connection = self.work.connection
            if connection.fileno() in writables and self.work.has_buffer():
                self.work.flush(self.flags.max_sendbuf_size)
            heard = connection.fileno() in readables
            if heard:
                with contextlib.suppress(OSError):
                    connection.recv(65536)
            return not self.work.has_buffer() and (heard or self.is_inactive())

        def is_inactive(self) -> bool:
            if self._refused_at is not None:
                return time.monotonic() - self._refused_at > REFUSAL_LINGER
            return bool(super().is_inactive())

        async def get_events(self) -> dict[int, int]:
            events = dict(await super().get_events())
            upstream = _open_upstream(self)
            if upstream is not None:
                limit = _current().queue_bytes
                # A side is not read while the other side's queue is full: past its bytes, or past
                # QUEUE_READS reads (each read's memory is a block of its own, however few bytes it got).
                for queue, reader in ((self.work, upstream.connection), (upstream, self.work.connection)):
                    fileno = reader.fileno()
                    full = _queued(queue) > limit or len(queue.buffer) > QUEUE_READS
                    if full and fileno in events:
                        events[fileno] &= ~selectors.EVENT_READ
                        if not events[fileno]:
                            del events[fileno]
            self.watching = frozenset(events)
            return events

        async def handle_events(self, readables: Any, writables: Any) -> bool:
            if self._refused_at is not None:
                return self._linger(readables, writables)
            if await super().handle_events(readables, writables):
                return True
            held = _held(self)
            _holdings.set(id(self), held)
            bounds = _current()
            if _holdings.total <= bounds.hold_bytes or held < _holdings.most():
                return False
            target = f"{self.request.host.decode(errors='replace')}:{self.request.port}" if self.request.host else "?"
            log.info(
                "sandbox %s egress closed its connection to %s: its connections held %d bytes, more than the %d "
                "they may hold together, and this one held the most (%d; a plain http:// body is held whole)",
                bounds.handle,
                target,
                _holdings.total,
                bounds.hold_bytes,
                held,
            )
            return True

        def shutdown(self) -> None:
            _holdings.drop(id(self))
            if self._counted:
                BoundedHandler.held -= 1
                self._counted = False
            super().shutdown()

    BoundedHandler.__module__, BoundedHandler.__qualname__ = __name__, "BoundedHandler"
    return BoundedHandler


def _executor_class() -> type:
    from proxy.core.work import Work
    from proxy.core.work.fd import LocalFdExecutor

    class Waker(Work[Any]):
        """
        A work of the executor's own that watches the :class:`WakingQueue`'s pipe, so the loop wakes
        the moment the acceptor hands it a connection (else it would look only every 25 ms).
        """

        @staticmethod
        def create(*args: Any) -> Any:
            return args[0]

        async def get_events(self) -> dict[int, int]:
            return {self.work.fileno(): selectors.EVENT_READ}

        async def handle_events(self, readables: Any, writables: Any) -> bool:
            self.work.taken()
            return False

        def is_inactive(self) -> bool:
            return False

    class FlowExecutor(LocalFdExecutor):  # type: ignore[misc]
        """
        proxy.py's in-process executor, which also stops watching what a handler no longer asks for,
        and wakes when a connection is queued for it.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if isinstance(self.work_queue, __getattr__("WakingQueue")):
                self.works[self.work_queue.fileno()] = Waker(self.work_queue, flags=self.flags)

        async def _update_work_events(self, work_id: int) -> None:
            await super()._update_work_events(work_id)
            watching = getattr(self.works.get(work_id), "watching", None)
            registered = self.registered_events_by_work_ids.get(work_id)
            if watching is None or registered is None or self.selector is None:
                return
            for fileno in [fileno for fileno in registered if fileno not in watching]:
                self.selector.unregister(fileno)
                del registered[fileno]

    FlowExecutor.__module__, FlowExecutor.__qualname__ = __name__, "FlowExecutor"
    return FlowExecutor


def _queue_class() -> type:
    from proxy.common.backports import NonBlockingQueue

    class WakingQueue(NonBlockingQueue):  # type: ignore[misc]
        """proxy.py's queue of accepted connections, with a pipe that holds a byte for each one queued."""

        def __init__(self) -> None:
            super().__init__()
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)

        def put(self, item: Any) -> None:
            super().put(item)
            os.write(self._write, b"\0")

        def fileno(self) -> int:
            return self._read

        def taken(self) -> None:
            """One queued item was (or is about to be) taken: drop its byte."""
            with contextlib.suppress(BlockingIOError):
                os.read(self._read, 1)

    WakingQueue.__module__, WakingQueue.__qualname__ = __name__, "WakingQueue"
    return WakingQueue


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # proxy.py loads the work class by dotted name; each class is built on first use, so importing
    # this module does not need proxy.py.
    builders = {"BoundedHandler": _handler_class, "FlowExecutor": _executor_class, "WakingQueue": _queue_class}
    if name not in builders:
        raise AttributeError(name)
    if name not in _built:
        _built[name] = builders[name]()
    return _built[name]
