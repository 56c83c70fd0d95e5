"""
Where an export batch's files go: ``.partial`` copies beside each destination, published only once
every copy succeeded, removed when any failed.

A file export goes to ``<name>.airflow-<key>-<try>.partial`` beside its destination and is moved
over it (a rename on local storage). A directory export (a tree, a glob's matches) goes into a
``.partial`` directory named the same way beside the destination directory; when all copies
succeeded:

- on local storage, a destination directory that does not exist yet is the partial directory
  renamed: every file appears at once;
- otherwise (it exists, or object storage) each file is moved into place after all were copied: for
  that short window a reader may see some new files and not yet others, but never half a file, and
  other files already in the destination stay. A failed copy changes no destination.

A directory export that finds no file (an empty directory, a glob matching nothing) leaves an empty
destination directory on local storage, and nothing on object storage.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from sandbox_provider.engine.storage import is_local
from sandbox_provider.sandbox.errors import SandboxError

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

log = logging.getLogger(__name__)

__all__ = ["PartialSink", "Staged", "publish", "remove_partial"]


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
    """Remove a ``.partial`` file or directory; True when nothing of it is left."""
    try:
        if is_local(partial):
            if os.path.isdir(partial.path) and not os.path.islink(partial.path):
                shutil.rmtree(partial.path)
            elif os.path.lexists(partial.path):
                os.unlink(partial.path)
        elif partial.exists():
            partial.fs.rm(partial.path, recursive=partial.is_dir())
        return True
    except FileNotFoundError:
        return True
    except Exception:
        log.warning("Could not remove %s after a failed export", partial, exc_info=True)
        return False


class PartialSink:
    """The :class:`~sandbox_provider.sandbox.batch.ExportSink` writing ``staged`` entries' partial copies."""

    def __init__(self, staged: Sequence[Staged]) -> None:
        self.staged = list(staged)
        self._open: tuple[int, str, IO[bytes]] | None = None
        self._made: set[str] = set()

    def begin(self, index: int, name: str) -> IO[bytes]:
        self._drop_open()
        entry = self.staged[index]
        if not entry.directory:
            stream = entry.partial.open("wb") if not is_local(entry.partial) else open(entry.partial.path, "wb")  # noqa: SIM115
        elif is_local(entry.partial):
            local = os.path.join(entry.partial.path, name)
            parent = os.path.dirname(local)
            if parent not in self._made:
                os.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            stream = open(local, "wb")  # noqa: SIM115 (closed in end or close)
        else:
            stream = (entry.partial / name).open("wb")
        self._open = (index, name, stream)
        return stream

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
        if self._open is not None:
            index, name, stream = self._open
            self._open = None
            stream.close()
            entry = self.staged[index]
            if entry.directory:
                remove_partial(entry.partial / name)

    def close(self) -> None:
        self._drop_open()


def publish(entry: Staged) -> None:
    """Move ``entry``'s partial copy (file or directory) into place; see the module."""
    if not entry.directory:
        entry.partial.move(entry.target)
        return
    if is_local(entry.target):
        target = entry.target.path.rstrip("/")
        if not os.path.lexists(entry.partial.path):  # nothing matched, or an empty directory: an empty one
            os.makedirs(target, exist_ok=True)
            return
        if not os.path.lexists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(entry.partial.path, target)
            return
        made: set[str] = set()
        for name in entry.files:
            dest = os.path.join(target, name)
            parent = os.path.dirname(dest)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            os.replace(os.path.join(entry.partial.path, name), dest)
        shutil.rmtree(entry.partial.path, ignore_errors=True)
        return
    for name in entry.files:
        (entry.partial / name).move(entry.target / name)
    remove_partial(entry.partial)
