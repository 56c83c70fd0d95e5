"""
Servers on loopback addresses for the egress allowlist tests: a TLS server (a test CA signs its
certificate) that also serves a one-wheel package index, a plain HTTP server, and a tiny wheel
built here. Nothing listens off loopback, and nothing is ever sent elsewhere.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import http.server
import io
import ipaddress
import os
import random
import socket
import ssl
import threading
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

WHEEL_NAME = "tinypkg-0.1-py3-none-any.whl"
WHEEL_VALUE = "egress-ok"


def tiny_wheel() -> bytes:
    """A valid pure-Python wheel of ``tinypkg`` 0.1 whose module holds ``VALUE = "egress-ok"``."""
    files = {
        "tinypkg/__init__.py": f'VALUE = "{WHEEL_VALUE}"\n'.encode(),
        "tinypkg-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
        "tinypkg-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-0.1.dist-info/RECORD,,")
    files["tinypkg-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return buffer.getvalue()


@dataclass
class TestCA:
    """A certificate authority and one server certificate for ``names`` and ``addresses``."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def make_ca(names: Sequence[str], addresses: Sequence[str]) -> TestCA:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return TestCA(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


class _Handler(http.server.BaseHTTPRequestHandler):
    wheel = b""

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        if self.path.rstrip("/") == "/simple/tinypkg":
            body = f'<html><body><a href="/files/{WHEEL_NAME}">{WHEEL_NAME}</a></body></html>'.encode()
            kind = "text/html"
        elif self.path == f"/files/{WHEEL_NAME}":
            body, kind = self.wheel, "application/octet-stream"
        elif self.path.startswith("/bytes/"):
            body, kind = b"b" * int(self.path.rsplit("/", 1)[1]), "application/octet-stream"
        else:
            body, kind = f"reached {self.server.label}\n".encode(), "text/plain"  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def random_loopback() -> str:
    """An address in 127.0.0.0/8 other than 127.0.0.1, unlikely to be in use."""
    return f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"


@contextlib.contextmanager
def serve(address: str, port: int, label: str, *, tls: TestCA | None = None) -> Iterator[http.server.HTTPServer]:
    """An HTTP(S) server on ``address``:``port`` (0: any free port) in a thread; ``.hits`` lists the paths asked."""
    server = (_V6Server if ":" in address else http.server.ThreadingHTTPServer)((address, port), _Handler)
    server.label = label  # type: ignore[attr-defined]
    server.hits = []  # type: ignore[attr-defined]
    _Handler.wheel = tiny_wheel()
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        directory = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"egress-test-{os.getpid()}-{port}-{label}")
        os.makedirs(directory, exist_ok=True)
        cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
        with open(cert, "wb") as f:
            f.write(tls.cert_pem)
        with open(key, "wb") as f:
            f.write(tls.key_pem)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def bind_port(address: str, preferred: int) -> int:
    """``preferred`` when this process may bind it on ``address`` (443 needs root), else a free port."""
    with socket.socket() as probe:
        try:
            probe.bind((address, preferred))
            return preferred
        except OSError:
            probe.bind((address, 0))
            return probe.getsockname()[1]


#: Runs inside a sandbox: one request with urllib (which honours the proxy variables), as JSON.
PROBE = r"""
import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as response:
        print(json.dumps({"status": response.status, "body": response.read().decode()}))
except urllib.error.HTTPError as err:
    print(json.dumps({"status": err.code, "error": str(err), "reason": err.read().decode(errors="replace")[:500]}))
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
"""

#: Runs inside a sandbox: what a client that ignores the proxy gets (DNS, raw TCP), as JSON.
RAW = r"""
import json, socket, sys
out = {}
for name in sys.argv[1].split(","):
    try:
        out["dns:" + name] = str(socket.getaddrinfo(name, 443))
    except OSError as err:
        out["dns:" + name] = "failed: " + type(err).__name__
for target in sys.argv[2].split(","):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out["tcp:" + target] = "connected"
    except OSError as err:
        out["tcp:" + target] = "failed: " + (err.strerror or type(err).__name__)
print(json.dumps(out))
"""

LISTED = "pkg.egress.test"
WILDCARD = "*.wild.egress.test"
WILD_NAME = "sub.wild.egress.test"
UNLISTED = "other.egress.test"


@dataclass
class EgressWorld:
    """The servers of one test module and the hook settings that point the gateway at them."""

    tls_address: str
    tls_port: int
    other_port: int
    plain_address: str
    plain_port: int
    host_port: int
    ca: TestCA
    tls: http.server.HTTPServer
    plain: http.server.HTTPServer
    host_service: http.server.HTTPServer
    v6_loopback: http.server.HTTPServer
    own_address: str
    own: http.server.HTTPServer

    @property
    def pins(self) -> dict[str, str]:
        return {name: self.tls_address for name in (LISTED, WILD_NAME, UNLISTED)}

    @property
    def ports(self) -> list[int]:
        return [self.tls_port]

    def url(self, host: str, port: int | None = None, path: str = "/") -> str:
        port = self.tls_port if port is None else port
        return f"https://{host}{'' if port == 443 else f':{port}'}{path}"

    @property
    def plain_url(self) -> str:
        return f"http://{self.plain_address}:{self.plain_port}/"

    @property
    def spec_lists(self) -> dict[str, list[str]]:
        return {"allow_egress_to": [LISTED, WILDCARD], "allow_egress_to_cidrs": [f"{self.plain_address}/32"]}


def worker_address() -> str:
    """An IPv4 address of one of this machine's own interfaces other than loopback (traffic to it stays here)."""
    from sandbox_provider.hooks.egress.rules import local_addresses

    for text in local_addresses():
        address = ipaddress.ip_address(text)
        if address.version == 4 and not address.is_loopback:
            return text
    raise RuntimeError("this machine has no IPv4 address besides loopback to serve the own-address case on")


@contextlib.contextmanager
def egress_world() -> Iterator[EgressWorld]:
    tls_address, plain_address = random_loopback(), random_loopback()
    ca = make_ca([LISTED, WILD_NAME, UNLISTED], [tls_address])
    tls_port = bind_port(tls_address, 443)
    with contextlib.ExitStack() as stack:
        tls = stack.enter_context(serve(tls_address, tls_port, "tls", tls=ca))
        other = stack.enter_context(serve(tls_address, 0, "tls-other-port", tls=ca))
        plain = stack.enter_context(serve(plain_address, 0, "plain"))
        host_service = stack.enter_context(serve("127.0.0.1", 0, "host-loopback"))
        v6_loopback = stack.enter_context(serve("::1", 0, "v6-loopback"))
        own_address = worker_address()
        own = stack.enter_context(serve(own_address, 0, "own-address"))
        yield EgressWorld(
            tls_address=tls_address,
            tls_port=tls_port,
            other_port=other.server_address[1],
            plain_address=plain_address,
            plain_port=plain.server_address[1],
            host_port=host_service.server_address[1],
            ca=ca,
            tls=tls,
            plain=plain,
            host_service=host_service,
            v6_loopback=v6_loopback,
            own_address=own_address,
            own=own,
        )


def run(hook, handle: str, command: str, timeout: float = 90):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=256 * 1024)


def probe(hook, handle: str, url: str, *, always_proxy: bool = False) -> dict:
    """
    One urllib request from inside the sandbox, through whatever proxy its environment names;
    ``always_proxy`` empties NO_PROXY, so loopback URLs go to the proxy too.
    """
    import json
    import shlex

    prefix = "NO_PROXY= no_proxy= " if always_proxy else ""
    result = run(hook, handle, f"{prefix}python3 -c {shlex.quote(PROBE)} {shlex.quote(url)}")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def stage_probes(hook, handle: str, world: EgressWorld) -> None:
    hook.write_file(handle, "ca.pem", world.ca.ca_pem)


def tls_env(workdir: str = "/workspace") -> dict[str, str]:
    """What makes the sandbox's clients trust the test CA (urllib, curl, pip)."""
    ca = f"{workdir}/ca.pem"
    return {"SSL_CERT_FILE": ca, "CURL_CA_BUNDLE": ca, "PIP_CERT": ca}


def assert_battery(hook, handle: str, world: EgressWorld) -> None:
    """
    What every backend with a gateway lets through, positive controls first: the listed name, a
    wildcard's subdomain and a listed range are reached; then every refusal.
    """
    import json
    import shlex

    stage_probes(hook, handle, world)
    # Positive controls: what the allowlist lists is reached, through the proxy variables.
    assert probe(hook, handle, world.url(LISTED)) == {"status": 200, "body": "reached tls\n"}
    assert probe(hook, handle, world.url(WILD_NAME)) == {"status": 200, "body": "reached tls\n"}
    assert probe(hook, handle, world.plain_url) == {"status": 200, "body": "reached plain\n"}
    # The same servers, asked for what is not listed.
    before, host_before = len(world.tls.hits), len(world.host_service.hits)
    refused = {
        "unlisted name": world.url(UNLISTED),
        "listed name, unlisted port": world.url(LISTED, world.other_port),
        "the wildcard's own apex": world.url("wild.egress.test"),
        "IP literal outside the ranges": world.url(world.tls_address),
        "the host's loopback service": f"http://127.0.0.1:{world.host_port}/",
        "localhost": f"http://localhost:{world.host_port}/",
        "the gateway through itself": "https://127.0.0.1:3128/",
    }
    for what, url in refused.items():
        got = probe(hook, handle, url, always_proxy=True)
        assert "body" not in got, (what, got)
        assert got.get("status") == 403 or "403" in got.get("error", ""), (what, got)
    assert len(world.tls.hits) == before
    # Counted from here: an earlier test of the module may have reached the host's service on purpose (a control).
    assert world.host_service.hits[host_before:] == []
    # The gateway's socket answers only as a proxy: a plain request to it names no destination.
    direct = run(
        hook,
        handle,
        "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:3128/dashboard/', timeout=10)\" 2>&1; env | grep -i '^https_proxy='",
    )
    assert "HTTP Error 4" in direct.stdout and "https_proxy=http://127.0.0.1:3128" in direct.stdout, direct.stdout
    # Clients that ignore the proxy variables: no name resolves, no address is routed.
    names = ",".join([LISTED, UNLISTED, "localhost.localdomain.egress.test"])
    targets = ",".join(
        [f"{world.tls_address}:{world.tls_port}", f"{world.plain_address}:{world.plain_port}", "192.0.2.1:443"]
    )
    raw = run(hook, handle, f"python3 -c {shlex.quote(RAW)} {names} {targets}")
    outcome = json.loads(raw.stdout)
    assert all(value.startswith("failed") for value in outcome.values()), repr(outcome)
    assert len(world.tls.hits) == before and len(world.plain.hits) == 1


def _embedded(prefix: str, address: str) -> str:
    """``address`` (IPv4) written inside the IPv6 ``prefix`` (``::ffff:``, ``64:ff9b::``, ``::``)."""
    return str(ipaddress.IPv6Address(int(ipaddress.IPv6Address(prefix)) | int(ipaddress.IPv4Address(address))))


def assert_catch_alls_stay_off_the_worker(hook, create, world: EgressWorld) -> None:
    """
    ``allow_egress_to_cidrs`` catch-alls (``0.0.0.0/0``, ``::/0``) against the servers on the worker's
    loopback (127.0.0.1, another 127/8 address, ::1) and on one of its own interface addresses, asked
    for directly and in IPv4-mapped, IPv4-compatible and NAT64 forms: each refused (403, by the
    guarded-block rule) and never reached. Positive control first: the same servers, with their
    blocks named on purpose, are reached (a NAT64 or compatible address is never connected to: no
    translator here, and the worker would route it off the machine).

    :param create: makes a sandbox of a spec on ``hook`` and returns its handle.
    """
    from sandbox_provider.sandbox import SandboxSpec

    plain, own = world.plain_address, world.own_address
    mapped, nat64, compatible = (
        f"http://[{_embedded(prefix, plain)}]:{world.plain_port}/" for prefix in ("::ffff:0:0", "64:ff9b::", "::")
    )
    loopback = f"http://127.0.0.1:{world.host_port}/"
    v6 = f"http://[::1]:{world.v6_loopback.server_address[1]}/"
    own_url = f"http://{own}:{world.own.server_address[1]}/"
    named = create(SandboxSpec(allow_egress_to_cidrs=[f"{plain}/32", "127.0.0.1/32", "::1/128", f"{own}/32"]))
    reached = {
        world.plain_url: "plain",
        mapped: "plain",
        loopback: "host-loopback",
        v6: "v6-loopback",
        own_url: "own-address",
    }
    for url, label in reached.items():
        assert probe(hook, named, url, always_proxy=True) == {"status": 200, "body": f"reached {label}\n"}, url
    servers = (world.plain, world.host_service, world.v6_loopback, world.own)
    hits = [len(server.hits) for server in servers]
    refused = {
        "0.0.0.0/0": [world.plain_url, loopback, own_url, mapped, nat64],
        "::/0": [v6, mapped, nat64, compatible],
    }
    for cidr, urls in refused.items():
        handle = create(SandboxSpec(allow_egress_to_cidrs=[cidr]))
        for url in urls:
            got = probe(hook, handle, url, always_proxy=True)
            assert got.get("status") == 403 and "not a wider range" in got.get("reason", ""), (cidr, url, got)
    assert [len(server.hits) for server in servers] == hits


@contextlib.contextmanager
def held_sink() -> Iterator[tuple[str, int]]:
    """
    A TCP port on a loopback address that completes connections and never accepts them (the kernel
    holds up to 4096), so every tunnel to it stays open at no cost to this process: ``(address, port)``.
    """
    address = random_loopback()
    with socket.socket() as sink:
        sink.bind((address, 0))
        sink.listen(4096)
        yield address, sink.getsockname()[1]


#: Runs inside a sandbox: opens argv[2] connections to argv[1] (a Unix socket path, or host:port),
#: asks each for a CONNECT tunnel to argv[3], holds them all, and tells how the proxy answered, as
#: JSON: held (200), refused (503), other, and still waiting when nothing changed for argv[5]
#: seconds or argv[4] seconds passed.
FLOOD = r"""
import json, selectors, socket, sys, time
target, count, destination, limit, quiet = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
request = f"CONNECT {destination} HTTP/1.1\r\nHost: {destination}\r\n\r\n".encode()
selector, sockets = selectors.DefaultSelector(), []
for _ in range(count):
    if target.startswith("/"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(target)
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    else:
        host, port = target.rsplit(":", 1)
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        selector.register(sock, selectors.EVENT_WRITE)
    sockets.append(sock)
outcome = {"held": 0, "refused": 0, "other": 0}
start = changed = time.monotonic()
while time.monotonic() - start < limit and time.monotonic() - changed < quiet and selector.get_map():
    for key, events in selector.select(timeout=0.2):
        sock, changed = key.fileobj, time.monotonic()
        if events & selectors.EVENT_WRITE:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                outcome["other"] += 1
                selector.unregister(sock)
            else:
                sock.send(request)
                selector.modify(sock, selectors.EVENT_READ)
            continue
        reply = sock.recv(64)
        status = reply.split(b" ")[1] if reply.startswith(b"HTTP/1.") else b""
        outcome[{b"200": "held", b"503": "refused"}.get(status, "other")] += 1
        selector.unregister(sock)
outcome["waiting"] = len(selector.get_map())
print(json.dumps(outcome), flush=True)
"""


def flood(hook, handle: str, target: str, count: int, destination: str, *, limit: float, quiet: float) -> dict:
    """Run :data:`FLOOD` in the sandbox; its outcome."""
    import json
    import shlex

    args = " ".join(shlex.quote(str(a)) for a in (target, count, destination, limit, quiet))
    result = run(hook, handle, f"python3 -c {shlex.quote(FLOOD)} {args}", timeout=limit + 60)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


class TreePeak:
    """
    The most processes, threads and open descriptors seen at once in a process and its descendants,
    and the largest resident memory of one of them (bytes), sampled every 20 ms in a thread while
    the ``with`` block runs (a process that ends is skipped). ``phase`` names what the caller is
    doing (set it between steps); ``rss_at`` says which process had ``rss``, when and in which phase.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.processes = self.threads = self.files = self.rss = 0
        self.phase, self.rss_at = "", ""
        self._stop = threading.Event()

    def _sample(self) -> None:
        import time

        import psutil

        root, start = psutil.Process(self.pid), time.monotonic()
        while not self._stop.is_set():
            processes = threads = files = 0
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    threads, files = threads + process.num_threads(), files + process.num_fds()
                    rss = process.memory_info().rss
                    if rss > self.rss:
                        role = "the root" if process.pid == self.pid else f"a child of {process.ppid()}"
                        self.rss_at = (
                            f"{rss} bytes in pid {process.pid} ({role}) {time.monotonic() - start:.2f} s in, "
                            f"phase {self.phase or '-'}"
                        )
                        self.rss = rss
                    processes += 1
            self.processes, self.threads = max(self.processes, processes), max(self.threads, threads)
            self.files = max(self.files, files)
            self._stop.wait(0.02)

    def __enter__(self) -> TreePeak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def refusals_logged(log_path: str, cap: int, settle: float = 3.0) -> int:
    """
    How many connections past ``cap`` the gateway logging to ``log_path`` refused, summed over its
    refusal lines, read once nothing new was logged for ``settle`` seconds (the tally comes a
    second after the first line).
    """
    import re
    import time

    pattern = re.compile(rf"egress refused (\d+) connection\(s\): {cap} were open, the most it may hold at once")
    seen, quiet_since = -1, time.monotonic()
    while True:
        with open(log_path, encoding="utf-8") as f:
            total = sum(int(m.group(1)) for m in pattern.finditer(f.read()))
        if total != seen:
            seen, quiet_since = total, time.monotonic()
        elif time.monotonic() - quiet_since >= settle:
            return total
        time.sleep(0.1)


@contextlib.contextmanager
def _tcp_server(serve_one) -> Iterator[tuple[str, int, list[int]]]:
    """
    A TCP server on a loopback address running ``serve_one(conn, counts, index)`` in a thread per
    connection: ``(address, port, counts)``, ``counts[i]`` the bytes moved on the i-th connection.
    """
    address, counts = random_loopback(), []
    listener = socket.socket()
    listener.bind((address, 0))
    listener.listen(64)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn = listener.accept()[0]
                counts.append(0)
                threading.Thread(target=serve_one, args=(conn, counts, len(counts) - 1), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield address, listener.getsockname()[1], counts
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def _pour(conn: socket.socket, counts: list[int], index: int) -> None:
    chunk = b"x" * (1 << 20)
    with contextlib.suppress(OSError), conn:
        while True:
            counts[index] += conn.send(chunk)


def _drain(conn: socket.socket, counts: list[int], index: int) -> None:
    with contextlib.suppress(OSError), conn:
        while data := conn.recv(1 << 20):
            counts[index] += len(data)


def streaming_server() -> contextlib.AbstractContextManager[tuple[str, int, list[int]]]:
    """A server that sends to each connection as fast as it can until it closes: ``(address, port, sent)``."""
    return _tcp_server(_pour)


def draining_server() -> contextlib.AbstractContextManager[tuple[str, int, list[int]]]:
    """A server that reads and drops what each connection sends: ``(address, port, received)``."""
    return _tcp_server(_drain)


#: Runs inside a sandbox: tunnels through the proxy at argv[1] (a Unix socket path, or host:port)
#: to argv[2]. argv[3] of them never read and send argv[4] bytes each, until all is sent or argv[5]
#: seconds pass; they stay open argv[6] seconds more; then one more tunnel reads argv[7] bytes.
#: Prints, as JSON, what each sender got to send and what the reader read.
FLOW = r"""
import json, socket, sys, time
target, destination = sys.argv[1], sys.argv[2]
count, send, seconds, hold, read = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])

def tunnel():
    if target.startswith("/"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(target)
    else:
        host, port = target.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    sock.sendall(f"CONNECT {destination} HTTP/1.1\r\nHost: {destination}\r\n\r\n".encode())
    sock.settimeout(30)
    assert sock.recv(39).startswith(b"HTTP/1.1 200"), "the tunnel was not made"
    return sock

senders, sent, chunk = [tunnel() for _ in range(count)], [0] * count, b"u" * (1 << 20)
for sock in senders:
    sock.setblocking(False)
end = time.monotonic() + seconds
while time.monotonic() < end and min(sent, default=send) < send:
    moved = False
    for i, sock in enumerate(senders):
        if sent[i] < send:
            try:
                sent[i] += sock.send(chunk[: send - sent[i]])
                moved = True
            except BlockingIOError:
                pass
    if not moved:
        time.sleep(0.05)
time.sleep(hold)
got = 0
if read:
    reader = tunnel()
    while got < read:
        data = reader.recv(1 << 20)
        if not data:
            break
        got += len(data)
print(json.dumps({"sent": sent, "read": got}))
"""


def assert_flow_controlled(hook, create, target: str, gateway_pid) -> TreePeak:
    """
    The gateway holds neither direction back in memory: a sandbox that never reads four downloads
    (from a server that sends as fast as it can) and pushes 256 MiB into four uploads (to a server
    that never reads) holds the gateway at a few MiB, and the senders on both ends are held back by
    the kernel. Positive controls in the same sandbox: a tunnel that reads gets 256 MiB through at
    once, and the same uploads to a server that reads get all of it through. Returns the gateway's
    :class:`TreePeak` while the sandbox pulled and pushed (its ``rss``: the largest resident memory
    of one of its processes, bytes; ``rss_at``: which, when, and with the downloads or the uploads).

    :param create: makes a sandbox of a spec on ``hook`` and returns its handle.
    :param target: the proxy as the sandbox reaches it (``SANDBOX_SOCKET``, or ``127.0.0.1:3128``).
    :param gateway_pid: the pid of a handle's gateway.
    """
    import json
    import shlex

    from sandbox_provider.sandbox import SandboxSpec

    big = 256 << 20
    with streaming_server() as (source, source_port, poured), held_sink() as (sink, sink_port):
        with draining_server() as (drain, drain_port, drained):
            cidrs = [f"{address}/32" for address in (source, sink, drain)]
            handle = create(SandboxSpec(allow_egress_to_cidrs=cidrs))

            def flow(destination: str, send: int, seconds: float, hold: float, read: int) -> dict:
                args = f"{target} {destination} 4 {send} {seconds} {hold} {read}"
                result = run(hook, handle, f"python3 -c {shlex.quote(FLOW)} {args}", timeout=180)
                assert result.exit_code == 0, result.stderr
                return json.loads(result.stdout)

            with TreePeak(gateway_pid(handle)) as peak:
                peak.phase = "downloads"
                hoarded = flow(f"{source}:{source_port}", 0, 0, 5, big)
                peak.phase = "uploads"
                pushed = flow(f"{sink}:{sink_port}", big, 8, 0, 0)
            # Downloads: the four never read got little past the kernel's buffers; the fifth read 256 MiB.
            assert hoarded["read"] >= big and len(poured) == 5 and max(poured[:4]) < 64 << 20, (hoarded, poured)
            # Uploads into a server that never reads: each got only a little past the buffers.
            assert max(pushed["sent"]) < 64 << 20, pushed
            # Positive control: into one that reads, all of it goes.
            assert flow(f"{drain}:{drain_port}", big // 4, 60, 0, 0)["sent"] == [big // 4] * 4
    return peak


#: Runs inside a sandbox: fetches argv[1] with urllib through the proxy variables; prints how many
#: bytes came, or the error's name.
SIZE = r"""
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=60) as response:
        print(len(response.read()))
except Exception as err:
    print(type(err).__name__)
"""


class _Downloads(http.server.BaseHTTPRequestHandler):
    """``/length/N``: N bytes with a Content-Length; ``/chunked/N``: N bytes in 64 KiB chunks. HTTP/1.1."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        kind, size = self.path.strip("/").split("/")
        self.send_response(200)
        self.send_header("Connection", "close")
        block = b"d" * 65536
        if kind == "length":
            self.send_header("Content-Length", size)
            self.end_headers()
            for at in range(0, int(size), len(block)):
                self.wfile.write(block[: int(size) - at])
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for at in range(0, int(size), len(block)):
            piece = block[: int(size) - at]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def download_server() -> Iterator[tuple[str, int]]:
    """A server of plain ``http://`` downloads (:class:`_Downloads`) on a loopback address: ``(address, port)``."""
    server = http.server.ThreadingHTTPServer((random_loopback(), 0), _Downloads)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[0], server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


#: Runs inside a sandbox: downloads argv[1] through the proxy at 127.0.0.1:3128; prints its size and sha256.
DOWNLOAD = r"""
import hashlib, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": "http://127.0.0.1:3128"}))
digest, size = hashlib.sha256(), 0
with opener.open(sys.argv[1], timeout=120) as reply:
    while piece := reply.read(1 << 20):
        digest.update(piece)
        size += len(piece)
print(size, digest.hexdigest())
"""

#: Runs inside a sandbox: sends the proxy at 127.0.0.1:3128 a request whose header never ends (argv[2] bytes
#: of it at most) for argv[1]; prints the bytes it could send and the proxy's first line, as JSON.
ENDLESS_HEAD = r"""
import json, socket, sys
sock = socket.create_connection(("127.0.0.1", 3128), timeout=60)
sent = 0
try:
    sock.sendall(b"GET " + sys.argv[1].encode() + b" HTTP/1.1\r\nX-Long: ")
    while sent < int(sys.argv[2]):
        sock.sendall(b"a" * 65536)
        sent += 65536
except OSError:
    pass
try:
    answer = sock.recv(4096).split(b"\r\n")[0].decode()
except OSError as err:
    answer = type(err).__name__
print(json.dumps({"sent": sent, "answer": answer}))
"""


def assert_gateway_parses_within_bounds(hook, create, log_path) -> None:
    """
    Through a sandbox's gateway: a request whose head never ends is cut off within its bound (the
    sandbox can send what the sockets on the way buffer, not the 64 MiB it tries), and plain ``http://``
    downloads with a length (64 MiB) and chunked (8 MiB) arrive whole.
    """
    import json
    import shlex

    from sandbox_provider.sandbox import SandboxSpec

    with download_server() as (address, port):
        handle = create(SandboxSpec(allow_egress_to_cidrs=[f"{address}/32"]))
        base = f"http://{address}:{port}"
        head = run(hook, handle, f"python3 -c {shlex.quote(ENDLESS_HEAD)} {base}/length/1 {64 << 20}", timeout=180)
        got = json.loads(head.stdout)
        # What the sockets and forwarders on the way buffer (a few MiB) is sent; not the rest.
        assert got["sent"] < 16 << 20 and got["answer"].upper() in (
            "HTTP/1.1 400 BAD REQUEST",
            "",
            "CONNECTIONRESETERROR",
        )
        for kind, size in (("length", 64 << 20), ("chunked", 8 << 20)):
            fetched = run(hook, handle, f"python3 -c {shlex.quote(DOWNLOAD)} {base}/{kind}/{size}", timeout=300)
            expected = hashlib.sha256(b"d" * size).hexdigest()
            assert fetched.stdout.split() == [str(size), expected], (kind, fetched)
    with open(log_path(handle), encoding="utf-8") as f:
        assert f"sandbox {handle} egress closed a connection: a message's head passed 65536 bytes" in f.read()
