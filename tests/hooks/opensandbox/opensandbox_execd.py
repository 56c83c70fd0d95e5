#!/usr/bin/env python3
"""
The project's guest daemon for OpenSandbox sandboxes: the part of the ``execd`` HTTP API that the
``opensandbox`` SDK uses for commands and files, on the Python standard library alone.

An OpenSandbox server copies ``/execd`` and ``/bootstrap.sh`` out of its configured execd image into
every sandbox and starts the daemon there; this file is that ``/execd`` for images built without a
registry. It runs inside the sandbox as the sandbox's user and claims no network enforcement.

Served (paths may carry the ``/proxy/<own port>`` prefix of the server's endpoints): ``GET /ping``;
``POST /command`` (JSON ``command`` or ``argv``, ``cwd``, ``timeout`` in milliseconds, ``envs``, ``uid``,
``gid``), which runs ``bash -c`` in its own process group and answers ``text/event-stream`` in execd's
framing (a JSON object then a blank line, chunked): ``init``, ``stdout``/``stderr`` one event per line
(newline stripped), ``ping`` every 3 s, then ``execution_complete`` or ``error`` (``CommandExecError``
with the exit status, or ``-1`` and ``signal: killed`` when the timeout killed the group or a signal the
shell); it returns when the shell exits, not waiting for children holding its output. ``POST
/files/upload`` (multipart ``metadata`` + ``file`` pairs, streamed, mode as octal digits such as 644);
``GET /files/download`` (one ``Range``; 416 for a range at or past the end, an empty file included);
``GET /files/info``, ``GET /directories/list``, ``POST /directories``.

Errors are JSON ``{"code", "message"}`` with execd's codes (``FILE_NOT_FOUND`` with 404, ...).

Needs Python 3.9 or newer. Usage: ``opensandbox_execd.py [--host 0.0.0.0] [--port 44772]``; port 0
picks a free one. ``opensandbox-execd listening on HOST:PORT`` goes to stderr once it accepts.
``EXECD_API_GRACE_SHUTDOWN`` (``1s``, ``500ms``; default 0) holds a finished command's stream open that
long, as the vendor's daemon does for one second.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from email.parser import HeaderParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

DEFAULT_PORT = 44772
PING_SECONDS = 3.0
CHUNK = 64 * 1024
_UTC = timezone.utc  # noqa: UP017 - datetime.UTC needs Python 3.11; guests may have 3.9
_PROXY_PREFIX = re.compile(r"^/proxy/(\d+)(/.*)?$")


class RequestError(Exception):
    """A request the daemon refuses: HTTP status, execd error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def now_ms() -> int:
    return int(time.time() * 1000)


def go_duration_seconds(text: str) -> float:
    """Seconds in a Go-style duration (``1s``, ``250ms``, ``1.5s``, ``0``); a bad value is 0."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", text or "")
    if not match:
        return 0.0
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def expand(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def octal_mode(mode) -> int | None:
    """execd's ``mode``: the octal digits written as a decimal number (644 → 0o644); 0 means unset."""
    if not mode:
        return None
    try:
        return int(str(int(mode)), 8)
    except ValueError as err:
        raise RequestError(400, "INVALID_REQUEST_BODY", f"mode {mode!r} is not octal digits") from err


def chown_names(path: str, owner: str | None, group: str | None) -> None:
    if not owner and not group:
        return
    uid = pwd.getpwnam(owner).pw_uid if owner else -1
    gid = grp.getgrnam(group).gr_gid if group else -1
    os.chown(path, uid, gid)


def file_info(path: str) -> dict:
    """execd's FileInfo for ``path`` (not following a final symlink)."""
    st = os.lstat(path)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    kinds = ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISREG, "file"))
    kind = next((name for test, name in kinds if test(st.st_mode)), "other")
    return {
        "path": path,
        "type": kind,
        "size": st.st_size,
        "modified_at": datetime.fromtimestamp(st.st_mtime, _UTC).isoformat(),
        "created_at": datetime.fromtimestamp(st.st_ctime, _UTC).isoformat(),
        "owner": owner,
        "group": group,
        "mode": int(oct(stat.S_IMODE(st.st_mode))[2:]),
    }


def not_found(err: OSError) -> RequestError:
    if isinstance(err, FileNotFoundError):
        return RequestError(404, "FILE_NOT_FOUND", f"file not found. {err}")
    return RequestError(500, "RUNTIME_ERROR", f"error accessing file: {err}")


class BodyReader:
    """A request body read incrementally, sized by Content-Length or sent chunked."""

    def __init__(self, rfile, headers) -> None:
        self._rfile = rfile
        self._chunked = "chunked" in (headers.get("Transfer-Encoding") or "").lower()
        self._left = int(headers.get("Content-Length") or 0)
        self._eof = False

    def read(self, size: int = CHUNK) -> bytes:
        if self._eof:
            return b""
        if self._chunked:
            if self._left == 0:
                line = self._rfile.readline(1024)
                if not line:
                    raise RequestError(400, "INVALID_REQUEST_BODY", "the chunked body ended early")
                self._left = int(line.split(b";")[0].strip() or b"0", 16)
                if self._left == 0:
                    while self._rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    self._eof = True
                    return b""
            data = self._rfile.read(min(size, self._left))
            self._left -= len(data)
            if self._left == 0:
                self._rfile.readline(1024)
            return data
        if self._left <= 0:
            self._eof = True
            return b""
        data = self._rfile.read(min(size, self._left))
        if not data:
            raise RequestError(400, "INVALID_REQUEST_BODY", "the body ended before its Content-Length")
        self._left -= len(data)
        return data

    def read_all(self, limit: int = 16 * 1024 * 1024) -> bytes:
        parts, total = [], 0
        while chunk := self.read():
            total += len(chunk)
            if total > limit:
                raise RequestError(413, "INVALID_REQUEST_BODY", f"the body is over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)


class Multipart:
    """A multipart/form-data body parsed as it streams; each part's content goes to a callback."""

    def __init__(self, body: BodyReader, boundary: str) -> None:
        self._body = body
        self._delim = b"\r\n--" + boundary.encode("latin-1")
        self._buf = b"\r\n"  # so the first delimiter looks like the others

    def _fill(self) -> bool:
        chunk = self._body.read()
        self._buf += chunk
        return bool(chunk)

    def _copy_until_delimiter(self, sink) -> None:
        keep = len(self._delim) - 1
        while True:
            at = self._buf.find(self._delim)
            if at >= 0:
                sink(self._buf[:at])
                self._buf = self._buf[at + len(self._delim) :]
                return
            if len(self._buf) > keep:
                sink(self._buf[:-keep])
                self._buf = self._buf[-keep:]
            if not self._fill():
                raise RequestError(400, "INVALID_FILE", "the multipart body ended inside a part")

    def parts(self):
        """Yield ``(name, read_into)`` per part; ``read_into(sink)`` must be called before the next one."""
        self._copy_until_delimiter(lambda _data: None)
        while True:
            while len(self._buf) < 2 and self._fill():
                pass
            if self._buf.startswith(b"--"):
                return
            while b"\r\n\r\n" not in self._buf:
                if len(self._buf) > 16384 or not self._fill():
                    raise RequestError(400, "INVALID_FILE", "a multipart part has no header end")
            head, self._buf = self._buf.split(b"\r\n\r\n", 1)
            headers = HeaderParser().parsestr(head.decode("latin-1").lstrip("\r\n"))
            name = headers.get_param("name", header="content-disposition")
            consumed: list[bool] = []

            def read_into(sink, done: list[bool] = consumed) -> None:
                self._copy_until_delimiter(sink)
                done.append(True)

            yield name, read_into
            if not consumed:
                self._copy_until_delimiter(lambda _data: None)


class ChunkedWriter:
    """A response body sent with chunked transfer encoding, flushed per write."""

    def __init__(self, wfile) -> None:
        self._wfile = wfile
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if data:
            with self._lock:
                self._wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self._wfile.flush()

    def close(self) -> None:
        with self._lock:
            self._wfile.write(b"0\r\n\r\n")
            self._wfile.flush()


def signal_text(number: int) -> str:
    """Go's wording for a signal death (``signal: killed``), as execd reports it."""
    try:
        name = signal.strsignal(number) or f"signal {number}"
    except ValueError:
        name = f"signal {number}"
    return "signal: " + name.lower()


class CommandRun:
    """One foreground command: its process group, its line-framed event stream, its end."""

    def __init__(self, request: dict) -> None:
        command, argv = request.get("command"), request.get("argv")
        if bool(command) == bool(argv):
            raise RequestError(400, "INVALID_REQUEST_BODY", "exactly one of non-empty command or argv is required")
        if request.get("background"):
            raise RequestError(400, "NOT_SUPPORTED", "this guest daemon runs foreground commands only")
        self.argv = argv or [shutil.which("bash") or "/bin/sh", "-c", command]
        self.cwd = request.get("cwd") or None
        if self.cwd and not os.path.isdir(self.cwd):
            raise RequestError(400, "INVALID_REQUEST_BODY", f"working directory {self.cwd} does not exist")
        timeout_ms = int(request.get("timeout") or 0)
        if timeout_ms < 0:
            raise RequestError(400, "INVALID_REQUEST_BODY", "timeout must not be negative")
        self.timeout = timeout_ms / 1000.0 if timeout_ms else None
        self.env = {**os.environ, **{str(k): str(v) for k, v in (request.get("envs") or {}).items()}}
        self.uid, self.gid = request.get("uid"), request.get("gid")
        self.id = uuid.uuid4().hex
        self._partial = {"stdout": bytearray(), "stderr": bytearray()}

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            user=self.uid,
            group=self.gid,
        )

    def lines(self, stream: str, data: bytes, final: bool = False):
        """Complete lines of ``stream`` (newline stripped) from ``data``; ``final`` flushes the rest."""
        buf = self._partial[stream]
        buf += data
        *complete, rest = bytes(buf).split(b"\n")
        buf[:] = rest
        if final and rest:
            complete.append(rest)
            buf.clear()
        return [line.decode("utf-8", "replace") for line in complete]


def event(kind: str, **fields) -> bytes:
    return json.dumps({"type": kind, **fields, "timestamp": now_ms()}).encode() + b"\n\n"


def stream_command(run: CommandRun, out: ChunkedWriter, client: socket.socket | None = None) -> None:
    """
    Run ``run`` and write its events to ``out`` until the shell exits or the timeout kills it; when
    ``client`` (the connection) closes first, kill the command's group and raise BrokenPipeError.
    """
    started = time.monotonic()
    try:
        proc = run.start()
    except OSError as err:
        out.write(event("init", text=run.id))
        out.write(event("error", error={"ename": "CommandExecError", "evalue": str(err), "traceback": [str(err)]}))
        return
    out.write(event("init", text=run.id))
    assert proc.stdout is not None and proc.stderr is not None  # both are pipes
    selector = selectors.DefaultSelector()
    for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ, name)
    if client is not None:
        selector.register(client, selectors.EVENT_READ, "client")
    next_ping, timed_out = started + PING_SECONDS, False
    try:
        while True:
            for key, _mask in selector.select(0.05):
                _read_ready(run, selector, key, out)
            if proc.poll() is not None:
                break
            now = time.monotonic()
            if run.timeout is not None and now - started >= run.timeout:
                _kill_group(proc)
                timed_out = True
                break
            if now >= next_ping:
                out.write(event("ping", text="pong"))
                next_ping = now + PING_SECONDS
        _drain(run, selector, out)
    except OSError:
        _kill_group(proc)  # the client went away: nothing is left to report to
        raise
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    out.write(_final_event(proc.returncode, timed_out, time.monotonic() - started))


def _read_ready(run: CommandRun, selector, key, out: ChunkedWriter) -> None:
    if key.data == "client":
        if not key.fileobj.recv(1, socket.MSG_PEEK):
            raise BrokenPipeError("the client closed the connection")
        selector.unregister(key.fileobj)  # a pipelined request waits for this one to end
        return
    try:
        data = os.read(key.fd, CHUNK)
    except BlockingIOError:
        return
    if not data:
        selector.unregister(key.fileobj)
        return
    out.write(b"".join(event(key.data, text=line) for line in run.lines(key.data, data)))


def _drain(run: CommandRun, selector, out: ChunkedWriter) -> None:
    """What the shell left in its pipes, without waiting for children that still hold them."""
    for key in list(selector.get_map().values()):
        while key.data != "client":
            try:
                data = os.read(key.fd, CHUNK)
            except BlockingIOError:
                break
            if not data:
                break
            out.write(b"".join(event(key.data, text=line) for line in run.lines(key.data, data)))
    for stream in ("stdout", "stderr"):
        for line in run.lines(stream, b"", final=True):
            out.write(event(stream, text=line))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _final_event(returncode: int, timed_out: bool, elapsed: float) -> bytes:
    if returncode == 0 and not timed_out:
        return event("execution_complete", execution_time=int(elapsed * 1000))
    if returncode < 0 or timed_out:
        value, trace = "-1", signal_text(-returncode if returncode < 0 else signal.SIGKILL)
    else:
        value, trace = str(returncode), f"exit status {returncode}"
    return event("error", error={"ename": "CommandExecError", "evalue": value, "traceback": [trace]})


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The first range of a ``bytes=`` header as (start, length); None when it cannot be served."""
    match = re.fullmatch(r"bytes=\s*(\d*)\s*-\s*(\d*)\s*(,.*)?", header.strip())
    if not match or not (match.group(1) or match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:
        length = min(int(last), size)
        start = size - length
    else:
        start = int(first)
        end = int(last) if last else size - 1
        if end < start:
            return None
        length = min(end, size - 1) - start + 1
    if start >= size or length <= 0:
        return None
    return start, length


class Handler(BaseHTTPRequestHandler):
    """Routes execd's endpoints; every failure becomes execd's JSON error body."""

    protocol_version = "HTTP/1.1"
    server_version = "opensandbox-execd"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        sys.stderr.write("opensandbox-execd: %s\n" % (format % args))

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, self.query = url.path, parse_qs(url.query, keep_blank_values=True)
        self.body = BodyReader(self.rfile, self.headers)
        try:
            path = self._strip_proxy(path)
            route = ROUTES.get((method, path.rstrip("/") or "/"))
            if route is None:
                raise RequestError(404, "NOT_SUPPORTED", f"this guest daemon does not serve {method} {path}")
            route(self)
            while self.body.read():  # what a route left unread, so the connection can carry on
                pass
        except RequestError as err:
            self._respond_json(err.status, {"code": err.code, "message": err.message})
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _strip_proxy(self, path: str) -> str:
        match = _PROXY_PREFIX.match(path)
        if not match:
            return path
        if int(match.group(1)) not in (getattr(self.server, "server_port", None), DEFAULT_PORT):
            raise RequestError(
                502, "NOT_SUPPORTED", f"this guest daemon proxies only to itself, not port {match.group(1)}"
            )
        return match.group(2) or "/"

    def _respond_json(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _paths(self) -> list[str]:
        return [p for p in self.query.get("path", []) if p]

    def _one_path(self) -> str:
        paths = self._paths()
        if not paths:
            raise RequestError(400, "MISSING_QUERY", "missing query parameter 'path'")
        return expand(paths[0])

    def _json_body(self):
        try:
            return json.loads(self.body.read_all() or b"null")
        except ValueError as err:
            raise RequestError(400, "INVALID_REQUEST_BODY", f"the body is not JSON: {err}") from err

    # -- endpoints ---------------------------------------------------------------------------

    def ping(self) -> None:
        self._respond_json(200, "pong")

    def run_command(self) -> None:
        request = self._json_body()
        if not isinstance(request, dict):
            raise RequestError(400, "INVALID_REQUEST_BODY", "the command request must be a JSON object")
        run = CommandRun(request)
        self.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")):
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        out = ChunkedWriter(self.wfile)
        stream_command(run, out, self.connection)
        grace = go_duration_seconds(os.environ.get("EXECD_API_GRACE_SHUTDOWN", "0"))
        if grace > 0:
            time.sleep(grace)
        out.close()

    def upload(self) -> None:
        boundary = self.headers.get_param("boundary", header="content-type")
        if not isinstance(boundary, str) or not boundary:
            raise RequestError(400, "INVALID_FILE", "multipart form is empty")
        meta, written = None, 0
        for name, read_into in Multipart(self.body, boundary).parts():
            if name == "metadata":
                chunks: list[bytes] = []
                read_into(chunks.append)
                try:
                    meta = json.loads(b"".join(chunks))
                except ValueError as err:
                    raise RequestError(400, "INVALID_FILE_METADATA", f"invalid metadata format. {err}") from err
                if not isinstance(meta, dict) or not meta.get("path"):
                    raise RequestError(400, "INVALID_FILE_METADATA", "metadata path is empty")
            elif name == "file":
                if meta is None:
                    raise RequestError(400, "INVALID_FILE_METADATA", "a file part came without its metadata")
                _write_upload(meta, read_into)
                meta, written = None, written + 1
        if not written:
            raise RequestError(400, "INVALID_FILE_CONTENT", "file is missing")
        self._respond_json(200, None)

    def download(self) -> None:
        path = self._one_path()
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed below, after streaming
        except OSError as err:
            raise not_found(err) from err
        with handle:
            size = os.fstat(handle.fileno()).st_size
            start, length, status = 0, size, 200
            if self.headers.get("Range"):
                served = parse_range(self.headers["Range"], size)
                if served is None:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                (start, length), status = served, 206
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{start + length - 1}/{size}")
            self.end_headers()
            handle.seek(start)
            while length > 0 and (chunk := handle.read(min(CHUNK, length))):
                self.wfile.write(chunk)
                length -= len(chunk)

    def files_info(self) -> None:
        result = {}
        for raw in self._paths():
            try:
                result[raw] = file_info(expand(raw))
            except OSError as err:
                raise not_found(err) from err
        self._respond_json(200, result)

    def list_directory(self) -> None:
        root = self._one_path()
        raw_depth = (self.query.get("depth") or ["1"])[0] or "1"
        if not raw_depth.isdigit():
            raise RequestError(400, "INVALID_REQUEST_BODY", f"invalid query parameter 'depth': {raw_depth}")
        try:
            st = os.lstat(root)
        except OSError as err:
            raise not_found(err) from err
        if stat.S_ISLNK(st.st_mode):
            raise RequestError(400, "INVALID_REQUEST_BODY", f"path is a symbolic link, refusing to traverse: {root}")
        if not stat.S_ISDIR(st.st_mode):
            raise RequestError(400, "INVALID_REQUEST_BODY", f"path is not a directory: {root}")
        entries: list[dict] = []
        try:
            _walk(root, int(raw_depth), entries)
        except OSError as err:
            raise RequestError(500, "RUNTIME_ERROR", f"error listing directory {root}. {err}") from err
        self._respond_json(200, entries)

    def make_directories(self) -> None:
        request = self._json_body()
        if not isinstance(request, dict):
            raise RequestError(400, "INVALID_REQUEST_BODY", "the body must map directories to permissions")
        for raw, perm in request.items():
            path, perm = expand(raw), perm or {}
            existed = os.path.isdir(path)
            try:
                os.makedirs(path, exist_ok=True)
                if not existed:
                    mode = octal_mode(perm.get("mode"))
                    if mode is not None:
                        os.chmod(path, mode)
                    chown_names(path, perm.get("owner"), perm.get("group"))
            except (OSError, KeyError) as err:
                raise RequestError(500, "RUNTIME_ERROR", f"error creating directory {raw}. {err}") from err
        self._respond_json(200, None)


def _write_upload(meta: dict, read_into) -> None:
    path = expand(meta["path"])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            read_into(handle.write)
        mode = octal_mode(meta.get("mode"))
        if mode is not None:
            os.chmod(path, mode)
        chown_names(path, meta.get("owner"), meta.get("group"))
    except (OSError, KeyError) as err:
        raise RequestError(500, "RUNTIME_ERROR", f"error writing file {meta['path']}. {err}") from err


def _walk(directory: str, depth: int, entries: list[dict], level: int = 0) -> None:
    if depth == 0:
        return
    with os.scandir(directory) as scan:
        children = sorted(scan, key=lambda entry: entry.name)
    for child in children:
        entries.append(file_info(child.path))
        if child.is_dir(follow_symlinks=False) and level + 1 < depth:
            _walk(child.path, depth, entries, level + 1)


ROUTES = {
    ("GET", "/ping"): Handler.ping,
    ("POST", "/command"): Handler.run_command,
    ("POST", "/files/upload"): Handler.upload,
    ("GET", "/files/download"): Handler.download,
    ("GET", "/files/info"): Handler.files_info,
    ("GET", "/directories/list"): Handler.list_directory,
    ("POST", "/directories"): Handler.make_directories,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The project's execd-compatible guest daemon.")
    parser.add_argument("--host", default=os.environ.get("EXECD_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("EXECD_PORT", DEFAULT_PORT)))
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = str(server.server_address[0]), server.server_port
    sys.stderr.write(f"opensandbox-execd listening on {host}:{port}\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
