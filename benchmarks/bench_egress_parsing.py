"""
The egress gateway's HTTP parser (``hooks/egress/parsing.py``) against proxy.py's own, in one process,
interleaved (``harness.compare``: median, min and max of the per-round ratio), each message fed in the
128 KiB reads the gateway makes:

- a plain ``http://`` response of 16 and 32 MiB with a Content-Length (goal: the time ratio falls as
  the size grows: proxy.py's work grows with the square of the size, the gateway's with the size);
- the same as 64 KiB chunks, and as 20,000 chunks of one byte;
- a request head of 64 KiB in 128 lines, the most the gateway takes (goal: at most 1x).

    .venv/bin/python benchmarks/bench_egress_parsing.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Comparison, compare, print_table  # noqa: E402

READ = 128 * 1024


def _message(kind: str, size: int) -> tuple[bool, bytes]:
    """(is a response, the message) of ``kind``."""
    if kind == "length":
        return True, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size
    if kind == "chunks":
        chunk = b"%x\r\n%s\r\n" % (size, b"x" * size)
        return True, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 64 + b"0\r\n\r\n"
    line = b"GET http://a.example/ HTTP/1.1\r\n"
    headers = b"".join(b"h%03d: %s\r\n" % (i, b"v" * 500) for i in range(127))
    return False, line + headers + b"\r\n"


def _parse(parser_class: type, response: bool, data: bytes) -> None:
    from proxy.http.parser.parser import httpParserTypes

    parser = parser_class(httpParserTypes.RESPONSE_PARSER if response else httpParserTypes.REQUEST_PARSER)
    for at in range(0, len(data), READ):
        parser.parse(memoryview(data[at : at + READ]))
    assert parser.is_complete


def rows(*, rounds: int) -> list[tuple[Comparison, str]]:
    from proxy.http.parser.parser import HttpParser

    from sandbox_provider.hooks.egress.parsing import parser_classes

    bounded, _ = parser_classes()
    cases = [
        ("16 MiB with a length", _message("length", 16 << 20), "ratio falls with the size"),
        ("32 MiB with a length", _message("length", 32 << 20), "ratio falls with the size"),
        ("4 MiB in 64 KiB chunks", _message("chunks", 64 << 10), ""),
        ("20,000 one-byte chunks", (True, _one_byte_chunks(20_000)), ""),
        ("a 64 KiB head of 128 lines", _message("head", 0), "at most 1x"),
    ]
    made = []
    for name, (response, data), goal in cases:
        made.append(
            (
                compare(
                    f"gateway parser, {name}",
                    lambda r=response, d=data: _parse(bounded, r, d),
                    "proxy.py's parser",
                    lambda r=response, d=data: _parse(HttpParser, r, d),
                    rounds=rounds,
                ),
                goal,
            )
        )
    return made


def _one_byte_chunks(count: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * count + b"0\r\n\r\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print_table(rows(rounds=args.rounds))


if __name__ == "__main__":
    main()
