"""Moving files between object storage and a sandbox: staging inputs in, exporting results out."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.output import format_size

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from sandbox_provider.sandbox.hook import SandboxHook

log = logging.getLogger(__name__)

__all__ = ["ExportRecord", "check_storage_url", "check_transfer_map", "export_files", "stage_files", "stage_inputs"]

#: The largest file an export copies unless told otherwise: 1 GiB.
DEFAULT_MAX_EXPORT_BYTES = 1024**3


@dataclass(frozen=True)
class ExportRecord:
    """One exported file: the sandbox path, where it landed, and its size in bytes."""

    path: str
    url: str
    size_bytes: int


def check_storage_url(value: Any, what: str) -> str:
    """
    Return ``value`` if it is an object-storage URL such as ``s3://bucket/key`` or ``file:///path``.

    :raises ValueError: for anything else (None, an empty string, a relative path), naming ``what``.
    """
    if isinstance(value, str) and "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme and rest.strip("/"):
            if scheme == "file" and not rest.startswith("/"):
                raise ValueError(f"{what} is {value!r}; a file URL needs an absolute path: file:///path/to/file.")
            return value
    raise ValueError(
        f"{what} is {value!r}, which is not a storage URL such as s3://bucket/key or file:///path/to/file. "
        "Check the value, or the template and the value it reads."
    )


def check_transfer_map(mapping: Any, what: str, *, urls: bool, templated: bool = False) -> dict[str, Any]:
    """
    Check a ``{sandbox path: value}`` mapping (``files``, ``inputs``, ``exports``) and return a copy.

    :param urls: whether every value must be a storage URL.
    :param templated: skip the URL check for values still holding Jinja (checked again after rendering).
    :raises ValueError: for a non-mapping, an empty path, or a bad value.
    """
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{what} must map sandbox paths to values, got {type(mapping).__name__}.")
    out: dict[str, Any] = {}
    for path, value in mapping.items():
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"{what} maps a sandbox path to a value, and the path may not be empty; got {path!r}.")
        if urls:
            if not (templated and isinstance(value, str) and "{{" in value):
                check_storage_url(value, f"{what}[{path!r}]")
        elif not isinstance(value, (str, bytes)):
            raise ValueError(f"{what}[{path!r}] must be text or bytes, got {type(value).__name__}.")
        out[path] = value
    if urls:
        seen: dict[str, str] = {}
        for path, value in out.items():
            if isinstance(value, str) and "{{" not in value:
                if value in seen:
                    raise ValueError(
                        f"{what} sends both {seen[value]!r} and {path!r} to {value}; give each its own destination."
                    )
                seen[value] = path
    return out


def _storage_path(url: str, conn_id: str | None) -> ObjectStoragePath:
    from airflow.sdk import ObjectStoragePath

    # Passing conn_id=None explicitly would drop a connection named inside the URL (s3://conn@bucket).
    return ObjectStoragePath(url, conn_id=conn_id) if conn_id else ObjectStoragePath(url)


def open_storage_path(url: str, conn_id: str | None, what: str) -> ObjectStoragePath:
    """
    Return the storage path for ``url``, checking that its scheme names a filesystem this worker has.

    :raises ValueError: naming ``what`` and the scheme, when no filesystem handles it.
    """
    try:
        path = _storage_path(url, conn_id)
        path.fs  # noqa: B018 - resolves the filesystem (and the connection), which is what may fail
    except Exception as err:
        scheme = url.partition("://")[0]
        raise ValueError(
            f"{what} is {url}, but no filesystem for {scheme!r} URLs could be opened on this worker "
            f"({type(err).__name__}: {err}). Install the provider that brings it (e.g. the Amazon provider for "
            "s3://), or check the connection."
        ) from err
    return path


def _is_special_file(local_path: str) -> bool:
    """True when something other than a regular file, a directory or a symlink is at ``local_path``."""
    try:
        mode = os.lstat(local_path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _is_local(path: ObjectStoragePath) -> bool:
    protocol = path.fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def stage_files(hook: SandboxHook, handle: str, files: Mapping[str, str | bytes]) -> None:
    """Write each ``{sandbox path: text or bytes}`` entry into the sandbox."""
    for path, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        hook.write_file(handle, path, data)


def stage_inputs(hook: SandboxHook, handle: str, inputs: Mapping[str, str], *, conn_id: str | None = None) -> None:
    """
    Stream each ``{sandbox path: storage URL}`` entry into the sandbox, in bounded memory.

    :raises SandboxError: naming the input that could not be read or written.
    """
    for path, url in inputs.items():
        source = open_storage_path(url, conn_id, f"inputs[{path!r}]")
        if _is_local(source) and _is_special_file(source.path):
            raise SandboxError(f"Input {url} is not a regular file (a device, pipe or socket); stage a file instead.")
        try:
            with source.open("rb") as stream:
                size = hook.import_file(handle, path, stream)
        except SandboxError:
            raise
        except Exception as err:
            raise SandboxError(f"Could not stage input {url} into {path!r}: {type(err).__name__}: {err}") from err
        log.info("Staged %s into sandbox %s at %s (%s)", url, handle, path, format_size(size))


def export_files(
    hook: SandboxHook,
    handle: str,
    exports: Mapping[str, str],
    *,
    conn_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
) -> list[ExportRecord]:
    """
    Copy each ``{sandbox path: storage URL}`` out of the sandbox, all or nothing.

    Every file is first streamed to a ``.partial`` sibling of its destination. Only when all copies
    succeeded are they moved into place (a rename on local storage). The first copy that fails
    removes every staged copy and changes no destination.

    :raises SandboxTerminalError: naming the file that failed, and any staged copy that could not be
        removed; or, when a move fails, naming the files already in place.
    """
    targets = {}
    for path, url in exports.items():
        check_storage_url(url, f"exports[{path!r}]")
        target = open_storage_path(url, conn_id, f"exports[{path!r}]")
        if target.is_dir():
            raise SandboxTerminalError(
                f"Could not export {path!r} from sandbox {handle}: its destination {url} is a directory. Name a "
                "file, e.g. " + url.rstrip("/") + "/" + path.rsplit("/", 1)[-1] + "."
            )
        if _is_local(target) and _is_special_file(target.path):
            # Publishing renames over the destination: a device such as /dev/null would be replaced.
            raise SandboxTerminalError(
                f"Could not export {path!r} from sandbox {handle}: its destination {url} exists and is not a "
                "regular file (a device, pipe or socket), which an export would replace. Name a regular file."
            )
        targets[path] = target
    staged: list[tuple[str, ObjectStoragePath, ObjectStoragePath, int]] = []
    for path, url in exports.items():
        target = targets[path]
        partial = target.parent / f"{target.name}.{secrets.token_hex(6)}.partial"
        try:
            if _is_local(target):
                # Only on local disk: on object storage a mkdir can create a bucket.
                target.parent.mkdir(parents=True, exist_ok=True)
            with partial.open("wb") as stream:
                size = hook.export_file(handle, path, stream, max_bytes=max_bytes)
        except Exception as err:
            leftovers = _remove_partials([*(s[2] for s in staged), partial])
            reason = str(err) if isinstance(err, SandboxError) else f"{type(err).__name__}: {err}"
            message = f"Could not export {path!r} from sandbox {handle} on backend {hook.name!r} to {url}: {reason}"
            if leftovers:
                message += f" Left behind, to delete by hand: {', '.join(leftovers)}."
            raise SandboxTerminalError(message) from err
        log.info("Exported %s from sandbox %s (%s)", path, handle, format_size(size))
        staged.append((path, target, partial, size))

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
        log.info("Published %s", target)
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
