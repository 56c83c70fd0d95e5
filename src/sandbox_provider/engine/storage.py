"""
Storage URLs on the worker's side of a transfer: their spelling, what they name, and what may be read.

Everything here needs no sandbox, so the session runs it before anything is provisioned: a URL
spelled two ways for one destination, a destination that is a device or a directory, an input
outside the directories the deployment allows, are refused while nothing has been paid for.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sandbox_provider.sandbox.config import option
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.files import special_kind_of

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

__all__ = [
    "FILE_INPUT_DIRS_OPTION",
    "check_export_target",
    "check_input_source",
    "check_sandbox_path",
    "check_storage_url",
    "file_input_dirs",
    "is_local",
    "open_storage_path",
    "resolve_file_input",
]

#: Bytes of one file name (a path component) on the worker's file systems.
NAME_MAX = 255
#: Bytes of a whole path on the worker (PATH_MAX less its NUL).
PATH_MAX = 4095
#: The Airflow option (section ``sandbox``) that confines ``file://`` inputs to directories.
FILE_INPUT_DIRS_OPTION = "file_input_dirs"
#: Bytes the ``.partial`` sibling adds to a destination's name (``.airflow-<12 hex>-<try>.partial``).
PARTIAL_SUFFIX_BYTES = len(".airflow-") + 12 + 1 + 10 + len(".partial")

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def _bad_url(value: Any, what: str, reason: str | None = None) -> ValueError:
    why = reason or (
        "which is not a storage URL such as s3://bucket/key or file:///path/to/file. Check the value, or the "
        "template and the value it reads."
    )
    return ValueError(f"{what} is {value!r}, {why}")


def check_storage_url(value: Any, what: str, *, export: bool = False) -> str:
    """
    Return ``value``, an object-storage URL such as ``s3://bucket/key`` or ``file:///path``, in the one
    spelling the transfer uses, so that two spellings of one place compare equal.

    - the scheme is lower-cased (``FILE://`` is ``file://``);
    - ``file:`` URLs: the authority must be empty or ``localhost`` and is dropped; repeated slashes
      collapse and ``.`` and ``..`` resolve the way a URL does (by name, before any symlink), so
      ``file:////tmp/x``, ``file:///tmp/./x`` and ``file://localhost/tmp/x`` are all ``file:///tmp/x``;
    - other schemes keep their key as written: object stores do not resolve ``.``, ``..`` or ``//``, so an
      export key holding them is refused as ambiguous;
    - percent-escapes are left as they are: storage takes ``%78`` as three characters, not ``x``.

    :param export: ``value`` is a destination: it must name a file (no trailing ``/``), and on local
        storage its name must leave room for the ``.partial`` sibling written first.
    :raises ValueError: for anything else (None, a relative path, a host in a file URL), naming ``what``
        and what to change.
    """
    if not isinstance(value, str) or "://" not in value:
        raise _bad_url(value, what)
    if "\0" in value:
        raise _bad_url(value, what, "which holds a NUL character; remove it.")
    scheme, _, rest = value.partition("://")
    if not _SCHEME.fullmatch(scheme) or not rest.strip("/"):
        raise _bad_url(value, what)
    scheme = scheme.lower()
    authority, slash, path = rest.partition("/")
    if export and value.endswith("/"):
        raise _bad_url(value, what, "which ends with '/' and so names a directory; name the file, e.g. .../out.csv.")
    if scheme == "file":
        return _file_url(value, what, authority, "/" + path, export=export)
    if not authority:
        raise _bad_url(value, what, f"which names no bucket or container after {scheme}://; give one.")
    if export:
        segments = path.split("/")
        if any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
            raise _bad_url(
                value,
                what,
                f"whose key holds '.', '..' or an empty segment ('//'). {scheme}:// storage keeps them as written "
                "rather than resolving them, so the file would land where a path reading of the URL does not say. "
                "Write the key without them.",
            )
    return f"{scheme}://{authority}{slash}{path}"


def _file_url(value: str, what: str, authority: str, path: str, *, export: bool) -> str:
    if authority not in ("", "localhost"):
        raise _bad_url(
            value,
            what,
            f"which names the host {authority!r}, and a file URL names a file on the worker itself by its "
            "absolute path: file:///path/to/file (three slashes).",
        )
    normal = posixpath.normpath(re.sub(r"/+", "/", path))
    if normal == "/":
        raise _bad_url(value, what, "which names the root directory; name a file.")
    _check_lengths(normal, value, what, suffix=PARTIAL_SUFFIX_BYTES if export else 0)
    return "file://" + normal


def _check_lengths(path: str, value: Any, what: str, *, suffix: int = 0) -> None:
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX - suffix:
        raise _bad_url(value, what, f"which is longer than the {PATH_MAX - suffix} bytes a path may hold here.")
    parts = [p for p in path.split("/") if p]
    for index, part in enumerate(parts):
        room = NAME_MAX - (suffix if index == len(parts) - 1 else 0)
        if len(part.encode("utf-8", "surrogateescape")) > room:
            extra = " (the export first writes a .partial sibling, whose name is longer)" if suffix and room else ""
            raise _bad_url(
                value, what, f"whose name {part[:40]!r}... is longer than the {room} bytes allowed here{extra}."
            )


def check_sandbox_path(path: Any, what: str) -> str:
    """
    Return ``path`` if it can name a file in a sandbox: a non-empty string without NUL, no longer than
    a path may be (4095 bytes, 255 per name).

    :raises ValueError: naming ``what`` and the rule broken.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what} maps a sandbox path to a value, and the path may not be empty; got {path!r}.")
    if "\0" in path:
        raise ValueError(f"{what} has the sandbox path {path!r}, which holds a NUL character; remove it.")
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise ValueError(f"{what} has a sandbox path of more than {PATH_MAX} bytes; shorten it.")
    for part in path.split("/"):
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise ValueError(f"{what} has a sandbox path whose name {part[:40]!r}... is over {NAME_MAX} bytes.")
    return path


def sandbox_path_key(path: str, workdir: str | None = None) -> str:
    """``path`` as a sandbox resolves it, by name: relative paths start at ``workdir`` when given."""
    if workdir is not None and not path.startswith("/"):
        path = posixpath.join(workdir, path)
    return posixpath.normpath(re.sub(r"/+", "/", path)) if path.startswith("/") else posixpath.normpath(path)


def duplicate_paths(maps: Iterable[tuple[str, Mapping[str, Any]]], workdir: str | None = None) -> str | None:
    """A sentence naming two entries of ``(what, mapping)`` that write one sandbox path, or None."""
    seen: dict[str, str] = {}
    for what, mapping in maps:
        for path in mapping:
            key = sandbox_path_key(path, workdir)
            here = f"{what}[{path!r}]"
            if key in seen:
                return f"{seen[key]} and {here} both write the sandbox path {key}; keep one of them."
            seen[key] = here
    return None


# -- the worker's storage --------------------------------------------------------------------------------


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


def is_local(path: ObjectStoragePath) -> bool:
    """Whether ``path`` lives on the worker's own file systems (``file://``)."""
    protocol = path.fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def special_kind(local_path: str) -> str | None:
    """What is at ``local_path`` when it is neither a regular file, a directory nor a symlink; else None."""
    try:
        return special_kind_of(os.lstat(local_path).st_mode)
    except OSError:
        return None


def check_export_target(target: ObjectStoragePath, url: str, path: str) -> None:
    """
    Refuse, before anything runs, a destination an export cannot write.

    On local storage: one that exists and is not a regular file (a directory, device, named pipe or
    socket, which publishing by rename would replace), one below a regular file, and one whose nearest
    existing directory the worker cannot write. On other storage: one that is a directory (a prefix
    holding objects), as far as the store can tell.

    :raises SandboxTerminalError: naming the export, the destination and what to change.
    """
    lead = f"Cannot export {path!r} to {url}:"
    if not is_local(target):
        try:
            is_dir = target.is_dir()
        except Exception:  # a store that cannot tell before the write; the export itself checks again
            is_dir = False
        if is_dir:
            raise SandboxTerminalError(f"{lead} it is a directory. Name a file, e.g. {_example(url, path)}.")
        return
    local = target.path
    try:
        mode: int | None = os.lstat(local).st_mode
    except (FileNotFoundError, NotADirectoryError):  # below a file: _check_parent names it
        mode = None
    except OSError as err:
        raise SandboxTerminalError(f"{lead} the worker cannot look at it ({err.strerror}).") from err
    if mode is not None and stat.S_ISDIR(mode):
        raise SandboxTerminalError(f"{lead} it is a directory. Name a file, e.g. {_example(url, path)}.")
    if mode is not None and special_kind_of(mode):
        raise SandboxTerminalError(
            f"{lead} it exists and is {special_kind_of(mode)}, not a regular file, which an export would replace. Name a "
            "regular file."
        )
    _check_parent(local, lead)


def _check_parent(local: str, lead: str) -> None:
    parent = os.path.dirname(local)
    while True:
        try:
            info = os.stat(parent)
        except FileNotFoundError:
            up = os.path.dirname(parent)
            if up == parent:
                return
            parent = up
            continue
        except NotADirectoryError:
            info = None
        except OSError as err:
            raise SandboxTerminalError(f"{lead} the worker cannot look at {parent} ({err.strerror}).") from err
        if info is None or not stat.S_ISDIR(info.st_mode):
            blocker = _first_file_above(local)
            raise SandboxTerminalError(
                f"{lead} {blocker} is a file, not a directory, so nothing can be written below it. Name a path "
                "whose parents are directories."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise SandboxTerminalError(
                f"{lead} the worker cannot write into {parent}. Name a destination the worker's user may write, or "
                "give that user write access there."
            )
        return


def _first_file_above(local: str) -> str:
    here = "/"
    for part in [p for p in local.split("/") if p][:-1]:
        here = os.path.join(here, part)
        try:
            if not stat.S_ISDIR(os.stat(here).st_mode):
                return here
        except OSError:
            return here
    return os.path.dirname(local)


def _example(url: str, path: str) -> str:
    return url.rstrip("/") + "/" + path.rsplit("/", 1)[-1]


def same_local_file(targets: Mapping[str, tuple[str, ObjectStoragePath]]) -> str | None:
    """
    A sentence naming two exports whose local destinations are one file once symlinks in their
    directories are resolved (``/data/out`` and ``/srv/link-to-data/out``), or None.
    """
    seen: dict[str, tuple[str, str]] = {}
    for path, (url, target) in targets.items():
        if not is_local(target):
            continue
        real = os.path.join(os.path.realpath(os.path.dirname(target.path)), os.path.basename(target.path))
        if real in seen:
            other, other_url = seen[real]
            return (
                f"exports sends {other!r} to {other_url} and {path!r} to {url}, which are one file on this worker "
                f"({real}); give each its own destination."
            )
        seen[real] = (path, url)
    return None


# -- files of the worker as inputs -----------------------------------------------------------------------


def file_input_dirs() -> list[str] | None:
    """
    The directories ``file://`` inputs must lie in, from the Airflow option ``[sandbox] file_input_dirs``
    (``AIRFLOW__SANDBOX__FILE_INPUT_DIRS``): absolute paths separated by commas. None when unset: any
    file the worker's user can read may be staged.
    """
    raw = option(FILE_INPUT_DIRS_OPTION)
    dirs = [d.strip() for d in raw.split(",") if d.strip()]
    if not dirs:
        return None
    bad = [d for d in dirs if not d.startswith("/")]
    if bad:
        raise SandboxTerminalError(
            f"[sandbox] {FILE_INPUT_DIRS_OPTION} must list absolute directories separated by commas; these are not: "
            f"{bad!r}. Fix the Airflow configuration of this worker."
        )
    return [os.path.realpath(d) for d in dirs]


def _within(real: str, dirs: list[str]) -> bool:
    return any(real == d or real.startswith(d.rstrip("/") + "/") for d in dirs)


def resolve_file_input(local: str, url: str, what: str, *, inside: str | None = None) -> str:
    """
    The real path of a ``file://`` input: every symlink on the way followed, as the worker reads it.

    :param inside: the real path of the directory input ``local`` was found in: what it leads to must
        lie in there too (a link in a directory the author chose is not a choice of the author's).
    :raises SandboxTerminalError: when it is missing, not a regular file, outside ``inside``, or (with
        ``[sandbox] file_input_dirs`` set) outside the allowed directories once symlinks are followed.
    """
    real = os.path.realpath(local)
    if inside is not None and not _within(real, [inside]):
        raise SandboxTerminalError(_outside(url, real, inside))
    dirs = file_input_dirs()
    if dirs is not None and not _within(real, dirs):
        shown = url if real == local else f"{url} (which leads to {real})"
        raise SandboxTerminalError(
            f"{what} is {shown}, outside the directories this worker stages files from ([sandbox] "
            f"{FILE_INPUT_DIRS_OPTION}: {', '.join(dirs)}). Move the file there, or ask for the directory to be added."
        )
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise SandboxTerminalError(f"{what} is {url}, which does not exist on this worker.") from None
    except OSError as err:
        raise SandboxTerminalError(f"{what} is {url}, which the worker cannot read ({err.strerror}).") from err
    kind = "a directory" if stat.S_ISDIR(info.st_mode) else special_kind_of(info.st_mode)
    if kind:
        raise SandboxTerminalError(f"Input {url} is not a regular file ({kind}); stage a file instead.")
    return real


def _outside(url: str, real: str, inside: str) -> str:
    return (
        f"Input {url} is a symbolic link to {real}, outside the directory {inside} it is staged from. A directory "
        "input stages only what lies inside it; copy the file in, or stage it as an input of its own."
    )


def check_input_source(source: ObjectStoragePath, url: str, what: str) -> None:
    """Refuse, before anything is provisioned, a ``file://`` input that cannot be staged."""
    if is_local(source):
        resolve_file_input(source.path, url, what)


def open_file_input(local: str, url: str, what: str, *, inside: str | None = None):
    """
    Open a ``file://`` input for reading, following symlinks, and check again, on the open file, that
    it is a regular file inside the allowed directories and ``inside`` (see :func:`resolve_file_input`):
    a link swapped after the first check is caught.

    :returns: a binary file object.
    """
    real = resolve_file_input(local, url, what, inside=inside)
    fd = os.open(real, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SandboxTerminalError(f"Input {url} is not a regular file; stage a file instead.")
        dirs = file_input_dirs()
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if inside is not None and not _within(opened, [inside]):
            raise SandboxTerminalError(_outside(url, opened, inside))
        if dirs is not None and not _within(opened, dirs):
            raise SandboxTerminalError(
                f"{what} is {url}, which changed while it was opened and now leads to {opened}, outside [sandbox] "
                f"{FILE_INPUT_DIRS_OPTION}."
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
