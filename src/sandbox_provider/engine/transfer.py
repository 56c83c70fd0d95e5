"""Moving files between object storage and a sandbox: staging inputs in, exporting results out."""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import hashlib
import io
import logging
import os
import posixpath
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from sandbox_provider.engine.publish import PartialSink, Staged, publish, remove_partial
from sandbox_provider.engine.publish import check as check_publish
from sandbox_provider.engine.storage import (
    check_export_target,
    check_input_source,
    check_sandbox_path,
    check_storage_url,
    file_input_dirs,
    is_local,
    open_file_input,
    open_storage_path,
    resolve_file_input,
    same_local_file,
)
from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ImportEntry, check_member_name, is_glob
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.nofollow import Descent, LinkInTheWay, open_directory
from sandbox_provider.sandbox.output import format_size
from sandbox_provider.sandbox.spec import DAG_ID_TAG, MAP_INDEX_TAG, RUN_ID_TAG, TASK_ID_TAG, TRY_NUMBER_TAG

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from sandbox_provider.sandbox.hook import SandboxHook

log = logging.getLogger(__name__)

__all__ = [
    "ExportRecord",
    "check_storage_url",
    "check_transfer_map",
    "export_files",
    "partial_tag",
    "remove_stale_partials",
    "stage_files",
    "stage_inputs",
]

#: The largest file an export copies unless told otherwise: 1 GiB.
DEFAULT_MAX_EXPORT_BYTES = 1024**3
#: The most bytes one export copies in all (every file of every entry): 16 GiB.
DEFAULT_MAX_EXPORT_TOTAL_BYTES = 16 * 1024**3
#: A ``.partial`` sibling this provider wrote: ``<name>.airflow-<task instance key>-<try>.partial``.
_PARTIAL = re.compile(r"(?P<name>.+)\.airflow-(?P<key>[0-9a-f]{12})-(?P<try>\d{1,10})\.partial")


@dataclass(frozen=True)
class ExportRecord:
    """
    One export entry: the sandbox path, where it landed, its size in bytes (a directory's: all its
    files'), and how many files it holds (1 for a file).
    """

    path: str
    url: str
    size_bytes: int
    file_count: int = 1


def check_transfer_map(mapping: Any, what: str, *, urls: bool, templated: bool = False) -> dict[str, Any]:
    """
    Check a ``{sandbox path: value}`` mapping (``files``, ``inputs``, ``exports``) and return a copy, URLs
    in the one spelling :func:`check_storage_url` gives them.

    :param urls: whether every value must be a storage URL.
    :param templated: skip the URL check for values still holding Jinja (checked again after rendering).
    :raises ValueError: for a non-mapping, a bad sandbox path (empty, NUL, too long), a bad value, or
        two exports to one destination however each is spelled.
    """
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{what} must map sandbox paths to values, got {type(mapping).__name__}.")
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for path, value in mapping.items():
        check_sandbox_path(path, what)
        if urls:
            if not (templated and isinstance(value, str) and "{{" in value):
                value = _check_url(path, value, what)
        elif isinstance(value, Mapping):
            value = _file_tree(value, f"{what}[{path!r}]")
        elif not isinstance(value, (str, bytes)):
            raise ValueError(
                f"{what}[{path!r}] must be text or bytes, or a mapping of relative names to them (a directory), "
                f"got {type(value).__name__}."
            )
        out[path] = value
        spelled[path] = mapping[path]
    if urls:
        seen: dict[str, str] = {}
        for path, value in out.items():
            if isinstance(value, str) and "{{" not in value:
                if value in seen:
                    other = seen[value]
                    both = (
                        f"{spelled[other]} and {spelled[path]}, which are one destination ({value})"
                        if spelled[other] != spelled[path]
                        else str(value)
                    )
                    raise ValueError(
                        f"{what} sends both {other!r} and {path!r} to {both}; give each its own destination."
                    )
                seen[value] = path
    return out


def _check_url(path: str, value: Any, what: str) -> str:
    """One URL of ``inputs`` or ``exports``; a trailing ``/`` (a directory) is kept."""
    where = f"{what}[{path!r}]"
    directory = isinstance(value, str) and value.endswith("/") and value.rstrip("/") != value.split("://")[0] + ":"
    if what != "exports":
        checked = check_storage_url(value, where)
        return checked.rstrip("/") + "/" if directory else checked
    if "**" in path:
        raise ValueError(f"{where}: '**' is not supported in an export glob; use one '*' per directory level.")
    if is_glob(path) and not directory:
        raise ValueError(
            f"{where} is a glob, which may match many files, so its destination must be a directory URL ending "
            f"in '/', e.g. {value.rsplit('/', 1)[0] if isinstance(value, str) else 's3://bucket/prefix'}/."
        )
    if not directory:
        return check_storage_url(value, where, export=True)
    return check_storage_url(value.rstrip("/"), where, export=True) + "/"


def _file_tree(tree: Mapping[Any, Any], what: str, prefix: str = "") -> dict[str, str | bytes]:
    """A ``files`` directory: ``{relative name: text, bytes or a further mapping}``, flattened."""
    flat: dict[str, str | bytes] = {}
    for name, value in tree.items():
        if not isinstance(name, str) or check_member_name(name) != name.strip("/") or name.startswith("/"):
            raise ValueError(
                f"{what} names the file {name!r}; inside a directory of files= give relative names without '.', "
                "'..' or empty parts, such as 'pkg/module.py'."
            )
        joined = posixpath.join(prefix, name.strip("/"))
        if isinstance(value, Mapping):
            flat.update(_file_tree(value, what, joined))
        elif isinstance(value, (str, bytes)):
            flat[joined] = value
        else:
            raise ValueError(f"{what}[{joined!r}] must be text or bytes, got {type(value).__name__}.")
    return flat


def stage_entries(
    files: Mapping[str, Any], inputs: Mapping[str, str], *, conn_id: str | None = None
) -> list[ImportEntry]:
    """
    The :class:`~sandbox_provider.sandbox.batch.ImportEntry` list for ``files`` (text, bytes, or a
    mapping of them: a directory) and ``inputs`` (storage URLs; one ending in ``/`` is a directory,
    every file below it staged under the sandbox path). Sources are opened only when copied.

    A ``file://`` input is read with the worker's permissions, following symlinks (the Dag author
    chose the URL), from inside the directories ``[sandbox] file_input_dirs`` allows when that is set.
    Every member of a ``file://`` directory input is checked here, so the session calls this before
    provisioning: regular files only, and a symlink among them only when it leads to a regular file
    inside that directory (the author chose the directory, not where links in it lead).

    :raises SandboxTerminalError: for a ``file://`` input, or a member of one, that is missing or not allowed.
    :raises SandboxError: for a source whose size cannot be read.
    """
    entries: list[ImportEntry] = []
    for path, content in files.items():
        tree = content if isinstance(content, Mapping) else {"": content}
        for name, value in tree.items():
            data = value.encode() if isinstance(value, str) else value
            entries.append(_bytes_entry(posixpath.join(path, name) if name else path, data))
    for path, url in inputs.items():
        try:
            entries += _input_entries(path, url, conn_id)
        except SandboxError:
            raise
        except Exception as err:
            raise SandboxError(f"Could not read input {url} for {path!r}: {type(err).__name__}: {err}") from err
    return entries


def _bytes_entry(path: str, data: bytes) -> ImportEntry:
    return ImportEntry(path=path, size=len(data), open=lambda: io.BytesIO(data))


def _input_entries(path: str, url: str, conn_id: str | None) -> list[ImportEntry]:
    what = f"inputs[{path!r}]"
    source = open_storage_path(url, conn_id, what)
    if url.endswith("/"):
        return _directory_entries(path, url, source, what)
    if is_local(source):
        real = resolve_file_input(source.path, url, what)
        return [_local_entry(path, source.path, real, url, what, None)]
    size = int(source.fs.info(source.path)["size"])
    # Read on the store's filesystem, not through ObjectStoragePath.open, which would report the read to
    # Airflow's hook lineage a second time: the session reports each input once (engine/lineage.py).
    return [ImportEntry(path, size, _opener(source.fs, source.path))]


def _local_entry(path: str, local: str, real: str, url: str, what: str, inside: str | None) -> ImportEntry:
    opener = functools.partial(open_file_input, local, url, what, inside=inside)
    return ImportEntry(path, os.stat(real).st_size, opener, local_path=real)


def _directory_entries(path: str, url: str, source: ObjectStoragePath, what: str) -> list[ImportEntry]:
    """Every file below the directory ``source``, to land below ``path``; sorted by name."""
    entries: list[ImportEntry] = []
    if is_local(source):
        top = check_input_directory(source.path, url, what)
        with _collection_paused():
            _walk_local(top, "", path, url, what, entries)
        return entries
    prefix = source.path.rstrip("/")
    found = source.fs.find(prefix, detail=True)
    for key in sorted(found):
        info = found[key]
        if info.get("type") == "directory" or not key.startswith(prefix + "/"):
            continue
        rel = key[len(prefix) + 1 :]
        if check_member_name(rel) != rel:
            raise SandboxError(f"{what}: the object {key!r} has a name that cannot be a path in the sandbox.")
        entries.append(ImportEntry(posixpath.join(path, rel), int(info["size"]), _opener(source.fs, key)))
    return entries


def _walk_local(top: str, rel: str, path: str, url: str, what: str, entries: list[ImportEntry]) -> None:
    """
    The files below ``top/rel``: a plain file lies inside the checked (real) ``top``, so it needs no
    check of its own and opens without following links; a symlink is followed only to a regular file
    inside ``top`` (checked again when it is opened), and refused otherwise, like anything else that
    is not a regular file. (Names are joined by hand: this runs once per file of trees of many thousands.)
    """
    walked = (top, path)
    walked_files = _WalkedFiles(top, url)
    under = "" if path == "" else path if path.endswith("/") else path + "/"
    linked: dict[tuple[int, int], tuple[int, list[str]]] = {}  # (device, inode) of a file of several links
    levels = [(rel + "/" if rel else "", iter(_listing(os.path.join(top, rel) if rel else top)))]
    while levels:
        lead, items = levels[-1]
        item = next(items, None)
        if item is None:
            levels.pop()
            continue
        name = lead + item.name
        if item.is_dir(follow_symlinks=False):
            levels.append((name + "/", iter(_listing(item.path))))
        elif item.is_file(follow_symlinks=False):
            info = item.stat(follow_symlinks=False)
            if info.st_nlink > 1:
                linked.setdefault((info.st_dev, info.st_ino), (info.st_nlink, []))[1].append(name)
            opener = functools.partial(walked_files.open, name)
            entries.append(ImportEntry(under + name, info.st_size, opener, item.path, walked))
        elif item.is_symlink():
            real = resolve_file_input(item.path, url + name, what, inside=top)
            entries.append(_local_entry(under + name, item.path, real, url + name, what, top))
        else:
            raise SandboxTerminalError(f"{what}: {url + name} is not a regular file; stage regular files only.")
    if linked and not hard_links_protected():
        _refuse_links_outside(linked, url, what)


def hard_links_protected() -> bool:
    """
    Whether this worker's kernel lets a user make a hard link only to a file they own or may read and
    write (``fs.protected_hardlinks`` is 1, as systemd sets it): then a hard link in a directory input
    gives the sandbox nothing its maker could not read anyway.
    """
    try:
        with open("/proc/sys/fs/protected_hardlinks", encoding="ascii") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _refuse_links_outside(linked: Mapping[tuple[int, int], tuple[int, list[str]]], url: str, what: str) -> None:
    """
    :raises SandboxTerminalError: for a file with more hard links than names in the directory (a name
        outside it), on a worker whose kernel lets anyone link any file they can reach (then a link
        made by whoever can write the directory could stage a file only the worker may read).
    """
    for links, names in linked.values():
        if len(names) < links:
            raise SandboxTerminalError(
                f"{what}: {url + names[0]} has {links} hard links, {links - len(names)} of them outside the "
                "directory, and this worker's kernel lets a user link files they cannot read "
                "(fs.protected_hardlinks is 0), so it could be anyone's file. Copy it into the directory, or set "
                "fs.protected_hardlinks=1 on the worker."
            )


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """
    No cyclic garbage collection meanwhile: a walk of a big tree allocates tens of thousands of
    objects, none in cycles, and a full collection of a worker's heap halfway through costs more than
    the walk itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _listing(directory: str) -> list[os.DirEntry[str]]:
    with os.scandir(directory) as listing:
        return sorted(listing, key=lambda e: e.name)


class _WalkedFiles:
    """
    Opens the plain files one walk found below ``top`` (shown as ``url + name``) through descriptors
    from ``top``, so a link put since the walk on a file's way (a directory swapped for one) or at
    its name is not followed. One descent serves them all: taken in walk order, each directory is
    opened once; it is closed when the last opener goes.
    """

    def __init__(self, top: str, url: str) -> None:
        self.top = top
        self.url = url
        self._lock = threading.Lock()
        self._descent: Descent | None = None

    def open(self, name: str) -> IO[bytes]:
        *parents, base = name.split("/")
        try:
            with self._lock:
                if self._descent is None:
                    self._descent = Descent(open_directory(self.top), own=True)
                    weakref.finalize(self, self._descent.close)
                where = self._descent.to(parents)
                if where is None:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", name)
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                fd = os.open(base, flags, dir_fd=where)
        except LinkInTheWay as err:
            raise SandboxError(
                f"Could not open input {self.url + name}: {self.url}{err.filename} became a symbolic link after the "
                "directory was listed."
            ) from err
        except OSError as err:
            raise SandboxError(f"Could not open input {self.url + name}: {err.strerror}") from err
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SandboxError(
                f"Input {self.url + name} changed into something that is not a regular file; stage files only."
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")


def _opener(fs: Any, key: str) -> Any:
    return lambda: fs.open(key, "rb")


def check_input_directory(local: str, url: str, what: str) -> str:
    """
    The real path of a ``file://`` directory input, which must exist and (with ``[sandbox]
    file_input_dirs`` set) lie inside the allowed directories once symlinks are followed.

    :raises SandboxTerminalError: otherwise, saying what to change.
    """
    real = os.path.realpath(local)
    if not os.path.isdir(real):
        raise SandboxTerminalError(
            f"{what} is {url}, which ends in '/' and so names a directory, and there is no directory there on this "
            "worker. Name an existing directory, or drop the '/' to stage one file."
        )
    dirs = file_input_dirs()
    if dirs is not None and not any(real == d or real.startswith(d.rstrip("/") + "/") for d in dirs):
        raise SandboxTerminalError(
            f"{what} is {url}, outside the directories this worker stages files from ([sandbox] file_input_dirs: "
            f"{', '.join(dirs)})."
        )
    return real


def check_input(url: str, conn_id: str | None, what: str) -> None:
    """Refuse, before anything is provisioned, a ``file://`` input (file or directory) that cannot be staged."""
    source = open_storage_path(url, conn_id, what)
    if not is_local(source):
        return
    if url.endswith("/"):
        check_input_directory(source.path, url, what)
    else:
        check_input_source(source, url, what)


def log_staged(handle: str, entries: list[ImportEntry], started: float | None) -> None:
    """
    Log what was staged into ``handle`` and, from ``started`` (a ``time.monotonic()``), in how many
    seconds; with ``started`` None, the entries go in with the command's own launch, about to start,
    and no seconds are claimed.
    """
    shown = ", ".join(e.path for e in entries[:5]) + (f", ... ({len(entries) - 5} more)" if len(entries) > 5 else "")
    size = format_size(sum(e.size for e in entries))
    if started is None:
        log.info(
            "Staging %d file(s) into sandbox %s with the command's own launch (%s): %s",
            len(entries),
            handle,
            size,
            shown,
        )
        return
    log.info(
        "Staged %d file(s) into sandbox %s (%s in %.1fs): %s",
        len(entries),
        handle,
        size,
        time.monotonic() - started,
        shown,
    )


def stage_files(hook: SandboxHook, handle: str, files: Mapping[str, Any]) -> None:
    """Write each ``{sandbox path: text, bytes or a directory of them}`` entry into the sandbox, in one batch."""
    stage_batch(hook, handle, stage_entries(files, {}))


def stage_inputs(hook: SandboxHook, handle: str, inputs: Mapping[str, str], *, conn_id: str | None = None) -> None:
    """Stream each ``{sandbox path: storage URL}`` entry (files and directories) into the sandbox, in one batch."""
    stage_batch(hook, handle, stage_entries({}, inputs, conn_id=conn_id))


def stage_batch(hook: SandboxHook, handle: str, entries: list[ImportEntry]) -> None:
    """:meth:`~sandbox_provider.sandbox.hook.SandboxHook.import_batch` of ``entries``, logged."""
    if not entries:
        return
    started = time.monotonic()
    try:
        hook.import_batch(handle, entries)
    except SandboxError:
        raise
    except Exception as err:
        raise SandboxError(f"Could not stage {len(entries)} file(s): {type(err).__name__}: {err}") from err
    log_staged(handle, entries, started)


def partial_tag(stamps: Mapping[str, str] | None) -> tuple[str, int]:
    """
    ``(key, try)`` naming the ``.partial`` files of one try of a task instance: the key is 12 hex
    digits of a hash of its Dag, run, task and map index. Outside a task, a random key and try 0.
    """
    stamps = stamps or {}
    ident = [stamps.get(tag) for tag in (DAG_ID_TAG, RUN_ID_TAG, TASK_ID_TAG, MAP_INDEX_TAG)]
    try_number = stamps.get(TRY_NUMBER_TAG)
    if any(part is None for part in ident) or try_number is None or not str(try_number).isdigit():
        return secrets.token_hex(6), 0
    key = hashlib.sha256("\n".join(str(p) for p in ident).encode()).hexdigest()[:12]
    return key, int(try_number)


def _partial_of(target: ObjectStoragePath, tag: tuple[str, int]) -> ObjectStoragePath:
    key, try_number = tag
    return target.parent / f"{target.name}.airflow-{key}-{try_number}.partial"


def _sweep_leftovers(target: ObjectStoragePath, tag: tuple[str, int]) -> None:
    """
    Remove the ``.partial`` siblings of ``target`` that earlier tries of this task instance left, and
    one of this try's own name (a worker that died in it): the copies are then made new, never into
    whatever is already there.
    """
    key, try_number = tag
    try:
        siblings = list(target.parent.iterdir()) if target.parent.exists() else []
    except Exception:
        log.debug("Could not list %s to look for earlier partial files", target.parent, exc_info=True)
        return
    for sibling in siblings:
        found = _PARTIAL.fullmatch(sibling.name)
        if not found or found["name"] != target.name or found["key"] != key or int(found["try"]) > try_number:
            continue
        if remove_partial(sibling):
            log.info("Removed %s, which try %s of this task left while exporting", sibling, found["try"])


def remove_stale_partials(url: str, *, conn_id: str | None = None, older_than: float = 3600.0) -> list[str]:
    """
    Remove the ``.partial`` files exports of this provider left behind (a worker killed mid-copy).

    :param url: a directory (``file:///data/out/``, ``s3://bucket/prefix/``), whose partial files of
        any destination go, or a destination file, whose partial siblings go.
    :param conn_id: the Airflow connection for ``url``.
    :param older_than: leave files modified less than this many seconds ago (an export may still be
        writing them); default one hour. Files whose age the store does not report are left alone
        unless ``older_than`` is 0.
    :returns: the URLs removed.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"url must be a storage URL such as file:///data/out/, got {url!r}.")
    base = open_storage_path(url, conn_id, "url")
    folder, name = (base, None) if url.endswith("/") or base.is_dir() else (base.parent, base.name)
    now = time.time()
    removed: list[str] = []
    for entry in folder.iterdir():
        found = _PARTIAL.fullmatch(entry.name)
        if not found or (name is not None and found["name"] != name):
            continue
        if older_than > 0:
            modified = _modified(entry)
            if modified is None or now - modified < older_than:
                continue
        if not remove_partial(entry):
            continue
        removed.append(str(entry))
        log.info("Removed stale partial file %s", entry)
    return removed


def _modified(entry: ObjectStoragePath) -> float | None:
    try:
        info = entry.fs.info(entry.path)
    except Exception:
        return None
    for key in ("mtime", "LastModified", "last_modified", "updated", "mtime_ns"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        return number / 1e9 if key == "mtime_ns" else number
    return None


def _request(path: str, url: str) -> ExportRequest:
    if not url.endswith("/"):
        return ExportRequest(path)
    return ExportRequest(path, "glob" if is_glob(path) else "tree")


def export_targets(exports: Mapping[str, str], *, conn_id: str | None) -> dict[str, ObjectStoragePath]:
    """
    Open and check each export destination, before anything is copied (and, at session start, before
    anything is provisioned): see :func:`~sandbox_provider.engine.storage.check_export_target`; a
    directory destination (a URL ending in ``/``) must not be a file.

    :raises ValueError: for a URL no filesystem of this worker opens.
    :raises SandboxTerminalError: for a destination an export cannot write.
    """
    targets: dict[str, ObjectStoragePath] = {}
    for path, url in exports.items():
        url = _check_url(path, url, "exports")
        target = open_storage_path(url.rstrip("/"), conn_id, f"exports[{path!r}]")
        if url.endswith("/"):
            _check_export_directory(target, url, path)
        else:
            check_export_target(target, url, path)
        targets[path] = target
    clash = same_local_file({path: (exports[path], target) for path, target in targets.items()})
    if clash:
        raise ValueError(clash)
    return targets


def _check_export_directory(target: ObjectStoragePath, url: str, path: str) -> None:
    if not is_local(target):
        return
    local = target.path
    if os.path.lexists(local) and not os.path.isdir(local):
        raise SandboxTerminalError(
            f"Cannot export {path!r} to {url}: it exists and is not a directory. Name a directory, or drop the '/'."
        )
    probe = local
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SandboxTerminalError(f"Cannot export {path!r} to {url}: the worker cannot write into {probe}.")


def export_files(
    hook: SandboxHook,
    handle: str,
    exports: Mapping[str, str],
    *,
    conn_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
    max_total_bytes: int = DEFAULT_MAX_EXPORT_TOTAL_BYTES,
    stamps: Mapping[str, str] | None = None,
) -> list[ExportRecord]:
    """
    Copy each ``{sandbox path: storage URL}`` out of the sandbox, all or nothing, in one
    :meth:`~sandbox_provider.sandbox.hook.SandboxHook.export_batch`.

    A URL ending in ``/`` is a directory: the sandbox path is then a directory (every file below it)
    or a glob (its matches). Every file is first copied to a ``.partial`` sibling of its destination
    (a ``.partial`` directory for a directory) named for the task instance and try
    (``<name>.airflow-<key>-<try>.partial``), made new after removing those earlier tries of the same
    task instance (or a dead worker in this one) left there. Only when all copies succeeded are they
    moved into place (:mod:`~sandbox_provider.engine.publish` says what that means for a directory,
    and which links below a destination fail it). A failed copy removes every staged copy and changes
    no destination.

    :param max_bytes: the largest file, in bytes; :param max_total_bytes: all files together.
    :param stamps: the trace stamps of the running task instance (Dag, run, task, map index, try),
        which name the partial files; None outside a task.
    :returns: one record per entry of ``exports`` (a directory's: its URL and total size).
    :raises SandboxTerminalError: naming what failed, and any staged copy that could not be removed;
        or, when a move fails, naming the entries already in place.
    """
    tag = partial_tag(stamps)
    staged, requests = _staged_exports(exports, export_targets(exports, conn_id=conn_id), tag)
    sink = PartialSink(staged)
    started = time.monotonic()
    try:
        for entry in staged:
            if is_local(entry.target):
                # Only on local disk: on object storage a mkdir can create a bucket.
                entry.target.parent.mkdir(parents=True, exist_ok=True)
            _sweep_leftovers(entry.target, tag)
        hook.export_batch(handle, requests, sink, limits=ExportLimits(max_bytes, max_total_bytes))
    except Exception as err:
        sink.close()
        raise _export_failure(err, staged, exports, hook, handle) from err
    sink.close()
    files = sum(len(e.files) for e in staged)
    size = sum(e.size for e in staged)
    log.info(
        "Copied %s out of sandbox %s (%d file(s), %s in %.1fs)",
        ", ".join(exports),
        handle,
        files,
        format_size(size),
        time.monotonic() - started,
    )
    return _publish(staged)


def _staged_exports(
    exports: Mapping[str, str], targets: Mapping[str, Any], tag: tuple[str, int]
) -> tuple[list[Staged], list[ExportRequest]]:
    """Each export's request to the sandbox, and where its ``.partial`` copy goes before it is published."""
    staged: list[Staged] = []
    requests: list[ExportRequest] = []
    for path, url in exports.items():
        target = targets[path]
        request = _request(path, url)
        requests.append(request)
        staged.append(Staged(path, url, target, _partial_of(target, tag), directory=request.kind != "file"))
    return staged, requests


def _export_failure(err: Exception, staged: list[Staged], exports: Mapping[str, str], hook, handle: str):
    """The error for a failed export batch, after removing every partial copy it made."""
    leftovers = [str(e.partial) for e in staged if not remove_partial(e.partial)]
    reason = str(err) if isinstance(err, SandboxError) else f"{type(err).__name__}: {err}"
    named = [p for p in exports if repr(p) in reason or repr(p.rstrip("/")) in reason] or list(exports)
    names = ", ".join(repr(p) for p in (named[:1] if len(named) < len(exports) else named))
    message = f"Could not export {names} from sandbox {handle} on backend {hook.name!r}: {reason}"
    if leftovers:
        message += f" Left behind, to delete by hand: {', '.join(leftovers)}."
    return SandboxTerminalError(message)


def _publish(staged: list[Staged]) -> list[ExportRecord]:
    try:
        for entry in staged:  # every entry, before the first file moves
            check_publish(entry)
    except Exception as err:
        left = [str(e.partial) for e in staged if not remove_partial(e.partial)]
        reason = str(err) if isinstance(err, SandboxError) else f"Could not look into {entry.url}: {err}."
        message = f"{reason} Nothing was moved into place."
        if left:
            message += f" Left behind, to delete by hand: {', '.join(left)}."
        raise SandboxTerminalError(message) from err
    done: list[ExportRecord] = []
    for entry in staged:
        try:
            publish(entry)
        except Exception as err:
            in_place = ", ".join(r.url for r in done) or "none"
            left = [str(e.partial) for e in staged[len(done) :] if not remove_partial(e.partial)]
            reason = str(err).rstrip(".")
            message = f"Could not move the export into {entry.url}: {reason}. Already in place: {in_place}."
            if left:
                message += f" Left behind, to delete by hand: {', '.join(left)}."
            raise SandboxTerminalError(message) from err
        url = str(entry.target) + ("/" if entry.directory else "")
        log.info("Published %s (%s%s)", url, format_size(entry.size), f", {len(entry.files)} files" * entry.directory)
        done.append(ExportRecord(entry.path, url, entry.size, len(entry.files) if entry.directory else 1))
    return done
