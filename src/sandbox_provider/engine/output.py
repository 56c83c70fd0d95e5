"""
The consumer half of output handling: what a reader is shown of a command's output, the same for
every consumer and backend. Streams are masked with Airflow's secret masker before anything is cut;
tails say exactly what they leave out. What reaches a task log, and how, is
:mod:`sandbox_provider.engine.task_log`; the bounded buffers a backend fills are in
:mod:`sandbox_provider.sandbox.output`.
"""

from __future__ import annotations

import signal

from sandbox_provider.sandbox.output import format_size
from sandbox_provider.sandbox.spec import SandboxExecResult, StreamTotals

__all__ = [
    "MASK_MARGIN_BYTES",
    "command_output",
    "drop_head_bytes",
    "file_window",
    "head_lines",
    "longest_secret_bytes",
    "mask_stream",
    "mask_text",
    "secret_margin_bytes",
    "stream_tail",
    "tail_text",
]


def tail_text(text: str, max_chars: int) -> str:
    """Return at most the last ``max_chars`` characters of ``text``, marking a cut with an ellipsis line."""
    if len(text) <= max_chars:
        return text
    return "[... earlier output cut]\n" + text[len(text) - max_chars :]


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


def _line_count(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def stream_tail(
    text: str, *, max_lines: int, max_bytes: int, totals: StreamTotals | None = None, cut: bool = False
) -> str:
    """
    What a reader is shown of one output stream: the end of ``text`` (the tail its producer kept),
    with the secrets Airflow knows masked, under ``max_lines`` lines and ``max_bytes`` UTF-8 bytes
    (newlines between lines included).

    Whole lines are kept, newest last; only when the last line alone is wider than ``max_bytes`` is
    the end of it shown instead. When anything is left out, a first line says exactly how many
    lines and bytes of the stream are not shown, counted from ``totals``, and how to see them.

    Secrets are masked before anything is cut. A first line whose start the producer dropped is
    never shown whole, and its first bytes never: a secret split by that cut cannot be recognised.

    Counts are of the stream as written, except in a line shown only in part that held a masked
    secret: there the bytes count the masked text.

    :param totals: what the command wrote to the stream in all; None when the producer did not
        count, and then a note after a producer's cut gives lower bounds ("at least").
    :param cut: the producer dropped part of the stream (a result's ``*_truncated`` flag).
    :returns: ``text`` masked, and otherwise unchanged when it fits and nothing was dropped.
    """
    if not text:
        return text
    counted = totals is not None
    if totals is None:
        totals = StreamTotals(bytes=_utf8_len(text), lines=_line_count(text), tail_at_line_start=not cut)
    lines = mask_text(text).split("\n")
    raw_lines = text.split("\n")
    if len(raw_lines) != len(lines):  # a masked secret held a newline: count what is shown instead
        raw_lines = lines
    trailing = lines[-1] == ""
    if trailing:
        lines, raw_lines = lines[:-1], raw_lines[:-1]
    first_whole = 0 if totals.tail_at_line_start else 1
    body, shown, partial, shown_bytes = _shown_tail(
        lines, raw_lines, trailing=trailing, skip_first=bool(first_whole), max_lines=max_lines, max_bytes=max_bytes
    )
    dropped_bytes = totals.bytes - shown_bytes
    dropped_lines = totals.lines - shown - (1 if partial else 0)
    if dropped_bytes <= 0 and dropped_lines <= 0:
        if not cut or not counted:
            return body
        return (
            "[... the sandbox stopped passing this output on before the command ended; what followed is not shown]\n"
            + body
        )
    what = _left_out(dropped_lines, dropped_bytes, partial=bool(partial), lower_bound=cut and not counted)
    return (
        f"[... {what} not shown; the limits are {max_lines} lines and {format_size(max_bytes)}. Send the output to a "
        f"file and read it in parts, or filter it with grep, head or tail.]\n{body}"
    )


def _shown_tail(
    lines: list[str], raw_lines: list[str], *, trailing: bool, skip_first: bool, max_lines: int, max_bytes: int
) -> tuple[str, int, str, int]:
    """
    The part of a stream's masked ``lines`` a reader is shown (see :func:`stream_tail`), as
    ``(text, whole lines shown, the partial last line or "", bytes of the stream shown)``; the bytes
    count ``raw_lines``, the lines as written. ``skip_first``: the first line's start was dropped.
    """
    newest_first, _ = head_lines(lines[int(skip_first) :][::-1], max_lines=max_lines, max_bytes=max_bytes)
    shown = len(newest_first)
    if shown:
        body = "\n".join(lines[len(lines) - shown :]) + ("\n" if trailing else "")
        shown_bytes = sum(_utf8_len(line) for line in raw_lines[len(raw_lines) - shown :]) + shown - 1 + trailing
        return body, shown, "", shown_bytes
    room = max_bytes
    if skip_first and len(lines) == 1:
        room = min(room, _utf8_len(lines[0]) - secret_margin_bytes())
    partial = _utf8_tail(lines[-1], room) if lines and room > 0 else ""
    body = partial + ("\n" if partial and trailing else "")
    return body, 0, partial, _utf8_len(body)


def _left_out(dropped_lines: int, dropped_bytes: int, *, partial: bool, lower_bound: bool) -> str:
    """Words for what a tail leaves out; ``lower_bound`` when the producer's cut was not counted."""
    if dropped_lines and partial:
        what = f"{_plural(dropped_lines, 'earlier line')} and the start of the last one ({dropped_bytes} bytes in all)"
    elif dropped_lines:
        what = f"{_plural(dropped_lines, 'earlier line')} ({_plural(dropped_bytes, 'byte')})"
    else:
        what = f"the first {_plural(dropped_bytes, 'byte')} of the last line"
    return "at least " + what if lower_bound else what


def _signal_name(exit_code: int) -> str | None:
    """The signal a shell's exit status of 128 + N reports a command killed by, e.g. ``SIGKILL`` for 137."""
    try:
        return signal.Signals(exit_code - 128).name if 128 < exit_code < 128 + 65 else None
    except ValueError:
        return None


def command_output(result: SandboxExecResult, *, timeout: float, max_lines: int, max_bytes: int) -> str:
    """
    A command's result as text for a model, the same on every backend.

    Each stream that printed anything is labelled (``[stdout]``, ``[stderr]``) and cut with
    :func:`stream_tail`; a command that printed nothing reads ``(no output)``. A last line of notes
    follows when there is something to say: ``[timed out after 2s]`` (the deadline the backend
    applied), or ``[exit code: 3]`` for a non-zero exit (with the signal, such as ``SIGKILL``, for a
    status above 128), and that the sandbox ended, when it did.

    :param timeout: the deadline asked for, in seconds; reported when the backend gives none.
    """
    sections = []
    for label, text, totals, cut in (
        ("stdout", result.stdout, result.stdout_totals, result.stdout_truncated),
        ("stderr", result.stderr, result.stderr_totals, result.stderr_truncated),
    ):
        if text:
            shown = stream_tail(text, max_lines=max_lines, max_bytes=max_bytes, totals=totals, cut=cut)
            sections.append(f"[{label}]\n" + shown.rstrip("\n"))
    text = "\n".join(sections) if sections else "(no output)"
    applied = result.applied_timeout
    notes = []
    if result.timed_out:
        notes.append(f"[timed out after {timeout if applied is None else applied:g}s]")
    elif result.exit_code < 0:
        if not result.sandbox_terminated:
            notes.append("[the exit status of the command is not known]")
    elif result.exit_code != 0:
        name = _signal_name(result.exit_code)
        notes.append(f"[exit code: {result.exit_code}" + (f" (killed by {name})]" if name else "]"))
        if result.exit_code == 127:
            notes.append("[127 usually means the command is not installed in this sandbox; use another tool]")
    if applied is not None and not result.timed_out and applied < timeout:
        notes.append(f"[the sandbox allowed only {applied:g}s for this command]")
    if result.sandbox_terminated:
        notes.append("[the sandbox ended: files from earlier calls are gone, and the next call gets a new sandbox]")
    return text + ("\n" + " ".join(notes) if notes else "")


def file_window(text: str, *, offset: int = 1, limit: int | None = None, max_lines: int, max_bytes: int) -> str:
    """
    Render lines of ``text`` starting at line ``offset`` (1-based), at most ``limit`` of them,
    under ``max_lines`` lines and ``max_bytes`` UTF-8 bytes.

    When lines remain after the window, a last line says how many and which ``offset`` reads on.
    An ``offset`` past the end says how many lines the file has; a first line wider than
    ``max_bytes`` is not shown and the text says how to read part of it.
    """
    # Lines end at "\n" only, as for sed, head and wc -l, so offsets match what a shell counts.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
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
        text = drop_head_bytes(text, secret_margin_bytes())
    return text


def secret_margin_bytes() -> int:
    """
    The bytes at the start of a cut stream that may hold part of a secret: the longest secret the
    masker knows, at most :data:`MASK_MARGIN_BYTES` (all of it when the length cannot be read).
    """
    longest = longest_secret_bytes()
    return MASK_MARGIN_BYTES if longest is None else min(MASK_MARGIN_BYTES, longest)


def drop_head_bytes(text: str, n: int) -> str:
    """Drop the first ``n`` UTF-8 bytes of ``text`` (a character split at the cut is dropped too)."""
    data = text.encode("utf-8")
    return data[n:].decode("utf-8", errors="ignore") if len(data) > n else ""
