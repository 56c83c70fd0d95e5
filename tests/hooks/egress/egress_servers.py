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
        else:
            body, kind = f"reached {self.server.label}\n".encode(), "text/plain"  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        self.server.hits.append(self.path)  # type: ignore[attr-defined]


def random_loopback() -> str:
    """An address in 127.0.0.0/8 other than 127.0.0.1, unlikely to be in use."""
    return f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"


@contextlib.contextmanager
def serve(address: str, port: int, label: str, *, tls: TestCA | None = None) -> Iterator[http.server.HTTPServer]:
    """An HTTP(S) server on ``address``:``port`` (0: any free port) in a thread; ``.hits`` lists the paths asked."""
    server = http.server.ThreadingHTTPServer((address, port), _Handler)
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
    print(json.dumps({"status": err.code, "error": str(err)}))
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
    before = len(world.tls.hits)
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
    assert world.host_service.hits == []
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
    assert all(value.startswith("failed") for value in outcome.values()), outcome
    assert len(world.tls.hits) == before and len(world.plain.hits) == 1
