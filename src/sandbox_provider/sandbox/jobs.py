"""
Detached commands: the values and the guest side of the contract's ``start_detached`` / ``poll`` /
``stop`` (see :class:`~sandbox_provider.sandbox.hook.SandboxHook`).

A detached command runs inside the sandbox under a runner of its own (``guest/job_run.sh``), started
in a session of its own so it outlives the launch that started it. Its output and exit status stay
in the sandbox, in the job's directory: each stream in segments of :data:`SEGMENT_BYTES`, of which
only the last few are kept (bounded, like the tails of an attached command), the status in one file
written once the output is complete. Any process that can run a short program in the sandbox can
read them, by byte offset, so a reader that restarts resumes where it stopped, with no line twice and
none left out (unless the command wrote faster than it was read and the kept segments moved past it;
the reader is then told how many bytes it missed).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import secrets
from dataclasses import dataclass, field

from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError

__all__ = [
    "DetachedJob",
    "JobCursor",
    "JobState",
    "check_job_id",
    "job_directory",
    "kept_segments",
    "new_job_id",
    "parse_poll",
    "poll_command",
    "start_command",
    "stop_command",
]

#: Bytes per output segment of a detached command.
SEGMENT_BYTES = 64 * 1024
#: The least of each stream a detached command keeps, in bytes, however small its tails are: what a
#: reader that fell behind for a while (a triggerer restarting) can still catch up on.
RELAY_WINDOW_BYTES = 8 * 1024 * 1024
#: The most bytes of each stream one poll returns.
POLL_BYTES = 256 * 1024
#: Where the jobs' directories live in a sandbox.
JOB_ROOT = "/tmp"
#: What ``job_poll.sh`` exits with when there is no such job.
NO_JOB_STATUS = 66
#: What ``job_start.sh`` exits with when it could not start the job (with a line on stderr).
START_FAILED_STATUS = 125

_JOB_ID = re.compile(r"[0-9a-f]{32}")
_STATE = re.compile(rb"airflow-sandbox-job (running|ended (-?\d+) ([01]) ([01]))")
_KEPT = re.compile(rb"kept (\d+) (\d+)(?: (\d+) (\d+))?")
_STREAM = re.compile(rb"(out|err) (\d+) (\d+) (\d+)")


@dataclass(frozen=True)
class DetachedJob:
    """
    A command started detached in a sandbox.

    :param id: the job's id (32 hex digits), for :meth:`~SandboxHook.poll` and :meth:`~SandboxHook.stop`.
    :param timeout: the deadline it runs under, in seconds, after the sandbox's lifetime cut it.
    :param started_at: Unix time (seconds) it was started; its deadline is ``started_at + timeout``.
    """

    id: str
    timeout: float
    started_at: float

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True)
class JobCursor:
    """Where a reader of a detached command's output stands: the bytes of each stream read so far."""

    stdout: int = 0
    stderr: int = 0

    def to_list(self) -> list[int]:
        """``[stdout, stderr]``, for a trigger's serialized arguments."""
        return [self.stdout, self.stderr]

    @classmethod
    def from_value(cls, value: object) -> JobCursor:
        """
        A cursor from :meth:`to_list`'s form, a cursor, or None (the start).

        :raises ValueError: for anything else.
        """
        if value is None:
            return cls()
        if isinstance(value, JobCursor):
            return value
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_offset(v) for v in value):
            return cls(int(value[0]), int(value[1]))
        raise ValueError(f"A job cursor is two byte offsets [stdout, stderr], got {value!r}.")


def _is_offset(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class JobState:
    """
    What one :meth:`~SandboxHook.poll` of a detached command found.

    :param stdout: the bytes of standard output from ``since`` on (at most the poll's budget).
    :param stderr: the same of standard error.
    :param cursor: where the next poll starts: the offsets just past ``stdout`` and ``stderr``.
    :param skipped: bytes of each stream between ``since`` and what was returned that are no longer
        kept (the command wrote faster than it was read); zero when nothing was missed.
    :param totals: the bytes each stream holds so far, as a cursor past all of it.
    :param newlines: newline characters in each stream (complete once the job ended).
    :param exit_code: the command's exit status; None while it runs.
    :param timed_out: its deadline passed and it was killed.
    :param stopped: :meth:`~SandboxHook.stop` ended it.
    :param kept_cursor: where a reader last recorded it stood (``poll(..., keep_cursor=True)``), so a
        reader that restarts resumes there; offsets 0 when none did.
    :param in_flight: the ends of what that reader was handing on when it recorded (what its
        recording poll returned), as the record stood before this poll: past ``kept_cursor`` when it
        may have handed on bytes it never recorded (it stopped before its next record); equal to
        ``kept_cursor`` when nothing was in flight.
    """

    stdout: bytes
    stderr: bytes
    cursor: JobCursor
    skipped: JobCursor = field(default_factory=JobCursor)
    totals: JobCursor = field(default_factory=JobCursor)
    newlines: JobCursor = field(default_factory=JobCursor)
    exit_code: int | None = None
    timed_out: bool = False
    stopped: bool = False
    kept_cursor: JobCursor = field(default_factory=JobCursor)
    in_flight: JobCursor = field(default_factory=JobCursor)

    @property
    def ended(self) -> bool:
        """The command has ended (its output is complete)."""
        return self.exit_code is not None

    @property
    def caught_up(self) -> bool:
        """Everything the streams held at this poll was returned."""
        return self.cursor.stdout >= self.totals.stdout and self.cursor.stderr >= self.totals.stderr


def new_job_id() -> str:
    """A new job id: 32 random hex digits."""
    return secrets.token_hex(16)


def check_job_id(job: object) -> str:
    """:raises ValueError: unless ``job`` is a job id (:class:`DetachedJob` or the string of one)."""
    text = job.id if isinstance(job, DetachedJob) else job
    if not isinstance(text, str) or not _JOB_ID.fullmatch(text):
        raise ValueError(f"{job!r} is not a detached job id; pass what start_detached() returned (32 hex digits).")
    return text


def job_directory(job: str) -> str:
    """The directory of job ``job`` in the sandbox."""
    return f"{JOB_ROOT}/airflow-sandbox-job.{check_job_id(job)}"


def kept_segments(max_output_bytes: int) -> int:
    """Segments kept per stream: room for the tail (``max_output_bytes``) and the relay window, and one more."""
    return math.ceil(max(int(max_output_bytes), RELAY_WINDOW_BYTES) / SEGMENT_BYTES) + 1


def start_command(job: str, command: str, timeout: float, max_output_bytes: int) -> str:
    """The ``sh -c`` command line that starts ``command`` detached as job ``job`` under a deadline of ``timeout`` s."""
    millis = max(1, math.ceil(timeout * 1000 - 1e-6))
    return guest.shell_command(
        "job_start.sh",
        job_directory(job),
        f"{millis // 1000}.{millis % 1000:03d}",
        math.ceil(millis / 10),
        SEGMENT_BYTES,
        kept_segments(max_output_bytes),
        guest.program("job_run.sh"),
        command,
    )


def poll_command(
    job: str, since: JobCursor | None, max_bytes: int = POLL_BYTES, *, keep_cursor: bool = False, in_flight: bool = True
) -> str:
    """
    The command line that reads job ``job``'s state and output from ``since`` on; with ``since``
    None, the last ``max_bytes`` of each stream (the tails of a job that ended). ``keep_cursor``
    records ``since`` in the job's directory as where the reader stands, and with ``in_flight`` the
    ends of what it returns as what the reader is handing on until its next record.
    """
    start = ("-" + str(int(max_bytes)),) * 2 if since is None else (since.stdout, since.stderr)
    keep = ("keep" if in_flight else "commit") if keep_cursor and since is not None else "-"
    return guest.shell_command("job_poll.sh", job_directory(job), SEGMENT_BYTES, *start, int(max_bytes), keep)


def stop_command(job: str) -> str:
    """The command line that stops job ``job``."""
    return guest.shell_command("job_stop.sh", job_directory(job))


def parse_poll(text: bytes, since: JobCursor | None, handle: str) -> JobState:
    """
    The :class:`JobState` in ``job_poll.sh``'s standard output ``text``, read from ``since`` (None: the tails).

    :raises SandboxError: for output that is not the program's (a command of the sandbox replaced it).
    """
    lines = text.split(b"\n")
    state = _STATE.fullmatch(lines[0]) if lines else None
    kept = _KEPT.fullmatch(lines[1]) if len(lines) > 1 else None
    if state is None or kept is None or len(lines) < 6:
        raise SandboxError(f"Could not read the state of a detached command in sandbox {handle}: {text[:200]!r}")
    lines = lines[1:]
    streams = {}
    origin = since or JobCursor()
    for head, body, start in ((lines[1], lines[2], origin.stdout), (lines[3], lines[4], origin.stderr)):
        match = _STREAM.fullmatch(head)
        if match is None:
            raise SandboxError(f"Could not read the output of a detached command in sandbox {handle}: {head[:200]!r}")
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as damage:
            raise SandboxError(
                f"The output of a detached command in sandbox {handle} came back damaged: {damage}"
            ) from damage
        begin, total, newlines = (int(match.group(i)) for i in (2, 3, 4))
        streams[match.group(1)] = (data, begin, total, newlines, max(0, begin - start) if since else 0)
    out, err = streams.get(b"out"), streams.get(b"err")
    if out is None or err is None:
        raise SandboxError(f"Could not read both streams of a detached command in sandbox {handle}.")
    ended = state.group(1) != b"running"
    return JobState(
        stdout=out[0],
        stderr=err[0],
        cursor=JobCursor(out[1] + len(out[0]), err[1] + len(err[0])),
        skipped=JobCursor(out[4], err[4]),
        totals=JobCursor(out[2], err[2]),
        newlines=JobCursor(out[3], err[3]),
        exit_code=int(state.group(2)) if ended else None,
        timed_out=ended and state.group(3) == b"1",
        stopped=ended and state.group(4) == b"1",
        kept_cursor=JobCursor(int(kept.group(1)), int(kept.group(2))),
        in_flight=JobCursor(*(int(kept.group(i) or kept.group(i - 2)) for i in (3, 4))),
    )
