"""
The built system-call filter, kept on disk for the worker's later processes.

Building the filter means loading libseccomp through its Python binding and adding a few hundred
rules: about 7 ms, paid by every task process (each is new) before its first local sandbox. The
result depends only on the rules (``seccomp.py``), the machine's architecture, the libseccomp
library and the binding, so it is kept in a file and read back (well under a millisecond) while
all of those are unchanged:

- the file lives in ``<temp dir>/airflow-sandbox-<uid>-cache/`` (``uid``: the worker's effective
  user), a directory that user owns, which no one else may write; the file must be owned by that user
  and writable by no one else either. Anything else (a directory someone else made first, a link, a
  file others may write) is not used, and the filter is built in memory as before;
- its name carries a digest of ``seccomp.py`` and the architecture, so changed rules never read an
  older filter;
- it records the device, inode, size and modification time of the libseccomp library and of the
  binding's module that built it; an upgrade of either (a new file) makes the filter be built again;
- it is written whole (a partial file, then a rename), so a reader never sees half of one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import sys
import tempfile
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["cache_dir", "load", "store"]

_FORMAT = 1
_MAX_BYTES = 1 << 20
_RULES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py")


def cache_dir() -> str:
    """``<temp dir>/airflow-sandbox-<effective uid>-cache``: where this worker user keeps its filter."""
    return os.path.join(tempfile.gettempdir(), f"airflow-sandbox-{os.geteuid()}-cache")


def _private(info: os.stat_result) -> bool:
    """Owned by this user, and writable by no one else."""
    return info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _usable_dir(*, create: bool) -> str | None:
    path = cache_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or not _private(info):
        log.debug("Not using %s for the system-call filter: not a directory of this user's alone", path)
        return None
    return path


def _file_name() -> str:
    with open(_RULES, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(os.uname().machine.encode())
    digest.update(f"{_FORMAT}".encode())
    return f"seccomp-{digest.hexdigest()[:24]}.json"


def _identity(path: str) -> list[Any] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return [path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]


def _builders() -> list[str]:
    """The files that built the filter in this process: the libseccomp library and the binding's module."""
    found = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libseccomp.so"):
                found.append(fields[5].strip())
                break
    for name in ("seccomp", "pyseccomp"):
        source = getattr(sys.modules.get(name), "__file__", None)
        if source:
            found.append(os.path.abspath(source))
            break
    return found


def load() -> tuple[bytes, tuple[str, ...], dict[str, int]] | None:
    """The kept filter (program, refused names, system call numbers), or None if there is none to trust."""
    directory = _usable_dir(create=False)
    if directory is None:
        return None
    try:
        fd = os.open(os.path.join(directory, _file_name()), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not _private(info) or info.st_size > _MAX_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            record = json.loads(f.read())
        if len(record["builders"]) != 2 or any(_identity(entry[0]) != entry for entry in record["builders"]):
            return None  # libseccomp or its binding changed since
        program = base64.b64decode(record["program"], validate=True)
        if not program or len(program) % 8:
            return None
        names = tuple(str(name) for name in record["names"])
        numbers = {str(name): int(number) for name, number in record["numbers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    finally:
        os.close(fd)
    return program, names, numbers


def store(program: bytes, names: tuple[str, ...], numbers: dict[str, int]) -> None:
    """Keep a filter built in this process for later ones; does nothing where that cannot be done safely."""
    try:
        builders = [_identity(path) for path in _builders()]
        if len(builders) != 2 or None in builders:
            return
        directory = _usable_dir(create=True)
        if directory is None:
            return
        record = {
            "builders": builders,
            "program": base64.b64encode(program).decode(),
            "names": list(names),
            "numbers": numbers,
        }
        target = os.path.join(directory, _file_name())
        partial = f"{target}.{os.getpid()}.{os.urandom(4).hex()}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(json.dumps(record).encode())
        finally:
            os.close(fd)
        os.replace(partial, target)
    except OSError as err:
        log.debug("Could not keep the system-call filter for later processes: %s", err)
