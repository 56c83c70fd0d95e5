"""
A stand-in for Boat's public API, on a loopback ``http.server``, for the real ``boat-sdk`` client.

:class:`FakeBoat` answers the wire JSON the SDK's strict models parse (camelCase fields, exact
``type`` values, required fields present): create (``Idempotency-Key`` honoured), get, rename,
delete (the confirmation header required; asynchronous: the sandbox is "archiving" until
:meth:`FakeBoat.finish_deletions`), synchronous commands and native file writes. Each sandbox is a
directory on the host that is the guest's ``/``: the file API writes there, and commands really run
under ``sh -c`` with it as their root (:mod:`tests.hooks.guest_vm`), in ``/home/user``, so output,
exit statuses, files and paths are real. Like the service, a
command's ``timeoutSeconds`` is enforced (the process group is killed and ``timedOut`` set), its
streams are capped (:attr:`FakeBoat.output_cap`, head kept, ``stdoutTruncated``), and writes take
only paths under ``/home/user`` or ``/tmp`` and bodies up to 5 MiB.

Faults (:meth:`FakeBoat.fail`) per route: a status with ``Retry-After`` before or after the request
took effect, a response dropped after it took effect, a request accepted and never answered, or a
canned answer.
"""

from __future__ import annotations

import base64
import json
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import guest_vm
import pytest
from fake_service import Fault, FaultInjection, kill_running

API_KEY = "boat_test_key"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOME = "/home/user"
WRITE_ROOTS = (HOME, "/tmp")
#: Largest request body the file API takes, in bytes.
WRITE_BODY_CAP = 5 * 1024 * 1024
#: Boat's command deadline cap, in seconds.
COMMAND_CAP = 600
_ID_ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"
#: How long a request that is never answered holds its connection, at most (the fake's close ends it sooner).
HANG_LIMIT = 120


@dataclass
class FakeBoatSandbox:
    id: str
    root: Path
    request: dict[str, Any]
    name: str = ""
    state: str = "ready"
    polls_until_ready: int = 0
    deletion: dict[str, Any] | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)

    def host_path(self, guest_path: str) -> Path:
        return self.root / posixpath.normpath(posixpath.join(HOME, guest_path)).lstrip("/")


class FakeBoat(FaultInjection):
    """Boat on ``127.0.0.1``. ``attempts`` lists ``(method, route)`` of every request that reached it."""

    #: The routes :meth:`fail` takes.
    ROUTES = ("create", "get", "update", "delete", "command", "write")

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.sandboxes: dict[str, FakeBoatSandbox] = {}
        self.idempotency: dict[str, str] = {}
        #: Bytes of each stream Boat keeps from a command (the head).
        self.output_cap = 8 * 1024 * 1024
        #: Sandboxes created from now on report "provisioning" to this many GETs first.
        self.provisioning_polls = 0
        #: Guest directories the file API refuses to write under (as Boat does where a link leads out).
        self.refuse_writes_under: list[str] = []
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True, name="fake-boat"
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The API's base URL, as ``Configuration(host=...)`` takes it."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/api/v1"

    def api(self, *, retries=None, api_key: str = API_KEY):
        """A real ``boat_sdk.BoatApi`` pointed at this server."""
        import boat_sdk

        config = boat_sdk.Configuration(host=self.url, access_token=api_key, retries=retries)
        return boat_sdk.BoatApi(boat_sdk.ApiClient(config))

    def finish_deletions(self) -> None:
        """Let every asynchronous delete complete: those sandboxes are gone (404) from now on."""
        for sandbox_id in [s.id for s in self.sandboxes.values() if s.deletion]:
            del self.sandboxes[sandbox_id]

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        for sandbox in self.sandboxes.values():
            _kill(sandbox)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- dispatch --------------------------------------------------------------------------------------

    def serve(self, method: str, parts: list[str], headers, body: bytes) -> tuple[int, Any]:
        route, sandbox_id = _route(method, parts)
        if route == "create":
            return self._create(json.loads(body or b"{}"), headers.get("Idempotency-Key"))
        sandbox = self.sandboxes.get(sandbox_id or "")
        if sandbox is None:
            return _error(404, "sandbox_not_found", f"no sandbox {sandbox_id}")
        if route == "get":
            if sandbox.polls_until_ready > 0:
                sandbox.polls_until_ready -= 1
                if not sandbox.polls_until_ready:
                    sandbox.state = "ready"
            return 200, {"ok": True, "type": "sandbox", "sandbox": _sandbox_json(sandbox)}
        if route == "update":
            sandbox.name = json.loads(body).get("name", sandbox.name)
            return 200, {"ok": True, "type": "sandbox", "sandbox": _sandbox_json(sandbox)}
        if route == "delete":
            return self._delete(sandbox, headers.get("X-Ascii-Confirm-Delete"))
        if sandbox.state != "ready":
            return _error(409, "sandbox_not_ready", f"sandbox is {sandbox.state}")
        if route == "command":
            return self._command(sandbox, json.loads(body))
        if route == "write":
            return self._write(sandbox, body)
        return _error(404, "not_found", f"no route {method} /{'/'.join(parts)}")

    # -- routes ----------------------------------------------------------------------------------------

    def _create(self, body: dict[str, Any], key: str | None) -> tuple[int, Any]:
        if key and key in self.idempotency and self.idempotency[key] in self.sandboxes:
            sandbox = self.sandboxes[self.idempotency[key]]
        else:
            sandbox_id = "bx_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
            sandbox = FakeBoatSandbox(id=sandbox_id, root=self.root / sandbox_id, request=body)
            sandbox.name = body.get("name") or sandbox_id
            if self.provisioning_polls:
                sandbox.state, sandbox.polls_until_ready = "provisioning", self.provisioning_polls
            for folder in (HOME, "/tmp"):
                sandbox.host_path(folder).mkdir(parents=True, exist_ok=True)
            self.sandboxes[sandbox_id] = sandbox
            if key:
                self.idempotency[key] = sandbox_id
        status = "ready" if sandbox.state == "ready" else "provisioning"
        payload = {"ok": True, "type": "sandbox.created", "status": status, "sandbox": _sandbox_json(sandbox)}
        return 202, {**payload, "ttlSeconds": sandbox.request.get("ttlSeconds")}

    def _delete(self, sandbox: FakeBoatSandbox, confirm: str | None) -> tuple[int, Any]:
        if confirm != sandbox.id:
            return _error(400, "confirmation_required", "X-Ascii-Confirm-Delete must repeat the sandbox id")
        if sandbox.deletion is None:
            _kill(sandbox)
            shutil.rmtree(sandbox.root, ignore_errors=True)
            sandbox.state = "archiving"
            sandbox.deletion = {
                "id": "bdop_" + secrets.token_hex(16),
                "kind": "sandbox",
                "targetId": sandbox.id,
                "reason": "explicit",
                "status": "pending",
                "attemptCount": 0,
                "requestedAt": _now(),
                "completedAt": None,
            }
        return 202, {"ok": True, "type": "sandbox.deleting", "operation": sandbox.deletion}

    def _command(self, sandbox: FakeBoatSandbox, body: dict[str, Any]) -> tuple[int, Any]:
        deadline = body.get("timeoutSeconds", 120)
        if not isinstance(deadline, int) or not 1 <= deadline <= COMMAND_CAP:
            return _error(400, "invalid_timeout", "timeoutSeconds must be an integer in 1-600")
        sandbox.commands.append(body)
        cwd = body.get("cwd") or HOME
        env = {
            "PATH": GUEST_PATH,
            "HOME": HOME,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            **(sandbox.request.get("env") or {}),
        }
        started = _now()
        process = guest_vm.spawn(
            ["sh", "-c", body["command"]],
            root=sandbox.root,
            cwd=posixpath.normpath(posixpath.join(HOME, cwd)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        sandbox.processes.append(process)
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        code = process.returncode
        cap = self.output_cap
        return 200, {
            "ok": True,
            "type": "command.finished",
            "success": code == 0 and not timed_out,
            "commandId": "cmd_" + secrets.token_hex(8),
            "exitCode": code if code >= 0 else None,
            "signal": signal.Signals(-code).name if code < 0 else None,
            "oomKilled": False,
            "stdout": stdout[:cap].decode(errors="replace"),
            "stderr": stderr[:cap].decode(errors="replace"),
            "stdoutTruncated": len(stdout) > cap,
            "stderrTruncated": len(stderr) > cap,
            "timedOut": timed_out,
            "cwd": cwd,
            "startedAt": started,
            "finishedAt": _now(),
        }

    def _write(self, sandbox: FakeBoatSandbox, body: bytes) -> tuple[int, Any]:
        if len(body) > WRITE_BODY_CAP:
            return _error(413, "payload_too_large", "file writes take at most 5 MiB; use an upload URL")
        request = json.loads(body)
        path = posixpath.normpath(posixpath.join(HOME, request["path"]))
        allowed = any(path == root or path.startswith(root + "/") for root in WRITE_ROOTS)
        refused = any(path == root or path.startswith(root + "/") for root in self.refuse_writes_under)
        if not allowed or refused:
            return _error(400, "invalid_path", "paths must resolve under /home/user or /tmp")
        encoding = request.get("encoding") or "utf8"
        data = base64.b64decode(request["content"]) if encoding == "base64" else request["content"].encode()
        target = sandbox.host_path(path)
        if target.is_dir():
            return _error(400, "is_directory", f"{path} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        payload = {"ok": True, "type": "file.written", "success": True, "path": path, "encoding": encoding}
        return 200, {**payload, "size": len(data)}


def _handler_for(service: FakeBoat) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # keep test output clean
            pass

        def _dispatch(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?", 1)[0]
            parts = [p for p in path.split("/") if p][2:]  # past /api/v1
            route, _ = _route(self.command, parts)
            service.attempts.append((self.command, route))
            fault = service.take_fault(route)
            if fault and fault.hang:
                service._closing.wait(HANG_LIMIT)
                self.close_connection = True
                return
            if fault and fault.status and not fault.after:
                return self._send(*_fault(fault))
            if fault and fault.body is not None:
                return self._send(200, fault.body)
            if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                return self._send(*_error(401, "unauthorized", "missing or wrong API key"))
            status, payload = service.serve(self.command, parts, self.headers, body)
            if fault and fault.drop:
                self.close_connection = True
                return
            if fault and fault.status:
                return self._send(*_fault(fault))
            self._send(status, payload)

        def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    return Handler


def _route(method: str, parts: list[str]) -> tuple[str, str | None]:
    if parts == ["sandboxes"]:
        return ("create" if method == "POST" else "list"), None
    if len(parts) >= 2 and parts[0] == "sandboxes":
        table = {
            ("GET", ()): "get",
            ("PATCH", ()): "update",
            ("DELETE", ()): "delete",
            ("POST", ("commands",)): "command",
            ("PUT", ("files",)): "write",
            ("GET", ("files",)): "read",
        }
        return table.get((method, tuple(parts[2:])), "unknown"), parts[1]
    return "unknown", None


def _sandbox_json(sandbox: FakeBoatSandbox) -> dict[str, Any]:
    return {
        "id": sandbox.id,
        "name": sandbox.name,
        "state": sandbox.state,
        "type": sandbox.request.get("type") or "default",
        "ttlSeconds": sandbox.request.get("ttlSeconds"),
        "snapshots": sandbox.request.get("snapshots"),
        "desktopAvailable": False,
        "snapshotAvailable": False,
        "createdAt": _now(),
    }


def _error(status: int, code: str, message: str) -> tuple[int, Any]:
    error = {"code": code, "message": message, "status": status}
    envelope = {"ok": False, "type": "error", "requestId": "req_" + secrets.token_hex(6), "error": error}
    return status, {**envelope, "status": status, "code": code, "message": message}


def _fault(fault: Fault) -> tuple[int, Any, dict[str, str]]:
    status, payload = _error(fault.status, "injected", "injected failure")
    return status, payload, {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}


def _kill(sandbox: FakeBoatSandbox) -> None:
    kill_running(sandbox.processes)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@pytest.fixture
def boat_service(tmp_path):
    """The Boat stand-in, on a loopback port of its own."""
    service = FakeBoat(tmp_path / "boat")
    yield service
    service.close()


@pytest.fixture
def boat_hook(boat_service, add_connection):
    """
    A factory of ``BoatSandboxHook`` instances that talk to ``boat_service`` through the real SDK: a
    ``sandbox_boat`` connection (``conn_id``, default the hook's default) names its URL and key, with
    ``extra`` as its extras; keyword arguments go to the hook.
    """
    from sandbox_provider.hooks.boat import BoatSandboxHook

    def make(conn_id: str = "sandbox_boat_default", *, extra: dict | None = None, **kwargs) -> BoatSandboxHook:
        add_connection(conn_id, "sandbox_boat", host=boat_service.url, password=API_KEY, extra=extra or {})
        return BoatSandboxHook(conn_id, **kwargs)

    return make
