"""
The sweep of gateway directories on a worker (``egress.sweep_gateways``), which every Docker create
runs: it removes the directory of a gateway that has ended, never that of one still starting.
"""

from __future__ import annotations

import os
import subprocess
import time

from sandbox_provider.hooks import egress


def _directory(root, name: str, pid_file: str | None, *, age: float = 0.0) -> str:
    directory = root / name
    directory.mkdir()
    if pid_file is not None:
        (directory / egress.READY).write_text(pid_file)
    if age:
        then = time.time() - age
        os.utime(directory, (then, then))
    return str(directory)


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_gateway_writing_its_pid_is_left_and_an_ended_one_is_removed(tmp_path):
    # A gateway between creating its pid file and writing the pid: the file is there, and empty.
    # A sweep on the same worker (another task's create) that took it for an ended gateway removed
    # its directory, socket and all, while it served its sandbox.
    writing = _directory(tmp_path, "writing", "")
    ended = _directory(tmp_path, "ended", str(_ended_pid()))  # the control: a pid, no such gateway
    stale = _directory(tmp_path, "stale", "", age=egress.START_TIMEOUT * 3)  # never got further
    assert sorted(egress.sweep_gateways(str(tmp_path))) == ["ended", "stale"]
    assert os.path.isdir(writing)
    assert not os.path.exists(ended) and not os.path.exists(stale)
