#!/usr/bin/env python3
"""
Test infrastructure, never shipped into users' sandboxes: the project's stand-in for OpenSandbox's
in-sandbox daemon (``execd``), serving the part of its HTTP API that the ``opensandbox`` SDK uses for
commands and files, on the Python standard library alone.

An OpenSandbox server copies ``/execd`` and ``/bootstrap.sh`` out of its configured execd image into
every sandbox; ``scripts/docker/opensandbox-execd-image.sh`` builds such an image for the tests' server,
with this file as ``/execd``. On the wire it behaves as the vendor's daemon was measured and documented
to; where the vendor's leaves a sandbox open, this one does not:

- **Access token.** ``EXECD_ACCESS_TOKEN`` (or ``--access-token``), taken at start and kept out of the
  environment commands get, must come with every request in the ``X-EXECD-ACCESS-TOKEN`` header (or
  ``OpenSandbox-Execd-Token``); it is compared in constant time, and anything else is answered 401.
  Started without one, this daemon answers every request 401 (the vendor's then checks nothing).
- **Identity.** Run as root, it runs commands as ``EXECD_COMMAND_UID``:``EXECD_COMMAND_GID`` (default
  65432, the bootstrap gives that user the working directory) without supplementary groups, and does
  each file operation with that user's filesystem identity (``setfsuid`` for the one thread), so a
  command can neither signal the daemon nor take its port, and a file operation reaches only what a
  command could. An authenticated request's ``uid``/``gid`` overrides the user, as on the vendor's.
  Not run as root, it runs everything as itself.
- **Commands** (``POST /command``: JSON ``command`` or ``argv``, ``cwd``, ``timeout`` in milliseconds,
  ``envs``, ``uid``, ``gid``) run under ``bash -c`` in a process group of their own with an empty stdin.
  Their stdout and stderr go to ``<TMPDIR>/<execution id>.stdout`` and ``.stderr`` (``/tmp`` by default;
  made by the daemon, mode 0644, and left in place as the vendor's daemon leaves them), which are read
  every 0.1 s and sent as ``text/event-stream`` in execd's framing (a JSON object then a blank line,
  chunked): ``init`` with the execution id, ``stdout``/``stderr``, ``ping`` every 3 s, then
  ``execution_complete``, or ``error`` (``CommandExecError`` with the exit status, or ``-1`` and
  ``signal: killed`` when the timeout killed the group or a signal the shell). The stream ends when the
  shell exits (children still holding its output are not waited for), ``EXECD_API_GRACE_SHUTDOWN``
  after the last event (a Go duration; default ``1s`` as the vendor's, ``0`` turns the wait off).
- **Lines** are framed as the vendor's daemon frames them: ``\\n`` and ``\\r`` each end a line and are
  not sent, ``\\r\\n`` ends one line, an empty line is sent as the text ``"\\n"``, and a last line without
  an end is sent when the command ends. (The vendor's reader forgets a ``\\r`` that ends one 0.1 s read,
  so a ``\\r\\n`` split across two reads can come out there as a line and an empty one; not here.)
- **Files**: ``POST /files/upload`` (multipart ``metadata`` + ``file`` pairs, streamed, mode as octal
  digits such as 644), ``GET /files/download`` (one ``Range``; 416 for a range at or past the end),
  ``GET /files/info``, ``DELETE /files`` (a missing path is no error; this daemon's own output files
  are removed with its own identity, as the vendor's root daemon can), ``GET /directories/list``,
  ``POST /directories``. Errors are JSON ``{"code", "message"}`` with execd's codes (``FILE_NOT_FOUND``
  with 404, ...) and the operating system's words as Go prints them (``is a directory``).

Paths may carry the ``/proxy/<own port>`` prefix of the server's endpoints. Needs Python 3.9 or newer.
Usage: ``opensandbox_execd.py [--host 0.0.0.0] [--port 44772] [--access-token T]``; port 0 picks a free
one. ``opensandbox-execd listening on HOST:PORT`` goes to stderr once it accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import grp
import hmac
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
#: How often a running command's output files are read, as the vendor's daemon does.
POLL_SECONDS = 0.1
CHUNK = 64 * 1024
#: The environment variable and flag default holding the access token; the headers that carry it.
TOKEN_ENV = "EXECD_ACCESS_TOKEN"
TOKEN_HEADERS = ("X-EXECD-ACCESS-TOKEN", "OpenSandbox-Execd-Token")
#: The user commands run as when the daemon is root (the Docker backend's default command user).
DEFAULT_COMMAND_ID = 65432
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


def go_error(operation: str, path: str, err: OSError) -> str:
    """An operating-system error in Go's words: ``open /w/d: is a directory``."""
    words = os.strerror(err.errno) if err.errno else str(err)
    return f"{operation} {path}: {words[:1].lower()}{words[1:]}"


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


# -- who the daemon and its commands are ------------------------------------------------------------


class Identity:
    """
    The user commands and file operations run as: ``uid``, ``gid``, ``home``. ``switching`` is True
    when the daemon is root and that user is another one.
    """

    def __init__(self, uid: int, gid: int, home: str) -> None:
        self.uid, self.gid, self.home = uid, gid, home
        self.switching = os.geteuid() == 0 and (uid, gid) != (0, 0)
        self._libc = ctypes.CDLL(None, use_errno=True) if self.switching else None

    @classmethod
    def from_environment(cls, environ: dict) -> Identity:
        if os.geteuid() != 0:
            return cls(os.getuid(), os.getgid(), environ.get("HOME") or os.getcwd())
        uid = int(environ.get("EXECD_COMMAND_UID") or DEFAULT_COMMAND_ID)
        gid = int(environ.get("EXECD_COMMAND_GID") or uid)
        return cls(uid, gid, environ.get("EXECD_COMMAND_HOME") or os.getcwd())

    @contextlib.contextmanager
    def files(self):
        """Within it, this thread's file operations are the command user's (and nothing else changes)."""
        if not self.switching:
            yield
            return
        self._set_fs(self.gid, self.uid)
        try:
            yield
        finally:
            self._set_fs(0, 0)

    def _set_fs(self, gid: int, uid: int) -> None:
        # setfsgid/setfsuid change the calling thread only (the C library does not pass them on to
        # the other threads), and an fsuid other than 0 drops this thread's file capabilities. A
        # connection's requests share a thread, so a failure puts root's back before it is reported.
        assert self._libc is not None
        self._libc.setfsgid(gid)
        self._libc.setfsuid(uid)
        if (self._libc.setfsuid(-1), self._libc.setfsgid(-1)) != (uid, gid):
            self._libc.setfsuid(0)
            self._libc.setfsgid(0)
            raise RequestError(500, "RUNTIME_ERROR", f"could not take the file identity {uid}:{gid}")

    def spawn_ids(self, request: dict) -> dict:
        """``Popen`` keywords running a command as the request's ``uid``/``gid``, else as this user."""
        uid = self.uid if request.get("uid") is None else int(request["uid"])
        gid = request.get("gid")
        if gid is None:
            gid = self.gid if uid == self.uid else _primary_gid(uid)
        if (uid, int(gid)) == (os.getuid(), os.getgid()):
            return {}  # the daemon's own user: no switch (root's groups were dropped at start)
        if os.geteuid() != 0:
            raise RequestError(400, "INVALID_REQUEST_BODY", f"this daemon is not root and cannot run as {uid}:{gid}")
        return {"user": uid, "group": int(gid), "extra_groups": []}


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


# -- the token --------------------------------------------------------------------------------------


def token_matches(expected: str | None, headers) -> bool:
    """Whether one of the token headers holds ``expected`` (constant time); never without a token."""
    if not expected:
        return False
    wanted = expected.encode()
    given = [headers.get(name) for name in TOKEN_HEADERS]
    return any(hmac.compare_digest(value.encode(), wanted) for value in given if value)


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


# -- command output, framed as execd frames it ------------------------------------------------------


class LineFramer:
    """
    One output stream cut into execd's line events: ``\\n`` and ``\\r`` end a line and are dropped,
    ``\\r\\n`` ends one, an empty line is the text ``"\\n"``; :meth:`finish` gives a last unended line.
    """

    def __init__(self) -> None:
        self._line = bytearray()
        self._after_cr = False

    def feed(self, data: bytes) -> list[str]:
        lines: list[str] = []
        for piece in re.split(rb"(\r|\n)", data):
            if piece not in (b"\r", b"\n"):
                if piece:
                    self._line += piece
                    self._after_cr = False
                continue
            if self._line:
                lines.append(self._line.decode("utf-8", "replace"))
                self._line.clear()
            elif not (piece == b"\n" and self._after_cr):
                lines.append("\n")
            self._after_cr = piece == b"\r"
        return lines

    def finish(self) -> list[str]:
        rest = self._line.decode("utf-8", "replace")
        self._line.clear()
        return [rest] if rest else []


class Spool:
    """A command's stdout or stderr file: written by the command, read by the daemon as it grows."""

    def __init__(self, path: str, stream: str) -> None:
        self.path, self.stream = path, stream
        # O_EXCL and O_NOFOLLOW: a name planted in /tmp fails the command instead of being followed.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.write_fd = os.open(path, flags, 0o644)
        self.read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.framer = LineFramer()

    def events(self, final: bool = False) -> bytes:
        """
        The events for what was written since the last call, up to the file's size now (a child still
        writing after the shell exited is not followed), and, when ``final``, a last unended line.
        """
        lines: list[str] = []
        left = os.fstat(self.read_fd).st_size - os.lseek(self.read_fd, 0, os.SEEK_CUR)
        while left > 0 and (data := os.read(self.read_fd, min(left, 1024 * 1024))):
            left -= len(data)
            lines += self.framer.feed(data)
        if final:
            lines += self.framer.finish()
        return b"".join(event(self.stream, text=line) for line in lines)

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def spool_dir() -> str:
    return os.environ.get("TMPDIR") or "/tmp"


def signal_text(number: int) -> str:
    """Go's wording for a signal death (``signal: killed``), as execd reports it."""
    try:
        name = signal.strsignal(number) or f"signal {number}"
    except ValueError:
        name = f"signal {number}"
    return "signal: " + name.lower()


class CommandRun:
    """One foreground command: its request checked, its process group, its spooled output."""

    def __init__(self, request: dict, identity: Identity, environ: dict) -> None:
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
        base = dict(environ)
        if identity.switching and base.get("HOME") in (None, "", "/root"):
            base["HOME"] = identity.home  # root's home is not the command user's
        self.env = {**base, **{str(k): str(v) for k, v in (request.get("envs") or {}).items()}}
        self.ids = identity.spawn_ids(request)
        self.id = uuid.uuid4().hex
        self.spools: list[Spool] = []

    def start(self) -> subprocess.Popen:
        for stream in ("stdout", "stderr"):
            self.spools.append(Spool(os.path.join(spool_dir(), f"{self.id}.{stream}"), stream))
        out, err = (spool.write_fd for spool in self.spools)
        try:
            return subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                **self.ids,
            )
        finally:
            for spool in self.spools:
                os.close(spool.write_fd)  # the command holds them now; its end is the files' end

    def output_events(self, final: bool = False) -> bytes:
        return b"".join(spool.events(final) for spool in self.spools)

    def close(self) -> None:
        for spool in self.spools:
            spool.close()


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
        run.close()
        out.write(event("init", text=run.id))
        out.write(event("error", error={"ename": "CommandExecError", "evalue": str(err), "traceback": [str(err)]}))
        return
    out.write(event("init", text=run.id))
    try:
        timed_out = _follow(run, proc, out, client, started)
        out.write(run.output_events(final=True))
    except OSError:
        _kill_group(proc)  # the client went away: nothing is left to report to
        raise
    finally:
        run.close()
    out.write(_final_event(proc.returncode, timed_out, time.monotonic() - started))


def _follow(run: CommandRun, proc: subprocess.Popen, out: ChunkedWriter, client, started: float) -> bool:
    """Pass output on every poll until the shell exits (False) or the timeout kills its group (True)."""
    selector = selectors.DefaultSelector()
    if client is not None:
        selector.register(client, selectors.EVENT_READ)
    next_ping = started + PING_SECONDS
    try:
        while True:
            if client is None:
                time.sleep(POLL_SECONDS)
            elif selector.select(POLL_SECONDS):  # the client sent more, or went away
                if not client.recv(1, socket.MSG_PEEK):
                    raise BrokenPipeError("the client closed the connection")
                selector.unregister(client)  # a pipelined request waits for this one to end
                client = None
            out.write(run.output_events())
            if proc.poll() is not None:
                return False
            now = time.monotonic()
            if run.timeout is not None and now - started >= run.timeout:
                _kill_group(proc)
                return True
            if now >= next_ping:
                out.write(event("ping", text="pong"))
                next_ping = now + PING_SECONDS
    finally:
        selector.close()


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
    """Routes execd's endpoints after the token check; every failure becomes execd's JSON error body."""

    protocol_version = "HTTP/1.1"
    server_version = "opensandbox-execd"
    server: ExecdServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        sys.stderr.write("opensandbox-execd: %s\n" % (format % args))

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, self.query = url.path, parse_qs(url.query, keep_blank_values=True)
        self.body = BodyReader(self.rfile, self.headers)
        try:
            if not token_matches(self.server.token, self.headers):
                self._refuse_unauthenticated()
                return
            path = self._strip_proxy(path)
            route = ROUTES.get((method, path.rstrip("/") or "/"))
            if route is None:
                raise RequestError(404, "NOT_SUPPORTED", f"this guest daemon does not serve {method} {path}")
            route(self)
            while self.body.read():  # what a route left unread, so the connection can carry on
                pass
        except RequestError as err:
            # The request's body may be left unread: the connection ends with this answer, and says so.
            self._respond_json(err.status, {"code": err.code, "message": err.message}, close=True)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _refuse_unauthenticated(self) -> None:
        # The body is left unread and the connection closed: an unauthenticated caller sends nothing
        # further to this daemon.
        why = "this daemon was started without an access token" if not self.server.token else "it is missing or wrong"
        message = f"the {TOKEN_HEADERS[0]} header must hold this sandbox's access token: {why}"
        self._respond_json(401, {"error": message}, close=True)

    def _strip_proxy(self, path: str) -> str:
        match = _PROXY_PREFIX.match(path)
        if not match:
            return path
        if int(match.group(1)) not in (getattr(self.server, "server_port", None), DEFAULT_PORT):
            raise RequestError(
                502, "NOT_SUPPORTED", f"this guest daemon proxies only to itself, not port {match.group(1)}"
            )
        return match.group(2) or "/"

    def _respond_json(self, status: int, payload, *, close: bool = False) -> None:
        """
        Send ``payload`` as JSON with ``status``; with ``close``, end the connection after it with a
        ``Connection: close`` header, so that a client never sends its next request on a connection
        this daemon is closing (it then reads "disconnected without a response" instead).
        """
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")  # also sets close_connection
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
        run = CommandRun(request, self.server.identity, self.server.command_env)
        self.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")):
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        out = ChunkedWriter(self.wfile)
        try:
            stream_command(run, out, self.connection)
        finally:
            self.server.remember_spools([spool.path for spool in run.spools])
        if self.server.grace > 0:
            time.sleep(self.server.grace)
        out.close()

    def upload(self) -> None:
        boundary = self.headers.get_param("boundary", header="content-type")
        if not isinstance(boundary, str) or not boundary:
            raise RequestError(400, "INVALID_FILE", "the body is not a multipart form")
        meta, written = None, 0
        for name, read_into in Multipart(self.body, boundary).parts():
            if name == "metadata":
                chunks: list[bytes] = []
                read_into(chunks.append)
                try:
                    meta = json.loads(b"".join(chunks))
                except ValueError as err:
                    raise RequestError(400, "INVALID_FILE_METADATA", f"the metadata part is not JSON: {err}") from err
                if not isinstance(meta, dict) or not meta.get("path"):
                    raise RequestError(400, "INVALID_FILE_METADATA", "the metadata names no path")
            elif name == "file":
                if meta is None:
                    raise RequestError(400, "INVALID_FILE_METADATA", "a file part came without its metadata")
                with self.server.identity.files():
                    _write_upload(meta, read_into)
                meta, written = None, written + 1
        if not written:
            raise RequestError(400, "INVALID_FILE_CONTENT", "no file part came")
        self._respond_json(200, None)

    def download(self) -> None:
        path = self._one_path()
        with self.server.identity.files():
            try:
                handle = open(path, "rb")  # noqa: SIM115 - closed below, after streaming
            except OSError as err:
                raise file_error("open", path, err) from err
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
        with self.server.identity.files():
            for raw in self._paths():
                try:
                    result[raw] = file_info(expand(raw))
                except OSError as err:
                    raise file_error("lstat", expand(raw), err) from err
        self._respond_json(200, result)

    def remove_files(self) -> None:
        for raw in self._paths():
            path = expand(raw)
            try:
                if self.server.forget_spool(path):
                    os.unlink(path)  # its own output file: removed with the daemon's identity
                    continue
                with self.server.identity.files():
                    _remove_file(path)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise RequestError(
                    500, "RUNTIME_ERROR", f"could not remove {raw}: {go_error('remove', path, err)}"
                ) from err
        self._respond_json(200, None)

    def list_directory(self) -> None:
        root = self._one_path()
        raw_depth = (self.query.get("depth") or ["1"])[0] or "1"
        if not raw_depth.isdigit():
            raise RequestError(400, "INVALID_REQUEST_BODY", f"invalid query parameter 'depth': {raw_depth}")
        entries: list[dict] = []
        with self.server.identity.files():
            try:
                st = os.lstat(root)
            except OSError as err:
                raise file_error("lstat", root, err) from err
            if stat.S_ISLNK(st.st_mode):
                raise RequestError(
                    400, "INVALID_REQUEST_BODY", f"path is a symbolic link, refusing to traverse: {root}"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise RequestError(400, "INVALID_REQUEST_BODY", f"path is not a directory: {root}")
            try:
                _walk(root, int(raw_depth), entries)
            except OSError as err:
                raise RequestError(500, "RUNTIME_ERROR", f"could not list {root}: {err}") from err
        self._respond_json(200, entries)

    def make_directories(self) -> None:
        request = self._json_body()
        if not isinstance(request, dict):
            raise RequestError(400, "INVALID_REQUEST_BODY", "the body must map directories to permissions")
        with self.server.identity.files():
            for raw, perm in request.items():
                _make_directory(expand(raw), perm or {})
        self._respond_json(200, None)


def file_error(operation: str, path: str, err: OSError) -> RequestError:
    """execd's answer to a failed file operation: 404 ``FILE_NOT_FOUND`` for a missing one, else 500."""
    words = go_error(operation, path, err)
    if isinstance(err, FileNotFoundError):
        return RequestError(404, "FILE_NOT_FOUND", f"no such file: {words}")
    return RequestError(500, "RUNTIME_ERROR", f"could not reach the file: {words}")


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
    except OSError as err:
        words = go_error("open", path, err)
        raise RequestError(500, "RUNTIME_ERROR", f"could not write {meta['path']}: {words}") from err
    except KeyError as err:
        raise RequestError(
            500, "RUNTIME_ERROR", f"could not write {meta['path']}: no such user or group {err}"
        ) from err


def _remove_file(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    os.unlink(path)


def _make_directory(path: str, perm: dict) -> None:
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        if not existed:
            mode = octal_mode(perm.get("mode"))
            if mode is not None:
                os.chmod(path, mode)
            chown_names(path, perm.get("owner"), perm.get("group"))
    except OSError as err:
        raise RequestError(500, "RUNTIME_ERROR", f"could not make {path}: {go_error('mkdir', path, err)}") from err
    except KeyError as err:
        raise RequestError(500, "RUNTIME_ERROR", f"could not make {path}: no such user or group {err}") from err


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
    ("DELETE", "/files"): Handler.remove_files,
    ("GET", "/directories/list"): Handler.list_directory,
    ("POST", "/directories"): Handler.make_directories,
}


class ExecdServer(ThreadingHTTPServer):
    """The listening daemon: its token, its command user, the environment commands start from."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], token: str | None, environ: dict) -> None:
        super().__init__(address, Handler)
        self.token = token
        self.identity = Identity.from_environment(environ)
        self.command_env = {k: v for k, v in environ.items() if k != TOKEN_ENV and not k.startswith("EXECD_COMMAND_")}
        self.grace = go_duration_seconds(environ.get("EXECD_API_GRACE_SHUTDOWN", "1s"))
        self._spools: set[str] = set()
        self._lock = threading.Lock()

    def remember_spools(self, paths: list[str]) -> None:
        with self._lock:
            self._spools.update(paths)

    def forget_spool(self, path: str) -> bool:
        """True (and forgotten) when ``path`` is one of this daemon's output files."""
        with self._lock:
            if path in self._spools:
                self._spools.discard(path)
                return True
            return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The project's execd-compatible guest daemon (test infrastructure).")
    parser.add_argument("--host", default=os.environ.get("EXECD_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("EXECD_PORT", DEFAULT_PORT)))
    parser.add_argument("--access-token", default=None, help=f"the access token (default: ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    environ = dict(os.environ)
    token = args.access_token or environ.get(TOKEN_ENV) or None
    os.environ.pop(TOKEN_ENV, None)
    if os.geteuid() == 0:
        os.setgroups([])  # no supplementary group of root's reaches a file operation
    server = ExecdServer((args.host, args.port), token, environ)
    host, port = str(server.server_address[0]), server.server_port
    sys.stderr.write(f"opensandbox-execd listening on {host}:{port}\n")
    if not token:
        sys.stderr.write(f"opensandbox-execd: no access token (${TOKEN_ENV}): every request will be refused\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
