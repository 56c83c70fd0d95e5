"""
Every program that runs inside a sandbox, in one place.

Each program is a file beside this module: POSIX ``sh`` scripts (``*.sh``) and standard-library
Python (``*.py``). They take their input as positional arguments, never by text pasted into the
program, so a path or a command cannot change what the program does. Each one runs under plain
``sh`` or ``python3`` on the host too, and is tested there.

Run one through a shell command line with :func:`shell_command`, or read its text with :func:`program`.
"""

from __future__ import annotations

import functools
import shlex
from importlib import resources

__all__ = [
    "IS_DIR_STATUS",
    "MISSING_STATUS",
    "NOT_REGULAR_STATUS",
    "SIZE_MARK",
    "TOO_LARGE_STATUS",
    "program",
    "shell_command",
]

#: Exit statuses of ``file.sh``, chosen outside what coreutils return.
MISSING_STATUS, IS_DIR_STATUS, NOT_REGULAR_STATUS, TOO_LARGE_STATUS = 66, 67, 68, 69
#: ``file.sh`` prints ``sandbox-size:<bytes>`` to standard error before it copies.
SIZE_MARK = "sandbox-size:"


@functools.cache
def program(name: str) -> str:
    """
    Return the text of the guest program ``name`` (a file name such as ``"file.sh"``).

    :raises FileNotFoundError: for a name that is not a guest program.
    """
    if "/" in name or name.startswith(".") or name == "__init__.py":
        raise FileNotFoundError(f"{name!r} is not a guest program")
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def shell_command(name: str, *args: object) -> str:
    """
    A ``sh -c`` command line that runs the shell program ``name`` with ``args`` as ``$1``, ``$2``, ...

    :raises ValueError: for a program that is not a ``.sh`` file, or an argument holding NUL.
    """
    if not name.endswith(".sh"):
        raise ValueError(f"{name!r} is not a shell program")
    words = [str(a) for a in args]
    if any("\0" in w for w in words):
        raise ValueError("an argument of a guest program holds a NUL character")
    return " ".join(["sh", "-c", shlex.quote(program(name)), shlex.quote(name), *map(shlex.quote, words)])
