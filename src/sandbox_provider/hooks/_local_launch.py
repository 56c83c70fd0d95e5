"""
Starting one bubblewrap command for the local backend, with what has to be in place before the
sandboxed program runs its first instruction:

- a fresh, empty session keyring of its own: ``bwrap`` starts under keyutils' ``keyctl session -``,
  which joins a new anonymous session keyring and then runs it (the keyrings of the worker are
  out of reach, and the filter refuses the keyring calls on top);
- the system-call filter, handed to ``bwrap --seccomp`` as a descriptor;
- ``spec.env`` handed over through ``bwrap --args`` as a descriptor, so no value appears in any
  process's command line;
- the sandbox's cgroup: ``bwrap --block-fd`` holds the sandbox's first process after its
  namespaces are built and before it runs anything; the worker reads that process's pid from the
  JSON status, puts it into the cgroup, then lets it go. Everything the command starts stays in it;
- resource limits, set by util-linux's ``prlimit`` on itself before it runs ``bwrap`` (setting
  another process's limits would need ``CAP_SYS_RESOURCE``, which a root worker may not hold).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from sandbox_provider.hooks._local_seccomp import seccomp_fd

__all__ = ["RLIMITS", "Started", "env_args", "read_status_docs", "rlimit_argv", "start"]

#: Limit names the launcher understands -> the ``prlimit`` option that sets that kernel resource limit.
RLIMITS = {
    "cpu_seconds": "--cpu",  # RLIMIT_CPU, seconds of CPU per process
    "max_processes": "--nproc",  # RLIMIT_NPROC, processes of the user
    "max_file_bytes": "--fsize",  # RLIMIT_FSIZE, bytes per file written
    "address_space_bytes": "--as",  # RLIMIT_AS, bytes of address space per process
}
_KEYCTL_NOTE = b"Joined session keyring:"


def env_args(env: Mapping[str, str]) -> bytes:
    """``--setenv NAME VALUE`` for each entry, NUL-separated, as ``bwrap --args`` reads them."""
    parts: list[bytes] = []
    for key, value in env.items():
        parts += [b"--setenv", key.encode(), value.encode()]
    return b"".join(part + b"\0" for part in parts)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Started:
    """
    A running command: ``proc`` (its stderr pipe already past keyctl's note), ``status_fd`` (the
    rest of bwrap's JSON status, read by the caller), ``status`` (the documents read so far), and
    ``stderr_head`` (stderr bytes read while starting, to be handed on before the rest).
    """

    proc: subprocess.Popen
    status_fd: int
    status: dict[str, Any] = field(default_factory=dict)
    stderr_head: bytes = b""


def read_status_docs(data: bytes) -> dict[str, Any]:
    """Merge the JSON documents of bwrap's status (one a line: ``child-pid``, ``exit-code``...)."""
    status: dict[str, Any] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                status.update(doc)
    return status


def _first_status(fd: int) -> tuple[dict[str, Any], bytes]:
    """Read bwrap's status until its first whole line (the child's pid) or the end; return it and the rest."""
    data = b""
    while b"\n" not in data:
        piece = os.read(fd, 4096)
        if not piece:
            break
        data += piece
    line, _, rest = data.partition(b"\n")
    return read_status_docs(line), rest


def _skip_keyctl_note(stderr: IO[bytes]) -> bytes:
    """
    Read keyctl's one line off the top of stderr ("Joined session keyring: N", written before it
    ran bwrap, so whole by the time bwrap reports its child) and return whatever followed it.
    """
    fd = stderr.fileno()
    os.set_blocking(fd, False)
    data = b""
    try:
        while b"\n" not in data:
            piece = os.read(fd, 4096)
            if not piece:
                break
            data += piece
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    if data.startswith(_KEYCTL_NOTE) and b"\n" in data:
        return data.partition(b"\n")[2]
    return data


def rlimit_argv(prlimit: str, limits: Mapping[str, int]) -> list[str]:
    """``prlimit`` with hard and soft limits for ``limits`` (names of :data:`RLIMITS`), or [] for none."""
    if not limits:
        return []
    return [prlimit, *(f"{RLIMITS[name]}={value}:{value}" for name, value in limits.items()), "--"]


def start(
    keyctl: str,
    prlimit: str,
    bwrap_argv: Sequence[str],
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    rlimits: Mapping[str, int],
    join_cgroup: Callable[[int], None] | None,
    popen_kwargs: Mapping[str, Any],
) -> Started:
    """
    Start ``bwrap_argv`` (``bwrap`` and its options, no ``--``) running ``command`` under a new
    session keyring, under ``rlimits`` (names of :data:`RLIMITS` -> value, set with ``prlimit``),
    with the seccomp filter and ``env`` through descriptors, and, before the command runs, the
    sandbox's first process put into its cgroup (``join_cgroup(pid)``).

    ``popen_kwargs`` go to :class:`subprocess.Popen` (stdin, stdout, user, group...); stderr is
    always a pipe. If bwrap fails before its child exists, the caller sees that from the status
    (no ``child-pid``) and from stderr.

    :raises OSError: if the process cannot be started (the descriptors are closed).
    """
    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe()
    filter_fd = seccomp_fd()
    args_fd = _memfd("sandbox-env", env_args(env))
    inner = [str(bwrap_argv[0]), "--seccomp", str(filter_fd), "--args", str(args_fd)]
    inner += ["--block-fd", str(block_r), "--json-status-fd", str(status_w), *bwrap_argv[1:], "--", *command]
    try:
        proc = subprocess.Popen(
            [keyctl, "session", "-", *rlimit_argv(prlimit, rlimits), *inner],
            stderr=subprocess.PIPE,
            pass_fds=(status_w, block_r, filter_fd, args_fd),
            start_new_session=True,
            **popen_kwargs,
        )
    except BaseException:
        os.close(status_r)
        os.close(block_w)
        raise
    finally:
        for fd in (status_w, block_r, filter_fd, args_fd):
            os.close(fd)
    try:
        status, rest = _first_status(status_r)
        head = _skip_keyctl_note(proc.stderr)
        child = status.get("child-pid")
        if isinstance(child, int) and join_cgroup is not None:
            join_cgroup(child)
        with contextlib.suppress(BrokenPipeError):  # bwrap already failed: the caller reads why
            os.write(block_w, b"x")
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        os.close(status_r)
        raise
    finally:
        os.close(block_w)
    started = Started(proc, status_r, status, head)
    if rest:
        started.status.update(read_status_docs(rest))
    return started
