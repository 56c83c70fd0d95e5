"""
Processes of a stand-in hosted VM: commands see a directory of the test's as their ``/``.

The Islo and Boat stand-ins keep each sandbox's files in a directory on the host, which their file
APIs read and write. Commands run in a bubblewrap mount namespace whose root is that directory,
with the host's system directories read-only over it, so a path means the same file to a command
and to the file API (``/tmp/x`` is the sandbox's, never the host's). Processes are host processes
otherwise: no PID namespace, so background jobs outlive the command, as in a VM, and the host's
network unless the sandbox has none (a network namespace of its own, loopback only).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: Host directories shown read-only (or linked, where the host links them) at the same place.
SYSTEM = ("usr", "bin", "lib", "lib32", "lib64", "libx32", "sbin", "etc")


def spawn(
    argv: list[str], *, root: Path, cwd: str, env: dict[str, str], network: bool = True, **popen: object
) -> subprocess.Popen:
    """
    Start ``argv`` with ``root`` as its ``/`` and ``cwd`` (a guest path) as its working directory;
    ``network=False`` gives it a network namespace of its own (no route out, the host's loopback unseen).
    """
    args = ["bwrap", "--unshare-user-try", "--die-with-parent", "--bind", str(root), "/"]
    if not network:
        args.append("--unshare-net")
    for name in SYSTEM:
        path = "/" + name
        if os.path.islink(path):
            _ensure(lambda: os.symlink(os.readlink(path), root / name))  # noqa: B023
        elif os.path.isdir(path):
            _ensure(lambda: (root / name).mkdir())  # noqa: B023
            args += ["--ro-bind", path, path]
    for name in ("dev", "proc"):
        _ensure(lambda: (root / name).mkdir())  # noqa: B023
    args += ["--dev", "/dev", "--proc", "/proc", "--chdir", cwd, "--", *argv]
    return subprocess.Popen(args, env=env, **popen)


def _ensure(make) -> None:
    """Make a mount point or link in the guest root once; commands starting at once may race for it."""
    try:
        make()
    except FileExistsError:
        pass
