#!/usr/bin/env python3
"""
The filesystem helper the Modal stand-in puts at ``/__modal/.bin/modal-sandbox-fs-tools`` in every
sandbox: the SDK's ``Sandbox.filesystem`` runs it through ``exec`` with one JSON argument naming the
operation, as a real Modal sandbox's helper is run.

Written for the stand-in from the behaviour the SDK expects (one JSON object argument such as
``{"WriteFile": {"path": "/abs"}}``; the file's bytes on stdin; a listing as a JSON array on stdout;
a failure as ``{"error_kind": ..., "message": ...}`` on stderr with a non-zero status). Only the
operations the provider's hook uses are here; any other exits 2 naming itself, so a hook that starts
using one makes its test fail with the operation's name.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys

CHUNK = 1024 * 1024

#: errno values and the error kind the SDK maps each to.
KINDS = {
    errno.ENOENT: "NotFound",
    errno.ENOTDIR: "NotDirectory",
    errno.EISDIR: "IsDirectory",
    errno.EACCES: "PermissionDenied",
    errno.EPERM: "PermissionDenied",
    errno.EROFS: "PermissionDenied",
    errno.EEXIST: "AlreadyExists",
}


def fail(kind: str, message: str) -> None:
    sys.stderr.write(json.dumps({"error_kind": kind, "message": message}))
    sys.exit(1)


def fail_os(err: OSError) -> None:
    fail(KINDS.get(err.errno or 0, "Other"), err.strerror or str(err))


def write_file(path: str) -> None:
    """Copy stdin to ``path``, making missing parent directories; a directory there is refused."""
    if os.path.isdir(path):
        fail("IsDirectory", "Is a directory")
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with open(path, "wb") as target:
            while chunk := sys.stdin.buffer.read(CHUNK):
                target.write(chunk)
    except OSError as err:
        fail_os(err)


def _entry(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        kind, target = "symlink", os.readlink(path)
    else:
        kind, target = ("directory" if stat.S_ISDIR(info.st_mode) else "file"), None
    return {
        "name": name,
        "path": path,
        "type": kind,
        "size": info.st_size,
        "mode": info.st_mode,
        "permissions": stat.filemode(info.st_mode),
        "owner": str(info.st_uid),
        "group": str(info.st_gid),
        "modified_time": int(info.st_mtime),
        "symlink_target": target,
    }


def list_files(path: str) -> None:
    """Print the entries of the directory ``path`` as a JSON array."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail("NotDirectory", "Not a directory")
    try:
        names = sorted(os.listdir(path))
        sys.stdout.write(json.dumps([_entry(path, name) for name in names]))
    except OSError as err:
        fail_os(err)


OPERATIONS = {"WriteFile": write_file, "ListFiles": list_files}


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        fail("InvalidArgument", "expected one JSON argument")
    command = json.loads(argv[1])
    ((operation, fields),) = command.items()
    handler = OPERATIONS.get(operation)
    if handler is None:
        sys.stderr.write(f"modal-sandbox-fs-tools stand-in: operation {operation!r} is not implemented\n")
        sys.exit(2)
    handler(fields["path"])


if __name__ == "__main__":
    main(sys.argv)
