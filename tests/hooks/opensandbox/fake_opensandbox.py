"""
``FakeOpenSandbox``: an OpenSandbox server and its sandboxes' daemons behind ``httpx.MockTransport``, for
the real ``opensandbox`` SDK (``ConnectionConfigSync(transport=fake.transport)``).

It answers the lifecycle API (``/v1/sandboxes...``), execd (``/proxy/44772/...``) and the egress sidecar
(``/proxy/18080/policy``) in the wire format measured against the real server and daemon (captured in
``reference/backend-sdks.md``): JSON bodies with the server's camelCase fields and error codes, and the
command stream as bare JSON objects each followed by a blank line. Endpoints point at
``sandbox-<id>.invalid`` hosts, which only this transport answers.

Like the vendor's daemon started with ``EXECD_ACCESS_TOKEN`` in its environment (the create request's
env here), a sandbox's execd answers 401 to a request without that token in ``X-EXECD-ACCESS-TOKEN``.
What a command prints (:func:`stdout`, :func:`stderr`, :func:`printed`) goes to its spool files
(``/tmp/<execution id>.stdout`` and ``.stderr``, left behind as the vendor's daemon leaves them, unless
``spool`` is False) and out as line events framed as the vendor frames them (the guest daemon's
``LineFramer``): a newline or carriage return ends a line, an empty line is sent as ``"\n"``.

What a command prints and how it ends is scripted per test with :meth:`FakeOpenSandbox.on_command`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.parser import BytesParser
from email.policy import HTTP

import httpx
from opensandbox_execd import LineFramer

from sandbox_provider.hooks.opensandbox.driver import TOKEN_ENV, TOKEN_HEADER, TOKEN_KEY

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _ms() -> int:
    return int(time.time() * 1000)


def event(kind: str, **fields) -> dict:
    """One execd stream event (the timestamp is added when it is sent)."""
    return {"type": kind, **fields}


@dataclass(frozen=True)
class Printed:
    """Bytes a command wrote to ``stream`` (``"stdout"`` or ``"stderr"``)."""

    stream: str
    data: bytes


def printed(stream: str, data: bytes) -> Printed:
    return Printed(stream, data)


def stdout(text: str) -> Printed:
    """A line the command printed to stdout, newline included (as ``echo`` prints it)."""
    return Printed("stdout", text.encode() + b"\n")


def stderr(text: str) -> Printed:
    return Printed("stderr", text.encode() + b"\n")


def complete() -> dict:
    return event("execution_complete", execution_time=1)


def failed(value: str, traceback: str) -> dict:
    return event("error", error={"ename": "CommandExecError", "evalue": value, "traceback": [traceback]})


def exits(code: int) -> dict:
    """The end of a command that exited with ``code``, as execd reports it."""
    return complete() if code == 0 else failed(str(code), f"exit status {code}")


@dataclass
class FakeSandbox:
    id: str
    body: dict
    metadata: dict
    expires_at: datetime
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp"})
    state: str = "Running"
    token: str | None = None


class FakeOpenSandbox:
    """
    :param egress_mode: the ``enforcementMode`` the egress sidecar reports (``dns`` or ``dns+nft``).
    """

    def __init__(self, *, egress_mode: str = "dns+nft") -> None:
        self.egress_mode = egress_mode
        #: What the sidecar reports as its policy; None reports the one the sandbox was created with.
        self.reported_policy: dict | None = None
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.requests: list[httpx.Request] = []
        self.commands: list[dict] = []
        self.ping_delay = 0.0
        #: False: the daemon leaves no output files behind (newer vendor daemons remove them).
        self.spool = True
        self.create_error: tuple[int, dict] | None = None
        self.release = threading.Event()  # unblocks a stalled stream at the end of a test
        self._script: Callable[[str, dict], Iterable[dict | Exception]] = lambda command, body: [complete()]
        self.transport = httpx.MockTransport(self._handle)

    # -- scripting --------------------------------------------------------------------------------------

    def on_command(self, script: Callable[[str, dict], Iterable[dict | Exception]]) -> None:
        """``script(command, request_body)`` yields events (dicts), or an exception to break the stream."""
        self._script = script

    def paths(self, method: str | None = None) -> list[str]:
        return [r.url.path for r in self.requests if method is None or r.method == method]

    def add(self, *, metadata: dict | None = None, token: str | None = "made-elsewhere") -> FakeSandbox:
        """A sandbox that exists on the server already (made by another worker, say, with its token)."""
        sandbox = FakeSandbox(
            str(uuid.uuid4()),
            {},
            {**({TOKEN_KEY: token} if token else {}), **(metadata or {})},
            datetime.now(UTC) + timedelta(hours=1),
            dirs={"/", "/tmp", "/workspace"},
            token=token,
        )
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    # -- routing ----------------------------------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        host, path = request.url.host, request.url.path
        if host.startswith("sandbox-") and host.endswith(".invalid"):
            sandbox = self.sandboxes.get(host.removeprefix("sandbox-").removesuffix(".invalid"))
            if sandbox is None:
                raise httpx.ConnectError("connection refused (the sandbox's container is gone)", request=request)
            if path.startswith("/proxy/18080/"):
                return self._egress(sandbox, path.removeprefix("/proxy/18080"))
            return self._execd(sandbox, request, path.removeprefix("/proxy/44772"))
        return self._lifecycle(request, path.removeprefix("/v1"))

    def _not_found(self, sandbox_id: str) -> httpx.Response:
        return httpx.Response(
            404, json={"code": "DOCKER::SANDBOX_NOT_FOUND", "message": f"Sandbox {sandbox_id} not found."}
        )

    def _view(self, sandbox: FakeSandbox) -> dict:
        now = _iso(datetime.now(UTC))
        return {
            "id": sandbox.id,
            "image": {"uri": sandbox.body.get("image", {}).get("uri", "python:3.12-slim")},
            "status": {"state": sandbox.state, "reason": "CONTAINER_RUNNING", "message": "", "lastTransitionAt": now},
            "metadata": dict(sandbox.metadata),
            "entrypoint": ["tail", "-f", "/dev/null"],
            "expiresAt": _iso(sandbox.expires_at),
            "createdAt": now,
        }

    def _lifecycle(self, request: httpx.Request, path: str) -> httpx.Response:
        parts = path.strip("/").split("/")
        if parts == ["sandboxes"] and request.method == "POST":
            return self._create(json.loads(request.content))
        if parts == ["sandboxes"] and request.method == "GET":
            return self._list_sandboxes(request)
        sandbox = self.sandboxes.get(parts[1]) if len(parts) > 1 else None
        if sandbox is None:
            return self._not_found(parts[1] if len(parts) > 1 else "")
        if len(parts) == 2 and request.method == "GET":
            return httpx.Response(200, json=self._view(sandbox))
        if len(parts) == 2 and request.method == "DELETE":
            del self.sandboxes[sandbox.id]
            return httpx.Response(204)
        if parts[2:3] == ["endpoints"]:
            return httpx.Response(200, json={"endpoint": f"sandbox-{sandbox.id}.invalid/proxy/{parts[3]}"})
        if parts[2:] == ["metadata"] and request.method == "PATCH":
            return self._patch(sandbox, json.loads(request.content))
        return httpx.Response(404, json={"code": "NOT_FOUND", "message": f"no route {request.method} {path}"})

    def _list_sandboxes(self, request: httpx.Request) -> httpx.Response:
        """The lifecycle API's listing, two sandboxes a page (so a client's paging is exercised)."""
        page, size = int(request.url.params.get("page", 1)), 2
        views = [self._view(s) for s in self.sandboxes.values()]
        pages = max(1, -(-len(views) // size))
        pagination = {
            "page": page,
            "pageSize": size,
            "totalItems": len(views),
            "totalPages": pages,
            "hasNextPage": page < pages,
        }
        return httpx.Response(200, json={"items": views[(page - 1) * size : page * size], "pagination": pagination})

    def _create(self, body: dict) -> httpx.Response:
        if self.create_error is not None:
            status, payload = self.create_error
            return httpx.Response(status, json=payload)
        if body.get("timeout") is not None and body["timeout"] < 60:
            detail = {"type": "greater_than_equal", "loc": ["body", "timeout"], "msg": "Input should be greater"}
            return httpx.Response(422, json={"detail": [{**detail, "input": body["timeout"], "ctx": {"ge": 60}}]})
        bad = self._bad_labels(body.get("metadata") or {})
        if bad:
            return bad
        sandbox = FakeSandbox(
            str(uuid.uuid4()),
            body,
            dict(body.get("metadata") or {}),
            datetime.now(UTC) + timedelta(seconds=body.get("timeout") or 600),
            token=(body.get("env") or {}).get(TOKEN_ENV),
        )
        self.sandboxes[sandbox.id] = sandbox
        view = self._view(sandbox)
        view.pop("image")
        return httpx.Response(202, json=view)

    def _bad_labels(self, metadata: dict) -> httpx.Response | None:
        for key, value in metadata.items():
            if value is None:
                continue
            name = key.rsplit("/", 1)[-1]
            if (
                len(name) > 63
                or not _LABEL_NAME.fullmatch(name)
                or len(value) > 63
                or not _LABEL_VALUE.fullmatch(value)
            ):
                message = f"Metadata value '{value}' is invalid: must be 63 characters or less"
                return httpx.Response(400, json={"code": "INVALID_METADATA_LABEL", "message": message})
        return None

    def _patch(self, sandbox: FakeSandbox, patch: dict) -> httpx.Response:
        bad = self._bad_labels(patch)
        if bad:
            return bad
        for key, value in patch.items():
            if value is None:
                sandbox.metadata.pop(key, None)
            else:
                sandbox.metadata[key] = value
        return httpx.Response(200, json=self._view(sandbox))

    # -- the egress sidecar -----------------------------------------------------------------------------

    def _egress(self, sandbox: FakeSandbox, path: str) -> httpx.Response:
        if path != "/policy":
            return httpx.Response(404, text="404 page not found")
        policy = self.reported_policy if self.reported_policy is not None else sandbox.body.get("networkPolicy")
        body = {"status": "ok", "mode": "enforcing", "enforcementMode": self.egress_mode, "policy": policy}
        return httpx.Response(200, json=body)

    # -- execd ------------------------------------------------------------------------------------------

    def _execd(self, sandbox: FakeSandbox, request: httpx.Request, path: str) -> httpx.Response:
        if sandbox.token and request.headers.get(TOKEN_HEADER) != sandbox.token:
            return httpx.Response(401, json={"error": f"Unauthorized: {TOKEN_HEADER} is missing or wrong"})
        if path == "/ping":
            time.sleep(self.ping_delay)
            return httpx.Response(200, json="pong")
        if path == "/command":
            body = json.loads(request.content)
            self.commands.append(body)
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
                stream=_EventStream(self._events(sandbox, body)),
            )
        if path == "/files" and request.method == "DELETE":
            return self._remove(sandbox, request.url.params.get_list("path"))
        if path == "/directories" and request.method == "POST":
            sandbox.dirs.update(json.loads(request.content))
            return httpx.Response(200, json=None)
        if path == "/files/info":
            return self._info(sandbox, request.url.params.get_list("path"))
        if path == "/files/download":
            return self._download(sandbox, request)
        if path == "/files/upload":
            return self._upload(sandbox, request)
        if path == "/directories/list":
            return self._list(sandbox, request.url.params["path"])
        return httpx.Response(404, json={"code": "NOT_SUPPORTED", "message": path})

    def _events(self, sandbox: FakeSandbox, body: dict) -> Iterator[bytes]:
        execution_id = uuid.uuid4().hex
        spools = {stream: f"/tmp/{execution_id}.{stream}" for stream in ("stdout", "stderr")}
        if self.spool:
            sandbox.files.update(dict.fromkeys(spools.values(), b""))
        framers = {stream: LineFramer() for stream in spools}
        yield _frame(event("init", text=execution_id))
        for item in self._script(body["command"], body):
            if isinstance(item, BaseException):
                raise item
            if item == "stall":
                self.release.wait(60)
                return
            if isinstance(item, Printed):
                if self.spool:
                    sandbox.files[spools[item.stream]] += item.data
                for text in framers[item.stream].feed(item.data):
                    yield _frame(event(item.stream, text=text))
                continue
            if item.get("type") in ("error", "execution_complete"):
                for stream, framer in framers.items():  # the command ended: a last line without its end
                    for text in framer.finish():
                        yield _frame(event(stream, text=text))
            yield _frame(item)

    def _remove(self, sandbox: FakeSandbox, paths: list[str]) -> httpx.Response:
        for path in paths:
            if path in sandbox.dirs:
                message = f"could not remove {path}: remove {path}: is a directory"
                return httpx.Response(500, json={"code": "RUNTIME_ERROR", "message": message})
            sandbox.files.pop(path, None)
        return httpx.Response(200, json=None)

    def _entry(self, sandbox: FakeSandbox, path: str) -> dict | None:
        now = _iso(datetime.now(UTC))
        base = {"path": path, "owner": "root", "group": "root", "modified_at": now, "created_at": now}
        if path in sandbox.files:
            return {**base, "type": "file", "size": len(sandbox.files[path]), "mode": 644}
        if path in sandbox.dirs:
            return {**base, "type": "directory", "size": 4096, "mode": 755}
        return None

    def _info(self, sandbox: FakeSandbox, paths: list[str]) -> httpx.Response:
        found = {}
        for path in paths:
            entry = self._entry(sandbox, path)
            if entry is None:
                message = f"no such file: lstat {path}: no such file or directory"
                return httpx.Response(404, json={"code": "FILE_NOT_FOUND", "message": message})
            found[path] = entry
        return httpx.Response(200, json=found)

    def _download(self, sandbox: FakeSandbox, request: httpx.Request) -> httpx.Response:
        path = request.url.params["path"]
        if path not in sandbox.files:
            return httpx.Response(
                404, json={"code": "FILE_NOT_FOUND", "message": f"no such file: open {path}: no such file or directory"}
            )
        data = sandbox.files[path]
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("range", ""))
        if match is None:
            return httpx.Response(200, content=data, headers={"content-type": "application/octet-stream"})
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else len(data) - 1, len(data) - 1)
        if start >= len(data):
            return httpx.Response(416, headers={"content-range": f"bytes */{len(data)}"})
        headers = {"content-range": f"bytes {start}-{end}/{len(data)}"}
        return httpx.Response(206, content=data[start : end + 1], headers=headers)

    def _upload(self, sandbox: FakeSandbox, request: httpx.Request) -> httpx.Response:
        head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
        message = BytesParser(policy=HTTP).parsebytes(head + request.read())
        meta = None
        for part in message.iter_parts():
            if part.get_param("name", header="content-disposition") == "metadata":
                meta = json.loads(part.get_payload(decode=True))
            elif meta is not None:
                if meta["path"] in sandbox.dirs:
                    message = f"could not write {meta['path']}: open {meta['path']}: is a directory"
                    return httpx.Response(500, json={"code": "RUNTIME_ERROR", "message": message})
                sandbox.files[meta["path"]] = part.get_payload(decode=True)
                meta = None
        return httpx.Response(200, json=None)

    def _list(self, sandbox: FakeSandbox, path: str) -> httpx.Response:
        if path not in sandbox.dirs:
            return httpx.Response(
                404, json={"code": "FILE_NOT_FOUND", "message": f"no such file: open {path}: no such file or directory"}
            )
        prefix = path.rstrip("/") + "/"
        names = {p for p in [*sandbox.files, *sandbox.dirs] if p.startswith(prefix) and "/" not in p[len(prefix) :]}
        return httpx.Response(200, json=[self._entry(sandbox, name) for name in sorted(names) if name != path])


def _frame(item: dict) -> bytes:
    return json.dumps({**item, "timestamp": _ms()}).encode() + b"\n\n"


class _EventStream(httpx.SyncByteStream):
    def __init__(self, frames: Iterator[bytes]) -> None:
        self._frames = frames

    def __iter__(self) -> Iterator[bytes]:
        yield from self._frames
