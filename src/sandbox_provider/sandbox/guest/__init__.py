"""
The programs that run inside a sandbox and several backends share, and the loader of every guest program.

Each program is a file beside this module: POSIX ``sh`` scripts (``*.sh``) and standard-library
Python (``*.py``). They take their input as positional arguments, never by text pasted into the
program, so a path or a command cannot change what the program does. Each one runs under plain
``sh`` or ``python3`` on the host too, and is tested there.

Run one through a shell command line with :func:`shell_command`, or read its text with :func:`program`.
A program only one backend uses lives in that backend's own ``guest/`` folder
(``hooks/<backend>/guest/``), whose ``__init__.py`` loads it with a :class:`GuestPrograms` of its own.
"""

from __future__ import annotations

import functools
import shlex
from importlib import resources

__all__ = [
    "GuestPrograms",
    "IS_DIR_STATUS",
    "MISSING_STATUS",
    "NOT_REGULAR_STATUS",
    "SIZE_MARK",
    "RUN_SETUP_STATUS",
    "RUN_TIMEOUT_STATUS",
    "TOO_LARGE_STATUS",
    "check_run_session",
    "program",
    "run_session_argv",
    "shell_command",
]

#: Exit statuses of ``file.sh``, chosen outside what coreutils return.
MISSING_STATUS, IS_DIR_STATUS, NOT_REGULAR_STATUS, TOO_LARGE_STATUS = 66, 67, 68, 69
#: ``file.sh`` prints ``sandbox-size:<bytes>`` to standard error before it copies.
SIZE_MARK = "sandbox-size:"
#: Exit statuses of ``run_session.sh``: the deadline passed, the command was never started, no setsid.
RUN_TIMEOUT_STATUS, RUN_SETUP_STATUS, RUN_NO_SETSID_STATUS = 124, 125, 127
#: ``run_session.sh`` starts the one stderr line it writes when it cannot start the command with this.
RUN_MARK = b"airflow-sandbox: "


class GuestPrograms:
    """
    The guest programs of one package: the files beside its ``__init__.py``.

    :param package: the dotted name of the package that holds the programs (its ``__name__``).
    """

    def __init__(self, package: str) -> None:
        self.package = package

    def program(self, name: str) -> str:
        """
        Return the text of the guest program ``name`` (a file name such as ``"file.sh"``).

        :raises FileNotFoundError: for a name that is not a guest program of this package.
        """
        return _read(self.package, name)

    def shell_command(self, name: str, *args: object) -> str:
        """
        A ``sh -c`` command line that runs the shell program ``name`` with ``args`` as ``$1``, ``$2``, ...

        :raises ValueError: for a program that is not a ``.sh`` file, or an argument holding NUL.
        """
        if not name.endswith(".sh"):
            raise ValueError(f"{name!r} is not a shell program")
        words = [str(a) for a in args]
        if any("\0" in w for w in words):
            raise ValueError("an argument of a guest program holds a NUL character")
        return " ".join(["sh", "-c", shlex.quote(self.program(name)), shlex.quote(name), *map(shlex.quote, words)])


@functools.cache
def _read(package: str, name: str) -> str:
    if "/" in name or name.startswith(".") or name == "__init__.py":
        raise FileNotFoundError(f"{name!r} is not a guest program")
    try:
        return resources.files(package).joinpath(name).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise FileNotFoundError(f"{name!r} is not a guest program of {package}") from None


#: The shared programs (this package's).
SHARED = GuestPrograms(__name__)
program = SHARED.program
shell_command = SHARED.shell_command


def run_session_argv(seconds: float, workdir: str, envfile: str = "") -> list[str]:
    """
    The argv that runs a command (sent on stdin) through ``run_session.sh``: in ``workdir``, with
    ``envfile`` sourced first when given, killed with its whole session after ``seconds``.
    """
    return ["sh", "-c", program("run_session.sh"), "airflow-run", f"{seconds:.3f}", workdir, envfile]


def check_run_session(code: int, stderr_head: bytes, handle: str) -> None:
    """
    Raise what a reserved ``run_session.sh`` status means: it never started the command.

    :param stderr_head: the first bytes the command's stderr received (the wrapper's line, if any).
    :raises SandboxTerminalError: when the image lacks ``setsid``, so no command can run.
    :raises SandboxError: when staging failed (no temporary space, a missing working directory).
    """
    from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

    if code not in (RUN_SETUP_STATUS, RUN_NO_SETSID_STATUS) or not stderr_head.startswith(RUN_MARK):
        return
    reason = stderr_head.split(b"\n", 1)[0][len(RUN_MARK) :].decode("utf-8", "replace")
    if code == RUN_NO_SETSID_STATUS:
        raise SandboxTerminalError(
            f"Sandbox {handle} cannot run commands: {reason}. Use an image with util-linux (setsid) and coreutils."
        )
    raise SandboxError(f"Sandbox {handle} could not start the command: {reason}.")
