"""
Commands under a guest-side deadline, for hosted backends whose service neither kills a command at
its deadline nor keeps the end of its output (Islo, Boat).

The guest program ``run_with_deadline.sh`` runs the command with its output going to files in the
sandbox, kills its process group at the deadline, and replays the tail of each stream followed by
one status line on stderr. :func:`wrapper_argv` builds its invocation; :func:`parse_status` reads
the status line back and strips it.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

from sandbox_provider.sandbox import guest

__all__ = ["PROGRAM", "STATUS_MARK", "DeadlineRun", "parse_status", "replay", "wrapper_argv", "wrapper_command"]

PROGRAM = "run_with_deadline.sh"
#: The first word of the status line the guest program writes last on stderr.
STATUS_MARK = "airflow-sandbox-status"
#: The exit status the guest program uses when it cannot run the command at all.
WRAPPER_FAILED = 125
_ARGV0 = "airflow-sandbox-run"


@dataclass(frozen=True)
class DeadlineRun:
    """
    What the guest program reported.

    :param exit_code: the command's exit status.
    :param timed_out: the deadline stopped the command.
    :param stdout: the replayed tail of its stdout (at most ``keep_bytes`` bytes of it).
    :param stderr: the replayed tail of its stderr, the status line removed.
    :param stdout_bytes: bytes the command wrote to stdout in all.
    :param stderr_bytes: bytes it wrote to stderr in all.
    :param stdout_newlines: newline characters it wrote to stdout in all.
    :param stderr_newlines: newline characters it wrote to stderr in all.
    """

    exit_code: int
    timed_out: bool
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    stdout_newlines: int = 0
    stderr_newlines: int = 0


def wrapper_argv(command: str, *, deadline: float, kill_after: int, keep_bytes: int, login: bool) -> list[str]:
    """
    The argv that runs ``command`` under the guest program.

    :param deadline: seconds the command may run; rounded up to hundredths, at least 0.01.
    :param kill_after: seconds from SIGTERM to SIGKILL at the deadline.
    :param keep_bytes: bytes of each stream replayed (the tail), at least 1.
    :param login: run the command in a login shell, so the guest's profile applies first.
    """
    hundredths = max(1, math.ceil(round(float(deadline) * 100, 6)))
    return [
        "sh",
        "-c",
        guest.program(PROGRAM),
        _ARGV0,
        str(hundredths),
        str(int(kill_after)),
        str(max(1, int(keep_bytes))),
        "1" if login else "0",
        command,
    ]


def wrapper_command(command: str, **kwargs) -> str:
    """:func:`wrapper_argv` as one shell command line, for services that take a string."""
    return shlex.join(wrapper_argv(command, **kwargs))


def parse_status(stdout: str, stderr: str) -> DeadlineRun | None:
    """
    Read the status line off the end of ``stderr``; None when it is missing or malformed (the
    guest program did not finish: the sandbox ended, or the service cut the output short).
    """
    head, sep, line = stderr.rpartition(f"\n{STATUS_MARK} ")
    if not sep:
        return None
    fields = line.split()
    if len(fields) != 6 or not all(f.isdigit() for f in fields) or line.rstrip("\n") != " ".join(fields):
        return None
    status, late, out_bytes, err_bytes, out_lines, err_lines = (int(f) for f in fields)
    return DeadlineRun(
        exit_code=status,
        timed_out=late == 1,
        stdout=stdout,
        stderr=head,
        stdout_bytes=out_bytes,
        stderr_bytes=err_bytes,
        stdout_newlines=out_lines,
        stderr_newlines=err_lines,
    )


def replay(run: DeadlineRun, output: Any, keep_bytes: int) -> None:
    """
    Write what the guest program replayed into ``output`` (an ``OutputSink``), with what the
    command wrote in all, so a stream the guest cut reads as truncated and its notes count exactly.
    """
    output.stdout(run.stdout)
    output.stderr(run.stderr)
    output.stream_totals("stdout", total_bytes=run.stdout_bytes, newlines=run.stdout_newlines)
    output.stream_totals("stderr", total_bytes=run.stderr_bytes, newlines=run.stderr_newlines)
