"""
Crash-safe sandbox directories for the local backend.

Layout under the state root (``<handle>`` is ``airflow-sandbox-<12 hex>``)::

    <handle>/                 the sandbox: stamps, spec.env, run markers (the worker's, 0600)
    <handle>/box/             the sandbox's own files (its user's, 0700; a size-limited tmpfs
                              when the sandbox has a disk budget)
    <handle>/box/workspace/   the workdir
    <handle>/box/tmp/         its /tmp
    .creating-<handle>/       a create in progress, or one a crash interrupted
    .destroyed-<handle>/      a destroy in progress, or one a crash interrupted

A sandbox is built under its ``.creating-`` name and renamed into place with its stamps written, so
no sandbox ever exists without them. A destroy first renames it to its ``.destroyed-`` name (from
then on it is gone for every caller), and removes the workspace last. Whoever works on a
``.creating-`` or ``.destroyed-`` directory holds an ``flock`` on it; a sweep takes over any such
directory whose lock is free, because its worker died. Removal walks the tree iteratively through
directory descriptors: no recursion, no path length limit, and names, modes and immutable or
append-only flags set inside cannot stop it; it never leaves the file system it started on.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

from sandbox_provider.sandbox.spec import is_named_sandbox

__all__ = [
    "BOX",
    "CREATING",
    "DESTROYED",
    "SweepReport",
    "box_path",
    "building",
    "claim",
    "classify",
    "mark_destroyed",
    "mount_box",
    "remove_sandbox_dir",
    "remove_tree",
]

CREATING = ".creating-"
DESTROYED = ".destroyed-"
BOX = "box"
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x00000010
_FS_APPEND_FL = 0x00000020
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class SweepReport:
    """What a sweep did: ``removed`` handles, and ``failed``: handle -> why it could not be removed."""

    removed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def box_path(sandbox_dir: str) -> str:
    """The directory holding the sandbox's own files (workspace and tmp)."""
    return os.path.join(sandbox_dir, BOX)


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
    fd = os.open(staging, _DIR_FLAGS)
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


@contextlib.contextmanager
def claim(path: str, *, wait: bool) -> Iterator[bool]:
    """
    Hold the lock of a ``.creating-`` or ``.destroyed-`` directory; yield whether it was had.

    With ``wait=False`` a lock someone holds yields False at once (a live worker is on it).
    A directory that is gone yields False too.
    """
    try:
        fd = os.open(path, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield os.path.isdir(path)  # the holder before us may have removed it
    finally:
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


def mount_box(box: str, *, size_bytes: int, uid: int, gid: int) -> None:
    """
    Mount a tmpfs of ``size_bytes`` on ``box``, owned by ``uid``/``gid``, mode 0700 (a root worker only).

    :raises OSError: if ``mount`` fails (its message is in the error).
    """
    options = f"size={size_bytes},mode=0700,uid={uid},gid={gid},nodev,nosuid"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "airflow-sandbox", box],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise OSError(errno.EIO, f"mount of a {size_bytes}-byte tmpfs failed: {done.stderr.strip()}")


def _unmount(path: str) -> None:
    if not os.path.ismount(path):
        return
    done = subprocess.run(["umount", path], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 and os.path.ismount(path):
        # Busy (a process we could not kill holds it): detach it; the kernel frees it when released.
        lazy = subprocess.run(["umount", "-l", path], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if lazy.returncode != 0:
            raise OSError(errno.EBUSY, f"cannot unmount {path}: {lazy.stderr.strip() or done.stderr.strip()}")


def remove_sandbox_dir(path: str) -> None:
    """
    Remove a sandbox directory: the worker's files first, then the box (workspace) last, then the
    directory. The caller has killed its processes. Idempotent.
    """
    if not os.path.lexists(path):
        return
    box = box_path(path)
    for name in os.listdir(path):
        if name != BOX:
            remove_tree(os.path.join(path, name))
    _unmount(box)
    remove_tree(box)
    remove_tree(path)


# -- iterative removal -----------------------------------------------------------------------------


def _clear_flags(parent_fd: int, name: str) -> None:
    """Clear the immutable and append-only flags of ``name`` (no-op where unsupported)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        if flags[0] & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            flags[0] &= ~(_FS_IMMUTABLE_FL | _FS_APPEND_FL)
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlock_dir(parent_fd: int, name: str) -> None:
    """Make directory ``name`` removable and enterable by the worker: flags cleared, mode 0700."""
    _clear_flags(parent_fd, name)
    with contextlib.suppress(OSError):
        os.chmod(name, 0o700, dir_fd=parent_fd)


def _unlink(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except PermissionError:
        _clear_flags(fd, name)
        os.unlink(name, dir_fd=fd)


@dataclass
class _Level:
    name: str  # this directory's name in its parent
    ident: tuple[int, int]  # (st_dev, st_ino) of the directory, to check the way back up
    pending: list[str] | None = None  # subdirectories still to empty; None until listed


def _empty_files(fd: int, level: _Level) -> None:
    """Unlink everything but directories; remove empty directories; note the others as pending."""
    pending = []
    with os.scandir(fd) as entries:
        listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in listed:
        if not is_dir:
            _unlink(fd, name)
            continue
        try:
            os.rmdir(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EPERM, errno.EACCES, errno.EBUSY):
                raise
            pending.append(name)
    level.pending = pending


def _enter(fd: int, name: str, dev: int) -> tuple[int, tuple[int, int]]:
    _unlock_dir(fd, name)
    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    info = os.fstat(child)
    if info.st_dev != dev:
        os.close(child)
        raise OSError(errno.EXDEV, f"refusing to remove a mount point inside the tree: {name!r}")
    return child, (info.st_dev, info.st_ino)


def _leave(fd: int, expected: tuple[int, int]) -> int:
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    info = os.fstat(parent)
    if (info.st_dev, info.st_ino) != expected:
        os.close(parent)
        raise OSError(errno.ESTALE, "the tree changed while it was being removed")
    return parent


def remove_tree(path: str) -> None:
    """
    Remove ``path`` and everything below it, iteratively, holding one directory open at a time.

    A symlink is removed, never followed; the walk does not cross into another file system.
    Missing is fine.

    :raises OSError: for what cannot be removed even so (a mount point inside the tree, say).
    """
    parent_fd = os.open(os.path.dirname(os.path.abspath(path)), _DIR_FLAGS)
    top = os.path.basename(os.path.abspath(path))
    try:
        try:
            info = os.lstat(top, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            _unlink(parent_fd, top)
            return
        _walk_and_remove(parent_fd, top, info.st_dev)
    finally:
        os.close(parent_fd)


def _walk_and_remove(parent_fd: int, top: str, dev: int) -> None:
    parent_info = os.fstat(parent_fd)
    fd, ident = _enter(parent_fd, top, dev)
    levels = [_Level(top, ident)]
    parents = [(parent_info.st_dev, parent_info.st_ino)]
    try:
        while levels:
            level = levels[-1]
            if level.pending is None:
                _empty_files(fd, level)
            if level.pending:
                name = level.pending.pop()
                child, ident = _enter(fd, name, dev)
                os.close(fd)
                fd = child
                parents.append(level.ident)
                levels.append(_Level(name, ident))
                continue
            # This directory is empty: go up and remove it.
            levels.pop()
            up = _leave(fd, parents.pop())
            os.close(fd)
            fd = up
            try:
                os.rmdir(level.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except PermissionError:
                _clear_flags(fd, level.name)
                os.rmdir(level.name, dir_fd=fd)
            except OSError as err:
                if err.errno != errno.ENOTEMPTY or not levels:
                    raise
                levels[-1].pending = None  # something appeared in it: list the parent again
    finally:
        os.close(fd)
