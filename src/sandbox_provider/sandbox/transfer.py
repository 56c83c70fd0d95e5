"""Moving files between object storage and a sandbox: staging inputs in, exporting results out."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.output import format_size
from sandbox_provider.sandbox.spec import DAG_ID_TAG, MAP_INDEX_TAG, RUN_ID_TAG, TASK_ID_TAG, TRY_NUMBER_TAG
from sandbox_provider.sandbox.storage import (
    check_export_target,
    check_sandbox_path,
    check_storage_url,
    is_local,
    open_file_input,
    open_storage_path,
    same_local_file,
)

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
#: A ``.partial`` sibling this provider wrote: ``<name>.airflow-<task instance key>-<try>.partial``.
_PARTIAL = re.compile(r"(?P<name>.+)\.airflow-(?P<key>[0-9a-f]{12})-(?P<try>\d{1,10})\.partial")


@dataclass(frozen=True)
class ExportRecord:
    """One exported file: the sandbox path, where it landed, and its size in bytes."""

    path: str
    url: str
    size_bytes: int


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
                value = check_storage_url(value, f"{what}[{path!r}]", export=what == "exports")
        elif not isinstance(value, (str, bytes)):
            raise ValueError(f"{what}[{path!r}] must be text or bytes, got {type(value).__name__}.")
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


def stage_files(hook: SandboxHook, handle: str, files: Mapping[str, str | bytes]) -> None:
    """Write each ``{sandbox path: text or bytes}`` entry into the sandbox."""
    if not files:
        return
    started = time.monotonic()
    total = 0
    for path, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        hook.write_file(handle, path, data)
        total += len(data)
    log.info(
        "Wrote %d file(s) into sandbox %s (%s) in %.1fs: %s",
        len(files),
        handle,
        format_size(total),
        time.monotonic() - started,
        ", ".join(files),
    )


def stage_inputs(hook: SandboxHook, handle: str, inputs: Mapping[str, str], *, conn_id: str | None = None) -> None:
    """
    Stream each ``{sandbox path: storage URL}`` entry into the sandbox, in bounded memory.

    A ``file://`` input is read with the worker's permissions, following symlinks (the Dag author
    chose the URL), from inside the directories ``[sandbox] file_input_dirs`` allows when that is set.

    :raises SandboxError: naming the input that could not be read or written.
    """
    for path, url in inputs.items():
        what = f"inputs[{path!r}]"
        source = open_storage_path(url, conn_id, what)
        started = time.monotonic()
        try:
            opened = open_file_input(source.path, url, what) if is_local(source) else source.open("rb")
            with opened as stream:
                size = hook.import_file(handle, path, stream)
        except SandboxError:
            raise
        except Exception as err:
            raise SandboxError(f"Could not stage input {url} into {path!r}: {type(err).__name__}: {err}") from err
        log.info(
            "Staged %s into sandbox %s at %s (%s in %.1fs)",
            url,
            handle,
            path,
            format_size(size),
            time.monotonic() - started,
        )


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


def _sweep_earlier_tries(target: ObjectStoragePath, tag: tuple[str, int]) -> None:
    """Remove the ``.partial`` siblings of ``target`` that earlier tries of this task instance left."""
    key, try_number = tag
    try:
        siblings = list(target.parent.iterdir()) if target.parent.exists() else []
    except Exception:
        log.debug("Could not list %s to look for earlier partial files", target.parent, exc_info=True)
        return
    for sibling in siblings:
        found = _PARTIAL.fullmatch(sibling.name)
        if not found or found["name"] != target.name or found["key"] != key or int(found["try"]) >= try_number:
            continue
        try:
            sibling.unlink()
            log.info("Removed %s, which try %s of this task left while exporting", sibling, found["try"])
        except FileNotFoundError:
            pass
        except Exception:
            log.warning("Could not remove %s, left by an earlier try", sibling, exc_info=True)


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
        try:
            entry.unlink()
        except FileNotFoundError:
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


def export_targets(exports: Mapping[str, str], *, conn_id: str | None) -> dict[str, ObjectStoragePath]:
    """
    Open and check each export destination, before anything is copied (and, at session start, before
    anything is provisioned): see :func:`~sandbox_provider.sandbox.storage.check_export_target`.

    :raises ValueError: for a URL no filesystem of this worker opens.
    :raises SandboxTerminalError: for a destination an export cannot write.
    """
    targets: dict[str, ObjectStoragePath] = {}
    for path, url in exports.items():
        url = check_storage_url(url, f"exports[{path!r}]", export=True)
        target = open_storage_path(url, conn_id, f"exports[{path!r}]")
        check_export_target(target, url, path)
        targets[path] = target
    clash = same_local_file({path: (exports[path], target) for path, target in targets.items()})
    if clash:
        raise ValueError(clash)
    return targets


def export_files(
    hook: SandboxHook,
    handle: str,
    exports: Mapping[str, str],
    *,
    conn_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
    stamps: Mapping[str, str] | None = None,
) -> list[ExportRecord]:
    """
    Copy each ``{sandbox path: storage URL}`` out of the sandbox, all or nothing.

    Every file is first streamed to a ``.partial`` sibling of its destination named for the task
    instance and try (``<name>.airflow-<key>-<try>.partial``), after removing those earlier tries of
    the same task instance left there. Only when all copies succeeded are they moved into place (a
    rename on local storage). The first copy that fails removes every staged copy and changes no
    destination.

    :param stamps: the trace stamps of the running task instance (Dag, run, task, map index, try),
        which name the partial files; None outside a task.
    :raises SandboxTerminalError: naming the file that failed, and any staged copy that could not be
        removed; or, when a move fails, naming the files already in place.
    """
    targets = export_targets(exports, conn_id=conn_id)
    tag = partial_tag(stamps)
    staged: list[tuple[str, ObjectStoragePath, ObjectStoragePath, int]] = []
    for path, url in exports.items():
        target = targets[path]
        partial = _partial_of(target, tag)
        started = time.monotonic()
        try:
            if is_local(target):
                # Only on local disk: on object storage a mkdir can create a bucket.
                target.parent.mkdir(parents=True, exist_ok=True)
            _sweep_earlier_tries(target, tag)
            with partial.open("wb") as stream:
                size = hook.export_file(handle, path, stream, max_bytes=max_bytes)
        except Exception as err:
            leftovers = _remove_partials([*(s[2] for s in staged), partial])
            reason = str(err) if isinstance(err, SandboxError) else f"{type(err).__name__}: {err}"
            message = f"Could not export {path!r} from sandbox {handle} on backend {hook.name!r} to {url}: {reason}"
            if leftovers:
                message += f" Left behind, to delete by hand: {', '.join(leftovers)}."
            raise SandboxTerminalError(message) from err
        log.info(
            "Copied %s out of sandbox %s (%s in %.1fs) to %s",
            path,
            handle,
            format_size(size),
            time.monotonic() - started,
            partial,
        )
        staged.append((path, target, partial, size))
    return _publish(staged)


def _publish(staged: list[tuple[str, ObjectStoragePath, ObjectStoragePath, int]]) -> list[ExportRecord]:
    done: list[ExportRecord] = []
    for path, target, partial, size in staged:
        try:
            partial.move(target)
        except Exception as err:
            in_place = ", ".join(r.url for r in done) or "none"
            published = {r.path for r in done}
            leftovers = _remove_partials([s[2] for s in staged if s[0] not in published])
            message = f"Could not move the export into {target}: {err}. Already in place: {in_place}."
            if leftovers:
                message += f" Left behind, to delete by hand: {', '.join(leftovers)}."
            raise SandboxTerminalError(message) from err
        log.info("Published %s (%s)", target, format_size(size))
        done.append(ExportRecord(path=path, url=str(target), size_bytes=size))
    return done


def _remove_partials(partials: list[ObjectStoragePath]) -> list[str]:
    left: list[str] = []
    for partial in partials:
        try:
            if partial.exists():
                partial.unlink()
        except Exception:
            log.warning("Could not remove %s after a failed export", partial, exc_info=True)
            left.append(str(partial))
    return left
