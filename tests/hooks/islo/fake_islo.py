"""
A stand-in for the Islo service behind the real ``islo`` SDK, at its HTTP transport.

:class:`FakeIslo` answers the control and compute APIs through ``httpx.MockTransport``: create, get
and delete sandboxes, asynchronous exec with polled results, file download and upload. A test can set a
sandbox's ``status`` (``"paused"``, say): activity resumes a paused sandbox whose lifecycle says
``auto_resume="on_activity"``, and is refused (409) otherwise. Each
sandbox is a directory on the host that is the guest's ``/``: the file API reads and writes there,
and commands really run with it as their root (:mod:`tests.hooks.guest_vm`), in the sandbox's
working directory, so output, exit statuses, files and paths are real; a sandbox created with
``internet_enabled=False`` runs them in a network namespace of its own. Like the service, it caps each captured stream at 1 MiB
(keeping the head, and saying ``truncated``), overwrites ``PATH``, and ignores ``timeout_secs``.

The API-key exchange does not go through the client's ``httpx_client``: the SDK posts it with
module-level ``httpx.post``. :meth:`FakeIslo.install` routes that through the same transport and
empties the SDK's process-wide token cache.

Faults (:meth:`FakeIslo.fail`) are injected per route: an HTTP status (with ``Retry-After``) before
or after the request took effect, a dropped response after it took effect, a connection that never
reaches the service, or a canned answer (a result that stays "running", say).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import os
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import guest_vm
import httpx
import pytest
from fake_service import Fault, FaultInjection, kill_running

CONTROL_URL = "https://api.islo.test"
COMPUTE_URL = "https://compute.islo.test"
API_KEY = "ak_test_key"
SESSION_TOKEN = "st_test_session"
#: The service keeps at most this many bytes of each stream of a command.
STREAM_CAP = 1024 * 1024
#: What the service sets ``PATH`` to, whatever the sandbox's env says.
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_WORKDIR = "/workspace"


@dataclass
class FakeExec:
    id: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    done: threading.Event = field(default_factory=threading.Event)
    exit_code: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    failure: str | None = None


@dataclass
class FakeIsloSandbox:
    name: str
    id: str
    root: Path
    request: dict[str, Any]
    status: str = "running"
    polls_until_running: int = 0
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    execs: dict[str, FakeExec] = field(default_factory=dict)

    @property
    def workdir(self) -> str:
        return self.request.get("workdir") or DEFAULT_WORKDIR

    def host_path(self, guest_path: str) -> Path:
        """The host file standing for ``guest_path`` (absolute, or relative to the workdir)."""
        joined = os.path.normpath(os.path.join(self.workdir, guest_path))
        return self.root / joined.lstrip("/")


class FakeIslo(FaultInjection):
    """The Islo service for one test. ``attempts`` lists ``(method, route)`` of every request that reached it."""

    #: The routes :meth:`fail` takes.
    ROUTES = ("token", "create", "get", "delete", "exec", "exec-result", "download", "upload")

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.sandboxes: dict[str, FakeIsloSandbox] = {}
        self.deleted: list[str] = []
        self.token_exchanges = 0
        #: The status new sandboxes start in; "starting" ones become "running" after ``starting_polls`` GETs.
        self.new_status = "running"
        self.starting_polls = 0
        self.transport = httpx.MockTransport(self._handle)

    # -- set-up ----------------------------------------------------------------------------------------

    def install(self, monkeypatch) -> FakeIslo:
        """Route the SDK's API-key exchange here and forget tokens cached by earlier tests."""
        import islo.custom.auth as auth

        monkeypatch.setattr(auth.SyncTokenProvider, "_shared", {})
        monkeypatch.setattr(auth, "httpx", _ExchangeShim(self.transport))
        return self

    def client(self, **kwargs):
        """A real ``islo.Islo`` client wired to this service."""
        from islo import Islo

        kwargs.setdefault("api_key", API_KEY)
        return Islo(
            base_url=CONTROL_URL,
            compute_url=COMPUTE_URL,
            httpx_client=httpx.Client(transport=self.transport),
            **kwargs,
        )

    def close(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            self._kill(sandbox)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- transport -------------------------------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        route, name, rest = _route(request)
        fault = self.take_fault(route)
        if fault and fault.connect:
            raise httpx.ConnectError("connection refused (injected)", request=request)
        self.attempts.append((request.method, route))
        if fault and fault.status and not fault.after:
            return _fault_response(fault)
        if fault and fault.body is not None:
            return httpx.Response(200, json=fault.body)
        if route != "token" and request.headers.get("authorization") != f"Bearer {SESSION_TOKEN}":
            response = _error(401, "AUTH_REQUIRED", "missing or wrong session token")
        else:
            response = self._serve(route, request, name, rest)
        if fault and fault.drop:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if fault and fault.status:
            return _fault_response(fault)
        return response

    def _serve(self, route: str, request: httpx.Request, name: str | None, rest: str | None) -> httpx.Response:
        if route == "token":
            return self._token(request)
        if route == "create":
            return self._create(json.loads(request.read() or b"{}"))
        sandbox = self.sandboxes.get(name or "")
        if sandbox is None:
            return _error(404, "SANDBOX_NOT_FOUND", f"sandbox {name!r} not found")
        if route == "get":
            if sandbox.polls_until_running:
                sandbox.polls_until_running -= 1
                if not sandbox.polls_until_running:
                    sandbox.status = "running"
            return httpx.Response(200, json=_sandbox_json(sandbox))
        if route == "delete":
            self._kill(sandbox)
            del self.sandboxes[sandbox.name]
            self.deleted.append(sandbox.name)
            shutil.rmtree(sandbox.root, ignore_errors=True)
            return httpx.Response(204)
        lifecycle = sandbox.request.get("lifecycle") or {}
        if sandbox.status == "paused" and lifecycle.get("auto_resume") == "on_activity":
            sandbox.status = "running"  # activity resumes a paused sandbox
        if sandbox.status != "running":
            return _error(409, "SANDBOX_INVALID_STATE", f"sandbox is {sandbox.status}")
        if route == "exec":
            return self._exec(sandbox, json.loads(request.read()))
        if route == "exec-result":
            return self._exec_result(sandbox, rest or "")
        if route == "download":
            return self._download(sandbox, request.url.params.get("path", ""))
        if route == "upload":
            return self._upload(sandbox, request)
        return _error(404, "NOT_FOUND", f"no route for {request.method} {request.url.path}")

    # -- routes ----------------------------------------------------------------------------------------

    def _token(self, request: httpx.Request) -> httpx.Response:
        self.token_exchanges += 1
        if json.loads(request.read()).get("access_key") != API_KEY:
            return _error(401, "AUTH_REQUIRED", "unknown access key")
        return httpx.Response(200, json={"session_token": SESSION_TOKEN, "cookie_max_age": 600})

    def _create(self, body: dict[str, Any]) -> httpx.Response:
        name = body.get("name") or f"sb-{uuid.uuid4().hex[:8]}"
        if name in self.sandboxes:
            return _error(409, "SANDBOX_ALREADY_EXISTS", f"sandbox {name!r} already exists")
        root = self.root / name
        sandbox = FakeIsloSandbox(name=name, id=str(uuid.uuid4()), root=root, request=body, status=self.new_status)
        if self.starting_polls:
            sandbox.status, sandbox.polls_until_running = "starting", self.starting_polls
        for folder in (sandbox.host_path("."), root / "tmp", root / "root"):
            folder.mkdir(parents=True, exist_ok=True)
        self.sandboxes[name] = sandbox
        return httpx.Response(200, json=_sandbox_json(sandbox))

    def _exec(self, sandbox: FakeIsloSandbox, body: dict[str, Any]) -> httpx.Response:
        env = {"HOME": "/root", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        env.update({k: v for k, v in (sandbox.request.get("env") or {}).items() if v is not None})
        env.update({k: v for k, v in (body.get("env") or {}).items() if v is not None})
        env["PATH"] = GUEST_PATH
        record = FakeExec(id=f"ex-{uuid.uuid4().hex[:12]}", argv=list(body["command"]), env=env)
        cwd = os.path.normpath(os.path.join(sandbox.workdir, body.get("workdir") or "."))
        try:
            record.process = guest_vm.spawn(
                record.argv,
                root=sandbox.root,
                cwd=cwd,
                env=env,
                network=sandbox.request.get("internet_enabled", True) is not False,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            record.failure = str(err)
            record.done.set()
        else:
            threading.Thread(target=_collect, args=(record,), daemon=True).start()
        sandbox.execs[record.id] = record
        return httpx.Response(200, json={"exec_id": record.id, "sandbox_id": sandbox.id, "status": "running"})

    def _exec_result(self, sandbox: FakeIsloSandbox, exec_id: str) -> httpx.Response:
        record = sandbox.execs.get(exec_id)
        if record is None:
            return _error(404, "RESOURCE_NOT_FOUND", f"exec {exec_id!r} not found")
        if not record.done.is_set():
            body = {"exec_id": exec_id, "status": "running", "stdout": "", "stderr": "", "truncated": False}
            return httpx.Response(200, json={**body, "exit_code": None})
        if record.failure is not None:
            body = {"exec_id": exec_id, "status": "failed", "exit_code": None, "stdout": "", "truncated": False}
            return httpx.Response(200, json={**body, "stderr": record.failure})
        truncated = len(record.stdout) > STREAM_CAP or len(record.stderr) > STREAM_CAP
        return httpx.Response(
            200,
            json={
                "exec_id": exec_id,
                "status": "completed",
                "exit_code": record.exit_code,
                "stdout": record.stdout[:STREAM_CAP].decode(errors="replace"),
                "stderr": record.stderr[:STREAM_CAP].decode(errors="replace"),
                "truncated": truncated,
            },
        )

    def _download(self, sandbox: FakeIsloSandbox, path: str) -> httpx.Response:
        target = sandbox.host_path(path)
        if not target.is_file():
            if target.is_dir():
                return _error(400, "FILE_OPERATION_ERROR", f"{path} is a directory")
            return _error(404, "FILE_NOT_FOUND", f"{path} not found")
        return httpx.Response(200, content=target.read_bytes(), headers={"content-type": "application/octet-stream"})

    def _upload(self, sandbox: FakeIsloSandbox, request: httpx.Request) -> httpx.Response:
        parts = _multipart(request)
        if "file" not in parts:
            return _error(400, "INVALID_REQUEST", "no file part")
        target = sandbox.host_path(request.url.params.get("path", ""))
        if target.is_dir():
            return _error(400, "FILE_OPERATION_ERROR", "destination is a directory")
        if not target.parent.is_dir():
            return _error(404, "FILE_NOT_FOUND", "destination directory does not exist")
        target.write_bytes(parts["file"])
        return httpx.Response(200, json={"status": "uploaded"})

    def _kill(self, sandbox: FakeIsloSandbox) -> None:
        kill_running(record.process for record in sandbox.execs.values())


class _ExchangeShim:
    """Stands in for the ``httpx`` module inside ``islo.custom.auth``: its ``post`` goes to the fake."""

    def __init__(self, transport: httpx.MockTransport) -> None:
        self._client = httpx.Client(transport=transport)

    def post(self, url: str, **kwargs) -> httpx.Response:
        return self._client.post(url, **kwargs)


def _collect(record: FakeExec) -> None:
    record.stdout, record.stderr = record.process.communicate()
    record.exit_code = record.process.returncode if record.process.returncode >= 0 else 128 - record.process.returncode
    record.done.set()


def _route(request: httpx.Request) -> tuple[str, str | None, str | None]:
    parts = [p for p in request.url.path.split("/") if p]
    method = request.method
    if request.url.host == httpx.URL(CONTROL_URL).host:
        return ("token" if parts == ["auth", "token"] else "unknown"), None, None
    if parts == ["sandboxes"] and method == "POST":
        return "create", None, None
    if len(parts) >= 2 and parts[0] == "sandboxes":
        name, tail = parts[1], parts[2:]
        table = {
            ("GET", ()): "get",
            ("DELETE", ()): "delete",
            ("POST", ("exec",)): "exec",
            ("GET", ("files",)): "download",
            ("POST", ("files",)): "upload",
        }
        if method == "GET" and len(tail) == 2 and tail[0] == "exec":
            return "exec-result", name, tail[1]
        return table.get((method, tuple(tail)), "unknown"), name, None
    return "unknown", None, None


def _multipart(request: httpx.Request) -> dict[str, bytes]:
    head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + request.read())
    parts = {}
    for part in message.iter_parts():
        parts[part.get_param("name", header="content-disposition")] = part.get_payload(decode=True)
    return parts


def _sandbox_json(sandbox: FakeIsloSandbox) -> dict[str, Any]:
    request = sandbox.request
    return {
        "created_at": sandbox.created_at,
        "id": sandbox.id,
        "image": request.get("image") or "islo-default",
        "name": sandbox.name,
        "status": sandbox.status,
        "lifecycle": request.get("lifecycle"),
        "spec": {
            "disk_gb": request.get("disk_gb") or 10,
            "memory_mb": request.get("memory_mb") or 2048,
            "vcpus": request.get("vcpus") or 2,
        },
        "workdir": sandbox.workdir,
    }


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json={"code": code, "message": message}, headers=headers)


def _fault_response(fault: Fault) -> httpx.Response:
    headers = {"retry-after": fault.retry_after} if fault.retry_after is not None else None
    code = "RATE_LIMITED" if fault.status == 429 else "RESOURCE_UNAVAILABLE"
    return _error(fault.status, code, "injected failure", headers)


@pytest.fixture
def islo_service(tmp_path, monkeypatch):
    """The Islo stand-in, with the SDK's API-key exchange routed to it."""
    service = FakeIslo(tmp_path / "islo").install(monkeypatch)
    yield service
    service.close()


@pytest.fixture
def islo_hook(islo_service, add_connection, monkeypatch):
    """
    A factory of ``IsloSandboxHook`` instances that talk to ``islo_service`` through the real SDK: a
    ``sandbox_islo`` connection (``conn_id``, default the hook's default) names the stand-in's URLs and
    key, with ``extra`` merged in; keyword arguments go to the hook.
    """
    from sandbox_provider.hooks.islo import IsloSandboxHook

    monkeypatch.setattr(
        IsloSandboxHook,
        "_new_http_client",
        lambda self, timeout: httpx.Client(transport=islo_service.transport, timeout=timeout),
    )

    def make(conn_id: str = "sandbox_islo_default", *, extra: dict | None = None, **kwargs) -> IsloSandboxHook:
        add_connection(
            conn_id,
            "sandbox_islo",
            host=COMPUTE_URL,
            password=API_KEY,
            extra={"base_url": CONTROL_URL, **(extra or {})},
        )
        return IsloSandboxHook(conn_id, **kwargs)

    return make
