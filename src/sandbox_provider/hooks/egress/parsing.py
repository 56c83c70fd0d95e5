"""
proxy.py's HTTP parser, bounded and linear, for the egress gateway's requests and plain ``http://``
responses (:class:`BoundedParser`; :func:`install` makes the gateway's handler and proxy plugin use it).

proxy.py's own parser copies what it holds each time more comes: a message's head is joined to
every new read and split a line at a time (each split copying the rest), a body grows by
``bytes +=`` and a chunked body by the same, chunk by chunk. Its work grows with the square of the
size: a sandbox that sent 32 MiB of one header line cost the gateway (outside every limit of the
sandbox) 12 s of CPU, and a 64 MiB plain ``http://`` download took 37 s. Here:

- A head (request or status line and headers) is gathered in one buffer until its blank line comes,
  then parsed once, one line at a time without copying the rest. It may have at most
  :data:`MAX_HEAD_BYTES` and :data:`MAX_HEAD_LINES` lines: past either the message is refused
  (proxy.py answers a sandbox's request ``400``; a response's connection is closed) and the gateway
  logs it.
- A body with a length grows in place (a ``bytearray``); a chunked one is read by
  :class:`LinearChunks` in one pass, its size lines held to :data:`MAX_CHUNK_LINE` bytes.

What proxy.py does with a parsed message is unchanged (the bodies it holds are still counted against
the gateway's memory bounds).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["MAX_CHUNK_LINE", "MAX_HEAD_BYTES", "MAX_HEAD_LINES", "install", "parser_classes"]

log = logging.getLogger("sandbox_provider.egress")

#: Bytes a message's head may have, its blank line included.
MAX_HEAD_BYTES = 64 * 1024
#: Lines a message's head may have (its status or request line and headers).
MAX_HEAD_LINES = 128
#: Bytes a chunk's size line may have (the size in hex and any extensions).
MAX_CHUNK_LINE = 4096

#: The sandbox the gateway serves, named in its log lines (set by :func:`install`).
_handle = "?"
_CRLF = b"\r\n"
_END = b"\r\n\r\n"


def _classes() -> tuple[type, type]:
    from proxy.http.exception import HttpProtocolException
    from proxy.http.parser.chunk import ChunkParser, chunkParserStates
    from proxy.http.parser.parser import HttpParser, httpParserStates

    class Refused(HttpProtocolException):  # type: ignore[misc]
        """A message past the parser's bounds; proxy.py closes its connection."""

        def __init__(self, what: str) -> None:
            super().__init__(what)
            log.info("sandbox %s egress closed a connection: %s", _handle, what)

    class LinearChunks(ChunkParser):  # type: ignore[misc]
        """A chunked body read in one pass: its data appended in place, its size lines held to a bound."""

        def __init__(self) -> None:
            super().__init__()
            self.body = bytearray()  # type: ignore[assignment]
            self._line = bytearray()
            self._left = 0  # data bytes of the current chunk still to come
            self._skip = 0  # bytes of the CRLF after a chunk's data still to pass

        def parse(self, raw: memoryview) -> memoryview:
            data, at = bytes(raw), 0
            while at < len(data) and self.state != chunkParserStates.COMPLETE:
                if self._skip:
                    taken = min(self._skip, len(data) - at)
                    self._skip -= taken
                    at += taken
                    if not self._skip and self.size == 0:
                        self.state = chunkParserStates.COMPLETE
                elif self.state == chunkParserStates.WAITING_FOR_SIZE:
                    at = self._size_line(data, at)
                else:
                    taken = min(self._left, len(data) - at)
                    self.body += data[at : at + taken]
                    self._left -= taken
                    at += taken
                    if not self._left:
                        self._skip = len(_CRLF)
                        if self.size:
                            self.state = chunkParserStates.WAITING_FOR_SIZE
            return memoryview(data[at:])

        def _size_line(self, data: bytes, at: int) -> int:
            """Take the size line's bytes from ``data`` at ``at``; return where the next part starts."""
            end = data.find(b"\n", at)
            stop = len(data) if end < 0 else end + 1
            self._line += data[at:stop]
            if len(self._line) > MAX_CHUNK_LINE:
                raise Refused(f"a chunk's size line passed {MAX_CHUNK_LINE} bytes")
            if end < 0:
                return stop
            line, self._line = bytes(self._line).strip(), bytearray()
            if not line:
                return stop  # a blank line before the size: passed over
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise Refused(f"a chunk's size line is not a size: {line[:40]!r}") from None
            if size < 0:
                raise Refused("a chunk's size is negative")
            self.size, self._left = size, size
            self.state = chunkParserStates.WAITING_FOR_DATA
            if not size:
                self._skip = len(_CRLF)  # the last chunk: its CRLF, then the body is complete
            return stop

    class BoundedParser(HttpParser):  # type: ignore[misc]
        """proxy.py's parser with its head gathered and bounded and its bodies grown in place (see the module)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.head: bytearray | None = bytearray()  # the head so far, until its blank line comes (then None)
            self._head_lines = 0
            self._head_counted = 0  # how far into ``head`` its line ends were counted

        def parse(self, raw: memoryview, allowed_url_schemes: Any = None) -> None:
            if self.state >= httpParserStates.HEADERS_COMPLETE or self.head is None:
                super().parse(raw, allowed_url_schemes)
                return
            start = max(0, len(self.head) - (len(_END) - 1))
            self.head += raw
            end = self.head.find(_END, start)
            size = len(self.head) if end < 0 else end + len(_END)
            self._head_lines += self.head.count(_CRLF, max(0, self._head_counted - 1), size)
            self._head_counted = size
            lines = self._head_lines - (1 if end >= 0 else 0)  # the blank line that ends it is not one
            if size > MAX_HEAD_BYTES or lines > MAX_HEAD_LINES:
                raise Refused(
                    f"a message's head passed {MAX_HEAD_BYTES} bytes or {MAX_HEAD_LINES} lines "
                    f"({size} bytes, {lines} lines so far)"
                )
            if end < 0:
                return
            gathered, self.head = bytes(self.head), None
            super().parse(memoryview(gathered), allowed_url_schemes)  # the head, and what came after it

        def _process_headers(self, raw: memoryview) -> tuple[bool, memoryview]:
            data, at = bytes(raw), 0
            while self.state != httpParserStates.HEADERS_COMPLETE:
                end = data.find(_CRLF, at)
                if end < 0:
                    return False, memoryview(data[at:])  # a line not ended yet: wait for more
                line, at = data[at:end], end + len(_CRLF)
                if not line.strip():
                    self.state = httpParserStates.HEADERS_COMPLETE
                else:
                    self.state = httpParserStates.RCVING_HEADERS
                    self._process_header(line)
                if at == len(data):
                    break
            rest = memoryview(data[at:])
            return len(rest) > 0, rest

        def _process_body(self, raw: memoryview) -> tuple[bool, memoryview]:
            if self._is_chunked_encoded and not self.chunk:
                self.chunk = LinearChunks()
            elif self._content_expected and self.body is None:
                self.body = bytearray()  # type: ignore[assignment]
            return super()._process_body(raw)  # type: ignore[no-any-return]

    for made in (Refused, LinearChunks, BoundedParser):
        made.__module__ = __name__
    return BoundedParser, LinearChunks


_built: list[tuple[type, type]] = []


def parser_classes() -> tuple[type, type]:
    """``(BoundedParser, LinearChunks)``, built on first use (importing this module does not need proxy.py)."""
    if not _built:
        _built.append(_classes())
    return _built[0]


def install(handle: str) -> None:
    """
    Have proxy.py's HTTP handler and proxy plugin, in this process and its forks, parse with
    :class:`BoundedParser`; ``handle`` (the sandbox served) is named in the log lines.
    """
    global _handle
    _handle = handle
    from proxy.http import handler
    from proxy.http.proxy import server

    bounded, _ = parser_classes()
    handler.HttpParser = bounded  # type: ignore[misc,assignment]
    server.HttpParser = bounded  # type: ignore[misc,assignment]
