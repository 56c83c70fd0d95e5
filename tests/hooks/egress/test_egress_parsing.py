"""
The egress gateway's HTTP parser (``hooks/egress/parsing.py``) against proxy.py's own, in this process:
the same messages parse the same whatever pieces they come in, a head past its bounds is refused where
proxy.py's own keeps gathering it, and what a message holds grows in place where proxy.py's copies it
all on every read (its work grows with the square of the size; the figures are in
``benchmarks/bench_egress_parsing.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("proxy")

from proxy.http.exception import HttpProtocolException  # noqa: E402
from proxy.http.parser.parser import HttpParser, httpParserTypes  # noqa: E402

from sandbox_provider.hooks.egress import parsing  # noqa: E402

BoundedParser, LinearChunks = parsing.parser_classes()
REQUEST, RESPONSE = httpParserTypes.REQUEST_PARSER, httpParserTypes.RESPONSE_PARSER

MESSAGES = [
    (REQUEST, b"GET http://a.example/x?y=1 HTTP/1.1\r\nHost: a.example\r\nX-A: 1\r\n\r\n"),
    (REQUEST, b"POST http://a.example/ HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello world"),
    (REQUEST, b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n"),
    (REQUEST, b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n"),
    (REQUEST, b"POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
    (RESPONSE, b"HTTP/1.1 200 Connection established\r\n\r\n"),
    (RESPONSE, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabcde"),
    (RESPONSE, b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"),
    (RESPONSE, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"),
    (RESPONSE, b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nuntil close"),
]


def _feed(parser, data: bytes, piece: int):
    for at in range(0, len(data), piece):
        parser.parse(memoryview(data[at : at + piece]))
    return parser


def _seen(parser) -> tuple:
    body = bytes(parser.body) if parser.body is not None else None
    fields = (parser.method, parser.host, parser.port, parser.path, parser.code, parser.headers)
    return (parser.state, *fields, body, parser.is_complete)


@pytest.mark.parametrize(("kind", "data"), MESSAGES, ids=range(len(MESSAGES)))
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 1 << 20])
def test_messages_parse_as_proxy_py_parses_them(kind, data, piece):
    ours, theirs = _feed(BoundedParser(kind), data, piece), _feed(HttpParser(kind), data, piece)
    assert _seen(ours) == _seen(theirs)
    if kind == REQUEST and theirs.is_complete and theirs.method != b"CONNECT":
        assert ours.build() == theirs.build()  # what the gateway sends on


def test_a_head_past_its_bounds_is_refused_where_proxy_py_keeps_gathering_it():
    endless = [b"GET http://a.example/ HTTP/1.1\r\nX-Long: ", *[b"a" * 65536] * 128]  # 8 MiB, no end
    theirs = HttpParser(REQUEST)
    for piece in endless:  # positive control: proxy.py's own holds all of it, waiting for the end
        theirs.parse(memoryview(piece))
    assert len(theirs.buffer) > 8 << 20 and not theirs.is_complete
    ours = BoundedParser(REQUEST)
    with pytest.raises(HttpProtocolException, match="head passed 65536 bytes"):
        for piece in endless:
            ours.parse(memoryview(piece))
    many = b"GET http://a.example/ HTTP/1.1\r\n" + b"a: b\r\n" * 128
    with pytest.raises(HttpProtocolException, match="128 lines"):
        BoundedParser(REQUEST).parse(memoryview(many))
    assert not HttpParser(REQUEST).parse(memoryview(many))  # proxy.py's own: no bound on lines
    # Within the bounds: 127 headers, and a head of exactly 64 KiB.
    fits = BoundedParser(REQUEST)
    fits.parse(memoryview(b"GET http://a.example/ HTTP/1.1\r\n" + b"a: b\r\n" * 127 + b"\r\n"))
    assert fits.is_complete
    line = b"GET http://a.example/ HTTP/1.1\r\nX: "
    exact = line + b"a" * (parsing.MAX_HEAD_BYTES - len(line) - 4) + b"\r\n\r\n"
    assert len(exact) == parsing.MAX_HEAD_BYTES and _feed(BoundedParser(REQUEST), exact, 1000).is_complete


def test_a_chunk_size_line_past_its_bound_is_refused():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(HttpProtocolException, match="size line passed 4096 bytes"):
        _feed(BoundedParser(RESPONSE), head + b"f" * 8192, 1024)
    with pytest.raises(HttpProtocolException, match="not a size"):
        BoundedParser(RESPONSE).parse(memoryview(head + b"zz\r\n"))


def _objects_while_fed(parser, pieces, held) -> set[int]:
    """The ids of the objects ``held(parser)`` was after each piece: one object grown in place, or a copy each time."""
    seen = set()
    for piece in pieces:
        parser.parse(memoryview(piece))
        seen.add(id(held(parser)))
    return seen


def test_what_a_message_holds_grows_in_place_where_proxy_py_copies_it_on_every_read():
    reads = 50
    body = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (reads * 1000), *[b"x" * 1000] * reads]
    chunked = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", *[b"3e8\r\n" + b"x" * 1000 + b"\r\n"] * reads]
    head = [b"GET http://a.example/ HTTP/1.1\r\nX: ", *[b"a" * 1000] * reads]

    def body_of(parser):
        return parser.body

    def chunks_of(parser):
        return parser.chunk.body

    # Positive control: proxy.py's own makes a new object of everything so far on each read.
    theirs = HttpParser(RESPONSE)
    theirs.parse(memoryview(body[0]))
    kept = []  # hold each one, so no id is reused
    for piece in body[1:]:
        theirs.parse(memoryview(piece))
        kept.append(theirs.body)
    assert len({id(b) for b in kept}) == reads
    theirs = HttpParser(RESPONSE)
    theirs.parse(memoryview(chunked[0]))
    kept = []
    for piece in chunked[1:]:
        theirs.parse(memoryview(piece))
        kept.append(theirs.chunk.body)
    assert len({id(b) for b in kept}) == reads
    theirs = HttpParser(REQUEST)
    kept = []
    for piece in head:
        theirs.parse(memoryview(piece))
        kept.append(theirs.buffer)
    assert len({id(b) for b in kept}) == len(head)
    # The gateway's: one object each, grown in place.
    ours = BoundedParser(RESPONSE)
    ours.parse(memoryview(body[0]))
    assert len(_objects_while_fed(ours, body[1:], body_of)) == 1 and ours.is_complete
    ours = BoundedParser(RESPONSE)
    ours.parse(memoryview(chunked[0]))
    assert len(_objects_while_fed(ours, chunked[1:], chunks_of)) == 1
    assert len(ours.chunk.body) == reads * 1000
    ours = BoundedParser(REQUEST)
    assert len(_objects_while_fed(ours, head, lambda parser: parser.head)) == 1
