"""guest/egress_forward.sh, run on the host under plain sh: socat in front of a Unix socket, then the command."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading

import pytest

from sandbox_provider.hooks.egress import guest

pytestmark = pytest.mark.skipif(shutil.which("socat") is None, reason="socat is not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_command_finds_the_port_listening_and_keeps_its_status(tmp_path):
    path = str(tmp_path / "gw.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def answer():
        conn, _ = server.accept()
        conn.sendall(b"from-the-socket")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    port = free_port()
    command = f"python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', {port})).recv(100).decode())\"; exit 7"
    argv = ["sh", "-c", guest.program("egress_forward.sh"), "sandbox-egress", str(port), path, "sh", "-c", command]
    # In a sandbox socat ends with the command's PID namespace; on the host, with the session made here.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        server.close()
    assert (proc.returncode, stdout) == (7, "from-the-socket\n"), stderr


def test_a_forwarder_that_does_not_start_stops_the_command(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "socat").write_text("#!/bin/sh\nexit 1\n")
    (fake / "socat").chmod(0o755)
    done = subprocess.run(
        ["sh", "-c", guest.program("egress_forward.sh"), "sandbox-egress", str(free_port()), str(tmp_path / "x.sock")]
        + ["sh", "-c", "echo ran"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{fake}:/usr/bin:/bin"},
    )
    assert done.returncode == 125 and done.stdout == ""
    assert "the egress forwarder (socat) did not start" in done.stderr
