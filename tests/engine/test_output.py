"""Output shaping: stream totals while a tail is kept, exact truncation notes, command results, file windows."""

from __future__ import annotations

import random

import pytest

from sandbox_provider.engine.output import MASK_MARGIN_BYTES, command_output, file_window, stream_tail
from sandbox_provider.sandbox.hook import OutputSink, RunOutcome
from sandbox_provider.sandbox.output import TailBuffer
from sandbox_provider.sandbox.spec import SandboxExecResult, StreamTotals

LIMITS = "the limits are 2000 lines and 50.0KB. Send the output to a file and read it in parts, or filter it with grep, head or tail.]"


def seq(first: int, last: int) -> bytes:
    return "".join(f"{i}\n" for i in range(first, last + 1)).encode()


def written(data: bytes, limit: int, *, seed: int = 0) -> TailBuffer:
    """``data`` written to a TailBuffer in random pieces, as a backend's stream delivers it."""
    rng = random.Random(seed)
    buffer = TailBuffer(limit)
    at = 0
    while at < len(data):
        step = rng.choice([1, 7, 100, 4096, 70_000])
        buffer.write(data[at : at + step])
        at += step
    return buffer


def tail_of(data: bytes, *, limit: int = 50 * 1024 + MASK_MARGIN_BYTES, whole_lines: bool = False, **caps) -> str:
    """What the model is shown of a stream that wrote ``data``, through a TailBuffer as the sink keeps it."""
    buffer = written(data, limit)
    text, at_line = buffer.tail(whole_lines=whole_lines)
    totals = StreamTotals(bytes=buffer.total, lines=buffer.lines, tail_at_line_start=at_line)
    caps.setdefault("max_lines", 2000)
    caps.setdefault("max_bytes", 50 * 1024)
    return stream_tail(text, totals=totals, cut=buffer.truncated, **caps)


# -- what a TailBuffer counts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"", b"a", b"a\n", b"\n\n\n", seq(1, 60000), b"x" * (5 * 1024 * 1024), b"x" * 99_999 + b"\n" + b"y" * 10],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tail_buffer_counts_every_byte_and_line(data, seed):
    buffer = written(data, 1000, seed=seed)
    assert buffer.total == len(data)
    assert buffer.lines == data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    kept = buffer.getvalue()
    assert data.endswith(kept) and len(kept) == min(len(data), 1000)
    _text, at_line = buffer.tail()
    start = len(data) - len(kept)
    assert at_line == (start == 0 or data[start - 1 : start] == b"\n")


def test_whole_lines_drops_a_partial_first_line_only():
    buffer = written(b"abc\n" * 1000, 1001)  # the kept tail starts one byte into a line
    text, at_line = buffer.tail(whole_lines=True)
    assert at_line and text == "abc\n" * 250
    aligned = written(b"abc\n" * 1000, 1000)
    assert aligned.tail(whole_lines=True) == ("abc\n" * 250, True)  # a whole first line is kept


def test_sink_reports_totals_with_the_tails():
    sink = OutputSink(100)
    for i in range(1, 1001):
        sink.stdout(f"{i}\n".encode())
    sink.stderr(b"oops")
    result = sink.result(RunOutcome(0), 5.0)
    kept = sink.out.getvalue()
    at_line = seq(1, 1000)[-len(kept) - 1 : -len(kept)] == b"\n"
    assert result.stdout_totals == StreamTotals(bytes=len(seq(1, 1000)), lines=1000, tail_at_line_start=at_line)
    assert result.stderr_totals == StreamTotals(bytes=4, lines=1, tail_at_line_start=True)
    assert result.stdout_truncated and result.stdout.endswith("1000\n")


@pytest.mark.parametrize("data", [b"", b"x\n\ny\r\nz", b"\r\n" * 3, seq(1, 3000), seq(1, 3000) + b"end"])
def test_a_restated_stream_is_the_stream_read_afterwards(data):
    """A backend that streamed reshaped lines, then read the stream's end: as if the bytes had been written."""
    sink = OutputSink(100)
    sink.stdout(b"what the live stream made of it\n" * 50)
    sink.stdout(b"unended")
    take = min(len(data), 101)  # the end of the stream, one byte more than is kept when there is more
    sink.restate("stdout", data[len(data) - take :], total_bytes=len(data), newlines=data.count(b"\n"))
    direct = OutputSink(100)
    direct.stdout(data)
    assert sink.result(RunOutcome(0), 5.0) == direct.result(RunOutcome(0), 5.0)


# -- exact truncation notes ------------------------------------------------------------------------------


def test_sixty_thousand_lines():
    data = seq(1, 60000)
    shown_part = seq(58001, 60000)
    expected = f"[... 58000 earlier lines ({len(data) - len(shown_part)} bytes) not shown; {LIMITS}\n"
    assert tail_of(data) == expected + shown_part.decode()
    assert len(data) - len(shown_part) == 336894  # checked by hand: 348894 bytes written, 12000 shown


def test_a_single_five_megabyte_line():
    line = b"x" * (5 * 1024 * 1024)
    dropped = len(line) - 50 * 1024
    assert tail_of(line) == f"[... the first {dropped} bytes of the last line not shown; {LIMITS}\n" + "x" * 51200
    # With a newline at its end, the newline is shown too: the same first bytes of the line are not.
    with_newline = tail_of(line + b"\n")
    assert with_newline.startswith(f"[... the first {dropped} bytes of the last line not shown;")
    assert with_newline.endswith("x\n")


def test_lines_before_a_line_too_wide_to_show():
    data = seq(1, 10) + b"y" * 60_000
    out = tail_of(data)
    dropped = len(data) - 50 * 1024
    assert out.startswith(f"[... 10 earlier lines and the start of the last one ({dropped} bytes in all) not shown;")
    assert out.endswith("\n" + "y" * 51200)


def test_byte_cap_before_line_cap():
    data = ("z" * 99 + "\n").encode() * 1000  # 100 bytes a line: 512 lines fit 50 KiB with their newlines
    out = tail_of(data)
    shown = out.split("\n", 1)[1]
    assert shown.count("\n") == 512 and len(shown.encode()) <= 50 * 1024
    assert out.startswith(f"[... 488 earlier lines ({488 * 100} bytes) not shown;")


def test_multibyte_characters_count_as_their_utf8_bytes():
    data = ("é" * 9 + "\n").encode() * 5000  # 19 bytes a line
    out = tail_of(data)
    assert out.startswith(f"[... 3000 earlier lines ({3000 * 19} bytes) not shown;")


def test_what_fits_is_unchanged():
    assert tail_of(b"one\ntwo\n") == "one\ntwo\n"
    assert tail_of(b"no newline") == "no newline"
    assert stream_tail("", max_lines=3, max_bytes=10) == ""


def test_a_partial_first_line_is_never_shown_whole():
    # The producer kept a tail that starts inside "line 2": that fragment must not pass for a line.
    text = "ne 2\nline 3\n"
    totals = StreamTotals(bytes=len("line 1\nline 2\nline 3\n"), lines=3, tail_at_line_start=False)
    out = stream_tail(text, max_lines=10, max_bytes=1000, totals=totals, cut=True)
    assert out.startswith("[... 2 earlier lines (14 bytes) not shown;") and out.endswith("\nline 3\n")


def test_without_totals_a_producer_cut_gives_lower_bounds():
    # Its first line may have lost its start, so it is not shown: it counts as one line not shown.
    out = stream_tail("a\nb\nc\n", max_lines=2, max_bytes=1000, cut=True)
    assert out.startswith("[... at least 1 earlier line (2 bytes) not shown;") and out.endswith("\nb\nc\n")
    # Without a producer's cut the text is the whole stream, so the counts are exact.
    assert stream_tail("a\nb\nc\n", max_lines=2, max_bytes=1000).startswith("[... 1 earlier line (2 bytes) not shown;")


def test_a_stream_that_stopped_arriving_says_so():
    totals = StreamTotals(bytes=6, lines=2)
    out = stream_tail("ab\ncd\n", max_lines=10, max_bytes=100, totals=totals, cut=True)
    assert (
        out
        == "[... the sandbox stopped passing this output on before the command ended; what followed is not shown]\nab\ncd\n"
    )


# -- command results, the same for every backend ---------------------------------------------------------


def result(**fields) -> SandboxExecResult:
    fields.setdefault("exit_code", 0)
    fields.setdefault("stdout", "")
    fields.setdefault("stderr", "")
    return SandboxExecResult(**fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "(no output)"),
        ({"timed_out": True, "exit_code": 137, "applied_timeout": 2.0}, "(no output)\n[timed out after 2s]"),
        ({"timed_out": True, "exit_code": -1}, "(no output)\n[timed out after 5s]"),
        ({"stdout": "partial\n", "exit_code": 3}, "[stdout]\npartial\n[exit code: 3]"),
        ({"stdout": "kept across calls\n"}, "[stdout]\nkept across calls"),
        ({"stdout": "o\n", "stderr": "e\n", "exit_code": 1}, "[stdout]\no\n[stderr]\ne\n[exit code: 1]"),
        ({"exit_code": 137}, "(no output)\n[exit code: 137 (killed by SIGKILL)]"),
        ({"exit_code": 143}, "(no output)\n[exit code: 143 (killed by SIGTERM)]"),
        ({"exit_code": 255}, "(no output)\n[exit code: 255]"),
        ({"exit_code": -1}, "(no output)\n[the exit status of the command is not known]"),
        (
            {"exit_code": -1, "sandbox_terminated": True},
            "(no output)\n[the sandbox ended: files from earlier calls are gone, and the next call gets a new sandbox]",
        ),
        (
            {"timed_out": True, "exit_code": -1, "sandbox_terminated": True, "applied_timeout": 3.0},
            "(no output)\n[timed out after 3s] [the sandbox ended: files from earlier calls are gone, and the next "
            "call gets a new sandbox]",
        ),
        ({"applied_timeout": 1.5}, "(no output)\n[the sandbox allowed only 1.5s for this command]"),
    ],
)
def test_command_output(fields, expected):
    assert command_output(result(**fields), timeout=5.0, max_lines=2000, max_bytes=50 * 1024) == expected


# -- file windows count lines as a shell does -------------------------------------------------------------


def test_file_window_splits_at_newlines_only():
    text = "a\x0cb\nc\rd\ne\n"  # a form feed and a lone CR are not line ends for sed or wc -l
    assert file_window(text, max_lines=1, max_bytes=100) == "a\x0cb\n[... 2 more line(s); read on with offset=2]"
    assert file_window(text, offset=3, max_lines=5, max_bytes=100) == "e"
    assert file_window(text, offset=4, max_lines=5, max_bytes=100) == "(nothing at offset 4: the file has 3 line(s))"
