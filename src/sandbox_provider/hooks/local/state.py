"""
Crash-safe sandbox directories for the local backend.

Layout under the state root (``<handle>`` is ``airflow-sandbox-<12 hex>``)::

    <handle>/                 the sandbox: its user's, 0700 (no other sandbox's user, and no host
                              user but root, can enter it)
    <handle>/sandbox.json     the worker's record: stamps, spec.env, limits (root's, 0600)
    <handle>/workspace/       the workdir (the sandbox's user's, 0700)
    <handle>/tmp/             its /tmp (likewise)
    <handle>/box/             instead, with a disk budget: a tmpfs of that size holding
                              workspace/ and tmp/
    .creating-<handle>/       a create in progress, or one a crash interrupted
    .destroyed-<handle>/      a destroy in progress, or one a crash interrupted

The sandbox's processes never see this directory: only its workspace and tmp are mounted into
their namespace. A sandbox is built under its ``.creating-`` name and renamed into place with its
record written, so no sandbox ever exists without its stamps. A destroy first renames it to its ``.destroyed-`` name (from
then on it is gone for every caller), and removes the workspace last. Whoever works on a
``.creating-`` or ``.destroyed-`` directory holds an ``flock`` on it; a sweep takes over any such
directory whose lock is free, because its worker died. Removal is
:func:`~sandbox_provider.sandbox.nofollow.remove_tree`: iterative, through directory descriptors, never
following a link or leaving the file system it started on.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox_provider.sandbox.attach import expiry_of
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.nofollow import DIR_FLAGS, remove_tree
from sandbox_provider.sandbox.spec import is_named_sandbox

__all__ = [
    "BOX",
    "CREATING",
    "DESTROYED",
    "RECORD",
    "SweepReport",
    "abandoned",
    "box_path",
    "building",
    "check_reachable",
    "checked_root",
    "claim",
    "classify",
    "expired",
    "mark_destroyed",
    "mount_box",
    "read_record",
    "recorded_uid",
    "remove_sandbox_dir",
    "remove_tree",
    "settled",
    "write_record",
]

CREATING = ".creating-"
DESTROYED = ".destroyed-"
BOX = "box"
#: The worker's record of a sandbox: ``stamps`` (strings), ``env`` (spec.env, handed to each
#: command through a descriptor) and ``limits`` (what it was created with).
RECORD = "sandbox.json"
#: The stamp recording the host user id a sandbox runs as.
UID_TAG = "airflow_sandbox_uid"
_STAMPLESS_GRACE = 600.0  # seconds before a sandbox directory without a record (an older layout) is swept
_NEVER = 4102444800.0  # 2100-01-01, the record's time for a sandbox without an expiry
#: Seconds an unlocked ``.creating-`` directory is left alone: its creator may not have locked it yet.
CREATING_GRACE = 5.0


@dataclass
class SweepReport:
    """What a sweep did: ``removed`` handles, and ``failed``: handle -> why it could not be removed."""

    removed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def box_path(sandbox_dir: str, limits: Mapping[str, Any] | None = None) -> str:
    """The directory holding the sandbox's workspace and tmp: the sandbox's own, or its box with a disk budget."""
    return os.path.join(sandbox_dir, BOX) if limits and limits.get("disk_bytes") else sandbox_dir


def read_record(path: str) -> dict[str, Any]:
    """
    The record of the sandbox directory ``path``: ``stamps``, ``env`` and ``limits``, and
    ``created_at`` (Unix seconds, by the worker's clock) where the record has it.

    :raises SandboxTerminalError: if it cannot be read.
    """
    try:
        with open(os.path.join(path, RECORD), encoding="utf-8") as f:
            record = json.load(f)
        found: dict[str, Any] = {key: dict(record[key]) for key in ("stamps", "env", "limits")}
        if isinstance(record.get("created_at"), (int, float)):
            found["created_at"] = float(record["created_at"])
        return found
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SandboxTerminalError(f"Sandbox {os.path.basename(path)} has no readable record: {err}") from err


def write_record(path: str, record: dict[str, Any], *, fresh: bool = False) -> None:
    """
    Replace the record of the sandbox directory ``path`` atomically (a rename), readable by the
    worker only. Its modification time is set to the sandbox's expiry (far ahead without one), so
    a sweep tells an expired sandbox by one ``stat``.

    :param fresh: the directory is a ``.creating-`` one that has no record yet: the record is written
        in place (no reader looks there until :func:`building` renames the whole directory into place).
    """
    target = os.path.join(path, RECORD)
    tmp = target if fresh else f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if fresh else os.O_TRUNC)
    fd = os.open(tmp, flags, 0o600)
    expires = expiry_of(record.get("stamps") or {})
    stamp = _NEVER if expires is None else expires
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record))  # dumps, not dump: the C encoder, one write
        f.flush()
        os.utime(f.fileno(), (stamp, stamp))
    if not fresh:
        os.replace(tmp, target)


def checked_root(root: str, mode: int, *, create: bool = False) -> str:
    """
    ``root`` if it is a directory of this user (made with ``mode`` when ``create``; its mode set to it).

    :raises SandboxTerminalError: if it cannot be used, saying to pass another ``state_root``.
    """
    try:
        try:
            info = os.lstat(root)
        except FileNotFoundError:
            if not create:
                return root
            os.makedirs(root, mode=mode, exist_ok=True)
            info = os.lstat(root)
    except OSError as err:
        raise SandboxTerminalError(
            f"The sandbox state directory {root!r} cannot be used ({err.strerror}); pass another state_root "
            "to LocalSandboxHook or its connection."
        ) from err
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise SandboxTerminalError(
            f"The sandbox state directory {root!r} is not a directory owned by this user; pass another "
            "state_root to LocalSandboxHook."
        )
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(root, mode)
    return root


def check_reachable(root: str) -> None:
    """
    A root worker's sandboxes run as users of their own, who must be able to pass through every
    directory above their own. :raises SandboxTerminalError: naming the one they cannot.
    """
    here = os.path.abspath(root)
    while True:
        if not os.stat(here).st_mode & stat.S_IXOTH:
            raise SandboxTerminalError(
                f"The worker runs as root, so its sandboxes run as users of their own, who cannot reach the "
                f"state directory {root!r}: {here!r} is not searchable by other users. Pass a state_root whose "
                "parent directories are (e.g. under /tmp or /var/lib), or chmod o+x that directory."
            )
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


# -- create and destroy ----------------------------------------------------------------------------


@contextlib.contextmanager
def building(root: str, handle: str, mode: int) -> Iterator[str]:
    """
    Build a sandbox directory under its ``.creating-`` name, locked; yield that path.

    When the block finishes, the directory is renamed to ``<root>/<handle>``; if it raises, what
    was built is removed (a crash leaves the locked-then-free directory for the next sweep).
    """
    staging = os.path.join(root, CREATING + handle)
    os.mkdir(staging, mode)
    fd = os.open(staging, DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield staging
            os.rename(staging, os.path.join(root, handle))
        except BaseException:
            remove_sandbox_dir(staging)
            raise
    finally:
        os.close(fd)


def mark_destroyed(root: str, handle: str) -> str | None:
    """Rename the sandbox to its ``.destroyed-`` name and return that path; None if it is already gone."""
    trash = os.path.join(root, DESTROYED + handle)
    try:
        os.rename(os.path.join(root, handle), trash)
    except FileNotFoundError:
        return trash if os.path.isdir(trash) else None
    return trash


def lock(path: str, *, wait: bool) -> int | None:
    """
    Take the lock of a ``.creating-`` or ``.destroyed-`` directory: its descriptor, which holds the
    lock until the caller closes it (or the process ends). None when the directory is gone, or
    with ``wait=False`` when someone holds the lock (a live worker is on it).
    """
    try:
        fd = os.open(path, DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    if not os.path.isdir(path):  # the holder before us removed it
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def claim(path: str, *, wait: bool) -> Iterator[bool]:
    """Hold the lock of a ``.creating-`` or ``.destroyed-`` directory (see :func:`lock`); yield whether it was had."""
    fd = lock(path, wait=wait)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def classify(root: str) -> Iterator[tuple[str, str, str]]:
    """Yield ``(kind, handle, path)`` for each entry of the state root: kind is sandbox/creating/destroyed."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in sorted(names):
        for kind, prefix in (("creating", CREATING), ("destroyed", DESTROYED), ("sandbox", "")):
            handle = name[len(prefix) :]
            if name.startswith(prefix) and is_named_sandbox(handle):
                yield kind, handle, os.path.join(root, name)
                break


def recorded_uid(path: str) -> int | None:
    """The user id in a sandbox directory's record, or None without one (an interrupted create)."""
    try:
        return int(read_record(path)["stamps"][UID_TAG])
    except (SandboxTerminalError, KeyError, ValueError):
        return None


def expired(path: str, now: float) -> bool:
    """Whether the sandbox at ``path`` is past its lifetime; one without a record (an older layout) after a grace."""
    try:
        return os.stat(os.path.join(path, RECORD)).st_mtime <= now
    except FileNotFoundError:
        pass
    try:
        return os.lstat(path).st_mtime + _STAMPLESS_GRACE <= now
    except FileNotFoundError:
        return False


def settled(path: str, now: float) -> bool:
    """Whether the ``.creating-`` directory at ``path`` is older than :data:`CREATING_GRACE`."""
    try:
        return os.lstat(path).st_mtime + CREATING_GRACE <= now
    except FileNotFoundError:
        return False


def abandoned(owner: str) -> bool:
    """Whether no directory of the sandbox at ``owner`` (live, being made, being destroyed) exists."""
    root, handle = os.path.split(owner)
    names = (handle, CREATING + handle, DESTROYED + handle)
    return not any(os.path.lexists(os.path.join(root, name)) for name in names)


_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MNT_DETACH = 0x2


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def mount_box(box: str, *, size_bytes: int, uid: int, gid: int) -> None:
    """
    Mount a tmpfs of ``size_bytes`` on ``box``, owned by ``uid``/``gid``, mode 0700 (a root worker only).

    Through the C library's ``mount`` in this process, so a worker killed meanwhile leaves no
    helper behind to mount after the sweep has run.

    :raises OSError: if the kernel refuses.
    """
    options = f"size={int(size_bytes)},mode=0700,uid={int(uid)},gid={int(gid)}".encode()
    libc = _libc()
    if libc.mount(b"airflow-sandbox", os.fsencode(box), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting a {size_bytes}-byte tmpfs for the sandbox failed: {os.strerror(err)}", box)


def _unmount(path: str) -> None:
    if not os.path.ismount(path):
        return
    libc = _libc()
    if libc.umount2(os.fsencode(path), 0) == 0:
        return
    # Busy (a process we could not kill holds it): detach it; the kernel frees it when released.
    if libc.umount2(os.fsencode(path), _MNT_DETACH) != 0 and os.path.ismount(path):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot unmount the sandbox's box: {os.strerror(err)}", path)


def remove_sandbox_dir(path: str) -> None:
    """
    Remove a sandbox directory: the worker's files and the sandbox's /tmp first, the workspace
    (or the box holding it) last, then the directory. The caller has killed its processes. Idempotent.
    """
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for name in names:
        if name not in (BOX, "workspace"):
            remove_tree(os.path.join(path, name))
    if BOX in names:  # a sandbox with a disk budget keeps its workspace in it
        box = os.path.join(path, BOX)
        _unmount(box)
        remove_tree(box)
    remove_tree(os.path.join(path, "workspace"))
    remove_tree(path)


def default_state_root() -> str:
    """
    ``<tmp>/airflow-sandbox-<uid>-<instance>``: the state root when none is set, one per user and Airflow
    instance on the host. ``<instance>`` is 10 hex digits of a hash of the resolved ``AIRFLOW_HOME``
    (``~/airflow`` when unset). It stays in the temporary directory rather than under ``AIRFLOW_HOME``,
    because a root worker's sandboxes run as other users, who must be able to pass through every
    directory above it.
    """
    home = os.path.realpath(os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow"))
    instance = hashlib.sha256(home.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), f"airflow-sandbox-{os.getuid()}-{instance}")
