"""
Where an export batch's files go: ``.partial`` copies beside each destination, published only once
every copy succeeded, removed when any failed.

A file export goes to ``<name>.airflow-<key>-<try>.partial`` beside its destination and is moved
over it (on local storage a rename, which replaces a link at the destination's name rather than
follow it; a directory there is refused). A directory export (a tree, a glob's matches) goes into a
``.partial`` directory named the same way beside the destination directory; when all copies
succeeded:

- on local storage, a destination directory that does not exist yet is the partial directory
  renamed: every file appears at once;
- otherwise (it exists, or object storage) each file is moved into place after all were copied: for
  that short window a reader may see some new files and not yet others, but never half a file, and
  other files already in the destination stay. A failed copy changes no destination.

Below an existing local destination nothing is reached by path: each directory is opened through
its parent's descriptor without following a link, made with ``mkdirat`` and each file moved with
``renameat`` (:mod:`~sandbox_provider.sandbox.nofollow`). Whoever can write into the destination
could have planted a link there (``DEST/sub -> /etc``), so a link met below it, at any depth or at a
file's own name, fails the export: :func:`check` looks at every entry of the batch before the first
file moves, and one planted after that still stops the move rather than redirect it. The
``.partial`` copies are made the same way (``O_EXCL | O_NOFOLLOW``), and removed iteratively without
following links (:func:`~sandbox_provider.sandbox.nofollow.remove_tree`).

A directory export that finds no file (an empty directory, a glob matching nothing) leaves an empty
destination directory on local storage, and nothing on object storage.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from sandbox_provider.engine.storage import is_local
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.nofollow import (
    DIR_FLAGS,
    Descent,
    LinkInTheWay,
    create_file,
    open_directory,
    remove_tree,
)

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

log = logging.getLogger(__name__)

__all__ = ["PartialSink", "Staged", "check", "publish", "remove_partial"]


@dataclass
class Staged:
    """One export entry: its destination, its ``.partial`` (file or directory), what was copied there."""

    path: str
    url: str
    target: ObjectStoragePath
    partial: ObjectStoragePath
    directory: bool
    files: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(self.files.values())


def remove_partial(partial: ObjectStoragePath) -> bool:
    """Remove a ``.partial`` file or directory (iteratively, never through a link); True when nothing of it is left."""
    try:
        if is_local(partial):
            remove_tree(partial.path)
        elif partial.exists():
            partial.fs.rm(partial.path, recursive=partial.is_dir())
        return True
    except FileNotFoundError:
        return True
    except Exception:
        log.warning("Could not remove %s after a failed export", partial, exc_info=True)
        return False


def _new_file(path: str) -> IO[bytes]:
    """A local ``.partial`` file made new, never through a link put at its name."""
    flags = os.O_EXCL | os.O_NOFOLLOW
    return open(path, "wb", opener=lambda name, mode: os.open(name, mode | flags, 0o666))  # noqa: SIM115


class PartialSink:
    """The :class:`~sandbox_provider.sandbox.batch.ExportSink` writing ``staged`` entries' partial copies."""

    def __init__(self, staged: Sequence[Staged]) -> None:
        self.staged = list(staged)
        # (index, name, stream, and for a local directory's file: its directory and base name)
        self._open: tuple[int, str, IO[bytes], int | None, str] | None = None
        self._trees: dict[int, Descent] = {}

    def begin(self, index: int, name: str) -> IO[bytes]:
        self._drop_open()
        entry = self.staged[index]
        where: int | None = None
        base = name
        try:
            if not entry.directory:
                stream = _new_file(entry.partial.path) if is_local(entry.partial) else _open_new(entry.partial)
            elif is_local(entry.partial):
                *parents, base = name.split("/")
                where = self._tree(index).make(parents)
                stream = create_file(where, base)
            else:
                stream = _open_new(entry.partial / name)
        except FileExistsError as err:
            raise SandboxError(
                f"The export found something already at {entry.partial}/{name}; it writes new files only."
            ) from err
        self._open = (index, name, stream, where, base)
        return stream

    def _tree(self, index: int) -> Descent:
        """The descent into ``index``'s ``.partial`` directory, made new on the first file."""
        descent = self._trees.get(index)
        if descent is None:
            path = self.staged[index].partial.path
            os.mkdir(path, 0o777)  # new: an earlier try's was swept; anything else there is refused
            descent = self._trees[index] = Descent(os.open(path, DIR_FLAGS), own=True)
        return descent

    def local_directory(self, index: int) -> str | None:
        """Request ``index``'s ``.partial`` directory, for a backend to make and fill itself; None unless local and new."""
        entry = self.staged[index]
        if not entry.directory or not is_local(entry.partial) or os.path.lexists(entry.partial.path):
            return None
        return entry.partial.path

    def adopt(self, index: int, files: dict[str, int]) -> None:
        """Record the ``{name: size}`` a backend wrote (and checked) in :meth:`local_directory` ``(index)``."""
        self.staged[index].files.update(files)

    def end(self, index: int, name: str, size: int) -> None:
        if self._open is None or self._open[:2] != (index, name):
            raise SandboxError(f"The export ended {name!r}, which it had not begun.")
        self._open[2].close()
        self._open = None
        self.staged[index].files[name] = size

    def _drop_open(self) -> None:
        if self._open is None:
            return
        index, name, stream, where, base = self._open
        self._open = None
        stream.close()
        entry = self.staged[index]
        if where is not None:
            try:
                os.unlink(base, dir_fd=where)
            except OSError:
                log.debug("Could not remove the unfinished %s/%s", entry.partial, name, exc_info=True)
        elif entry.directory:
            remove_partial(entry.partial / name)

    def close(self) -> None:
        """Close what is open (a file begun and not ended is removed); the ``.partial`` copies stay."""
        self._drop_open()
        for descent in self._trees.values():
            descent.close()
        self._trees.clear()


def _by_directory(names: Iterable[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """``names`` (relative, ``/``-separated) as ``[(directory parts, [base names])]``, sorted: each directory once."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        *parents, base = name.split("/")
        groups.setdefault(tuple(parents), []).append(base)
    return sorted(groups.items())


def _moves_into(entry: Staged) -> str | None:
    """The local destination directory ``entry``'s files move into one by one (it exists); else None."""
    if not entry.directory or not is_local(entry.target):
        return None
    target = entry.target.path.rstrip("/")
    if not os.path.lexists(entry.partial.path) or not os.path.lexists(target):
        return None
    return target


def _refusal(entry: Staged, target: str, err: OSError) -> SandboxTerminalError:
    """The error for meeting ``err`` below ``target``: a link, or a file where a directory goes (or back)."""
    where = f"{target}/{err.filename}"
    lead = f"Cannot export {entry.path!r} into {entry.url}:"
    if isinstance(err, LinkInTheWay):
        return SandboxTerminalError(
            f"{lead} {where} is a symbolic link, and an export never writes through a link below its destination "
            "(one planted there could lead anywhere the worker can write). Remove the link, or export to a directory "
            "only this task writes."
        )
    if isinstance(err, IsADirectoryError):
        return SandboxTerminalError(f"{lead} {where} is a directory, where the export has a file of that name.")
    return SandboxTerminalError(f"{lead} {where} is not a directory, where the export has files below that name.")


def check(entry: Staged) -> None:
    """
    Refuse, before any file of the batch moves, a local directory export into an existing destination
    that would meet a symbolic link below it (a directory on a file's way, or a file's own name), or a
    directory at a file's name. Reads only.

    :raises SandboxTerminalError: naming the link (or directory) and what to change.
    """
    if not entry.directory and is_local(entry.target):
        _check_file_target(entry)
        return
    target = _moves_into(entry)
    if target is None:
        return
    root = open_directory(target)
    try:
        with Descent(root) as dest:
            for parts, names in _by_directory(entry.files):
                here = dest.to(parts)
                if here is None:  # missing: made new when publishing, so nothing below it can be in the way
                    continue
                for name in names:
                    _check_name(here, name, "/".join([*parts, name]))
    except (LinkInTheWay, NotADirectoryError, IsADirectoryError) as err:
        raise _refusal(entry, target, err) from err
    finally:
        os.close(root)


def _check_file_target(entry: Staged) -> None:
    """Refuse a local file export whose destination is a directory (a link there is replaced, not followed)."""
    try:
        mode = os.lstat(entry.target.path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise SandboxTerminalError(
            f"Cannot export {entry.path!r} into {entry.url}: a directory is there, and a file export writes a file "
            "of that name. End the URL with '/' to export into the directory, or name a file."
        )


def _check_name(directory: int, name: str, relative: str) -> None:
    try:
        mode = os.lstat(name, dir_fd=directory).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise LinkInTheWay(relative)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(relative)


def _open_new(path: ObjectStoragePath) -> IO[bytes]:
    """
    ``path`` opened for writing on its store's filesystem. (Not through ``ObjectStoragePath.open`` or
    ``.move``, which report each file to Airflow's hook lineage: a ``.partial`` copy is not what the job
    wrote, and the session reports that itself, once, see :mod:`~sandbox_provider.engine.lineage`.)
    """
    return path.fs.open(path.path, "wb")


def _move(source: ObjectStoragePath, target: ObjectStoragePath) -> None:
    """Move ``source`` to ``target`` on their one store, unreported (see :func:`_open_new`)."""
    source.fs.mv(source.path, target.path)


def publish(entry: Staged) -> None:
    """Move ``entry``'s partial copy (file or directory) into place; see the module (:func:`check` it first)."""
    if not entry.directory:
        if is_local(entry.target):
            # rename(2) replaces whatever has the name, a link included, and never follows it; the
            # store's move (shutil.move) put the file inside the directory a link there led to.
            os.replace(entry.partial.path, entry.target.path)
        else:
            _move(entry.partial, entry.target)
        return
    if not is_local(entry.target):
        for name in entry.files:
            _move(entry.partial / name, entry.target / name)
        remove_partial(entry.partial)
        return
    target = entry.target.path.rstrip("/")
    if not os.path.lexists(entry.partial.path):  # nothing matched, or an empty directory: an empty one
        os.makedirs(target, exist_ok=True)
        return
    if not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(entry.partial.path, target)
        return
    try:
        _move_each(entry, target)
    except (LinkInTheWay, NotADirectoryError, IsADirectoryError) as err:
        raise _refusal(entry, target, err) from err
    remove_partial(entry.partial)


def _move_each(entry: Staged, target: str) -> None:
    """Every file of ``entry`` renamed from its ``.partial`` directory into ``target``, directory by directory."""
    with (
        Descent(open_directory(target), own=True) as dest,
        Descent(os.open(entry.partial.path, DIR_FLAGS), own=True) as source,
    ):
        for parts, names in _by_directory(entry.files):
            into = dest.make(parts)
            out = source.to(parts)
            if out is None:
                raise SandboxError(f"{entry.partial}/{'/'.join(parts)} went missing before it was published.")
            for name in names:
                os.rename(name, name, src_dir_fd=out, dst_dir_fd=into)
