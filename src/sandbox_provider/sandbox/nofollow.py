"""
The worker's own directory trees, reached through directory descriptors and never through a
symbolic link.

A caller opens the top of a tree it chose (:func:`open_directory`: links on that path are followed,
because the caller named it). Everything below is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative
to its parent's descriptor (:class:`Descent`), made with ``mkdirat``, created with ``O_EXCL |
O_NOFOLLOW`` (:func:`create_file`) and moved with ``renameat`` (``os.mkdir``, ``os.open`` and
``os.rename`` with ``dir_fd``). So a link planted anywhere below, before or during the work, cannot
send a write, a move or a removal somewhere else: meeting one raises :class:`LinkInTheWay`.

:func:`remove_tree` removes iteratively, holding one directory open at a time: no recursion and no
path length limit, and names, modes and immutable or append-only flags set inside cannot stop it; a
link is removed, never followed, and the walk never leaves the file system it started on. The
export's sweeps and failed exports and the local backend's sandbox directories all go through it.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

__all__ = ["DIR_FLAGS", "Descent", "LinkInTheWay", "create_file", "open_directory", "remove_tree"]

#: How every directory below a chosen top is opened: a link there fails the open.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x00000010
_FS_APPEND_FL = 0x00000020


class LinkInTheWay(OSError):
    """A symbolic link where a directory or file was to be walked, made or replaced; ``filename`` is its relative path."""

    def __init__(self, relative: str) -> None:
        super().__init__(errno.ELOOP, "a symbolic link is in the way", relative)


def open_directory(path: str) -> int:
    """
    A descriptor of the existing directory ``path``, which the caller chose: links on the way to it,
    and at it, are followed. Close it when done.

    :raises OSError: when it is missing or not a directory.
    """
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_child(parent: int, name: str, relative: str, *, create: bool = False) -> int | None:
    """
    The directory ``name`` in ``parent``, opened without following a link; made first (mode 0777
    less the umask) when missing and ``create``; None when missing otherwise. ``relative`` is how
    errors name it.

    :raises LinkInTheWay: it is a symbolic link. :raises NotADirectoryError: it is something else.
    """
    for _ in range(3):  # a name removed or made by another process between two calls: look again
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=parent)
        except NotADirectoryError:
            try:
                kind = os.lstat(name, dir_fd=parent).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(kind):
                raise LinkInTheWay(relative) from None
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", relative) from None
    raise FileNotFoundError(errno.ENOENT, "it kept changing while it was opened", relative)


class Descent:
    """
    The directories of one path below ``root`` (an open directory), held open one per level, so that
    paths taken one after another reopen only where they part: taking them sorted opens each
    directory once. A context manager; :meth:`close` closes what it opened, and ``root`` too when it
    was handed over with ``own=True``.
    """

    def __init__(self, root: int, *, own: bool = False) -> None:
        self.root = root
        self._own = own
        self._names: list[str] = []
        self._fds: list[int] = []

    @property
    def fd(self) -> int:
        """The directory it is at."""
        return self._fds[-1] if self._fds else self.root

    def to(self, parts: Sequence[str], *, create: bool = False) -> int | None:
        """
        The directory ``root/parts[0]/parts[1]/...``: see :func:`open_child`. None when one is missing
        (and not ``create``); the descent then stays at the last one found.
        """
        keep = 0
        while keep < min(len(parts), len(self._names)) and self._names[keep] == parts[keep]:
            keep += 1
        while len(self._names) > keep:
            self._names.pop()
            os.close(self._fds.pop())
        for name in parts[keep:]:
            child = open_child(self.fd, name, "/".join([*self._names, name]), create=create)
            if child is None:
                return None
            self._names.append(name)
            self._fds.append(child)
        return self.fd

    def make(self, parts: Sequence[str]) -> int:
        """:meth:`to` with ``create``: the directory, made where missing."""
        found = self.to(parts, create=True)
        if found is None:  # open_child makes what is missing: only a name that keeps vanishing ends here
            raise FileNotFoundError(errno.ENOENT, "it could not be made", "/".join(parts))
        return found

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        self._names.clear()
        if self._own and self.root >= 0:
            os.close(self.root)
            self.root = -1

    def __enter__(self) -> Descent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_file(parent: int, name: str, mode: int = 0o666) -> IO[bytes]:
    """
    A new, empty file ``name`` in the directory ``parent``, opened for writing: never an existing
    file, and never through a link.

    :raises FileExistsError: when anything (a link included) has the name already.
    """
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    return os.fdopen(fd, "wb")


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
    try:  # by an O_PATH descriptor, which needs no permission on it and is never a link
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    """Unlink everything but directories; note the directories as pending (each is emptied, then removed)."""
    with os.scandir(fd) as entries:
        listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in listed:
        if not is_dir:
            _unlink(fd, name)
    level.pending = [name for name, is_dir in listed if is_dir]


def _enter(fd: int, name: str, dev: int) -> tuple[int, tuple[int, int]]:
    _unlock_dir(fd, name)
    child = os.open(name, DIR_FLAGS, dir_fd=fd)
    info = os.fstat(child)
    if info.st_dev != dev:
        os.close(child)
        raise OSError(errno.EXDEV, f"refusing to remove a mount point inside the tree: {name!r}")
    return child, (info.st_dev, info.st_ino)


def _leave(fd: int, expected: tuple[int, int]) -> int:
    parent = os.open("..", DIR_FLAGS, dir_fd=fd)
    info = os.fstat(parent)
    if (info.st_dev, info.st_ino) != expected:
        os.close(parent)
        raise OSError(errno.ESTALE, "the tree changed while it was being removed")
    return parent


def remove_tree(path: str) -> None:
    """
    Remove ``path`` (a file, a link, or a directory and everything below it), iteratively, holding
    one directory open at a time. Links on the way to ``path`` are followed (the caller named it);
    ``path`` itself and everything below are never followed. Missing is fine.

    :raises OSError: for what cannot be removed even so (a mount point inside the tree, say).
    """
    try:
        parent_fd = open_directory(os.path.dirname(os.path.abspath(path)))
    except FileNotFoundError:
        return
    top = os.path.basename(os.path.abspath(path))
    try:
        try:
            info = os.lstat(top, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            _unlink(parent_fd, top)
            return
        try:
            os.rmdir(top, dir_fd=parent_fd)  # the common case: empty already
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EPERM, errno.EACCES, errno.EBUSY):
                raise
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
