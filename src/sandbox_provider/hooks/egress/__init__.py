"""
Hostname and address egress allowlists for the backends that run sandboxes on the worker (local,
Docker), enforced by a gateway outside the sandbox.

A sandbox with ``allow_egress_to`` or ``allow_egress_to_cidrs`` keeps a network of its own with
only a loopback interface: no route anywhere, no DNS. One gateway per sandbox (proxy.py, an HTTP
forward proxy, with the policy of :mod:`~sandbox_provider.hooks.egress.rules`) runs on the
worker as the worker's user and listens only on a Unix socket; inside the sandbox a forwarder
(socat) presents that socket as ``127.0.0.1:3128``, and ``HTTPS_PROXY``/``HTTP_PROXY`` (and their
lowercase forms) name it, with ``NO_PROXY`` for the sandbox's own loopback. So clients that honour
the proxy variables (curl, pip, requests, urllib, httpx) reach the listed destinations; clients
that ignore them fail, since names do not resolve and no address is routed.

- **local**: each command gets a fresh network namespace, so the socket is bound into the sandbox
  and ``guest/egress_forward.sh`` starts socat for every command (:func:`local_launch`).
- **Docker**: the container has network mode ``none``; the gateway starts socat in the container's
  network namespace from the worker (``nsenter --net``), outside the container's processes, so
  nothing in the container can stop or replace it (:func:`docker_forward`).

Each gateway holds at most ``max_connections`` connections at once (:data:`MAX_CONNECTIONS` unless
the hook says otherwise) and refuses more with a log line; it runs as one event loop (at most four
threads), stops reading a side while :data:`QUEUE_BYTES` wait for the other, and holds at most
:data:`HOLD_BYTES` for all its connections; see :mod:`~sandbox_provider.hooks.egress.bounds`. The Docker forwarder, which runs on the worker
outside the container's limits, forks one socat per connection up to the cap and
:data:`FORWARD_SPARE` more (``max-children``): those spare ones reach the gateway and are refused
with a log line rather than left waiting, and the worker never holds more socat processes than
that for a sandbox. The local forwarder runs inside the sandbox, within its own process limit.

The gateway starts at create, is recorded in its directory (configuration, socket, log, pid), and
stops at destroy, at the sandbox's end, and by itself when the sandbox is gone; every attempt,
allowed or refused, is logged with the handle there, and the hooks copy new lines to the task log
after each command (:func:`relay_log`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sandbox_provider.hooks.egress.rules import (
    DEFAULT_PORTS,
    EgressPolicy,
    address_ranges,
    check_ports,
    host_pins,
)
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.processes import running
from sandbox_provider.sandbox.spec import SandboxSpec, decode_network_policy, hostname_allowlist

__all__ = [
    "DEFAULT_PORTS",
    "FORWARD_PORT",
    "GATEWAY_BASE_BYTES",
    "HOLD_BYTES",
    "QUEUE_BYTES",
    "MAX_CONNECTIONS",
    "EgressPolicy",
    "LocalLaunch",
    "check_max_connections",
    "check_ports",
    "host_pins",
    "missing_tools",
    "policy_for",
    "start_local_gateway",
    "proxy_env",
    "reach",
    "relay_log",
    "start_gateway",
    "stop_gateway",
]

log = logging.getLogger(__name__)

#: The TCP port the forwarder listens on inside a sandbox, on 127.0.0.1 (Squid's usual port).
FORWARD_PORT = 3128
#: Where the local backend binds the gateway's socket inside a sandbox.
SANDBOX_SOCKET = "/run/airflow-sandbox/egress.sock"
#: The connections a sandbox's gateway holds at once unless the hook sets ``egress_max_connections``
#: (enough for uv's 50 parallel downloads; pip uses one or two).
MAX_CONNECTIONS = 64
#: The most ``egress_max_connections`` may be.
MAX_CONNECTIONS_LIMIT = 1024
#: How many more connections than the cap the Docker forwarder accepts, for the gateway to refuse.
FORWARD_SPARE = 16
#: Bytes a gateway queues for one side of a connection before it stops reading the other side.
QUEUE_BYTES = 1024 * 1024
#: Bytes all of a gateway's connections may hold together (queues, plain ``http://`` bodies, which
#: proxy.py keeps whole while they pass); past it, the connection holding the most is closed.
HOLD_BYTES = 256 * 1024 * 1024
#: The data (heap and private mappings) each of a gateway's two processes may have besides twice
#: ``HOLD_BYTES`` (proxy.py copies a growing body), in bytes.
GATEWAY_BASE_BYTES = 128 * 1024 * 1024
#: Bytes a gateway's log may grow to (its lines about each attempt); past it, one line says so and
#: later attempts are still judged, but no longer written down. The log lives on the worker's disk,
#: and a sandbox decides how many attempts it makes.
LOG_BYTES = 8 * 1024 * 1024
#: Seconds a gateway may take to listen.
START_TIMEOUT = 30.0
#: The files of a gateway's directory.
CONFIG, SOCKET, LOG, READY = "gateway.json", "gateway.sock", "gateway.log", "gateway.pid"
_MODULE = "sandbox_provider.hooks.egress.gateway"
#: The longest Unix socket path the kernel binds (``sun_path`` less its NUL).
_MAX_SOCKET_PATH = 107


def missing_tools(*, nsenter: bool = False) -> list[str]:
    """
    What the worker lacks to run egress gateways, as install instructions; empty when nothing.

    :param nsenter: also util-linux's ``nsenter`` (the Docker backend's forwarder).
    """
    missing = []
    if importlib.util.find_spec("proxy") is None:
        missing.append("proxy.py in the worker's Python (pip install 'airflow-provider-sandbox[egress]')")
    if shutil.which("socat") is None:
        missing.append("socat on the worker (apt-get install socat)")
    if nsenter and shutil.which("nsenter") is None:
        missing.append("nsenter on the worker (apt-get install util-linux)")
    return missing


def check_max_connections(value: Any) -> int:
    """
    ``value`` as the most connections a sandbox's gateway holds at once (1 to 1024).

    :raises ValueError: for anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONNECTIONS_LIMIT:
        raise ValueError(
            f"egress_max_connections must be a whole number of connections from 1 to {MAX_CONNECTIONS_LIMIT}, "
            f"got {value!r}."
        )
    return value


def policy_for(handle: str, spec: SandboxSpec, *, ports: Sequence[int], pins: Mapping[str, Any] | None) -> EgressPolicy:
    """
    The gateway policy of sandbox ``handle`` made from ``spec``.

    :raises ValueError: for an allowlist entry that is not a hostname or a range, or bad ports or pins.
    """
    return EgressPolicy(
        handle=handle,
        hosts=tuple(hostname_allowlist(spec.allow_egress_to or [], hint=" (put addresses in allow_egress_to_cidrs)")),
        cidrs=tuple(address_ranges(spec.allow_egress_to_cidrs or [])),
        ports=check_ports(ports),
        pins=host_pins(pins),
    )


def has_allowlist(network_stamp: str | None) -> bool:
    """Whether a sandbox's network stamp (``NETWORK_TAG``) holds an allowlist, so it has a gateway."""
    if not network_stamp:
        return False
    try:
        return decode_network_policy(network_stamp).has_allowlist
    except ValueError:
        return False


def proxy_env(port: int = FORWARD_PORT) -> dict[str, str]:
    """The environment that sends a sandbox's HTTP clients to the forwarder on ``127.0.0.1:port``."""
    url = f"http://127.0.0.1:{port}"
    no_proxy = "localhost,127.0.0.1,::1"
    env = {}
    for name, value in (("HTTPS_PROXY", url), ("HTTP_PROXY", url), ("NO_PROXY", no_proxy)):
        env[name] = env[name.lower()] = value
    return env


def _wait_ready(directory: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    ready = os.path.join(directory, READY)
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            tail = _tail(os.path.join(directory, LOG))
            raise SandboxTerminalError(
                f"The egress gateway did not start (status {proc.returncode}){': ' + tail if tail else ''}. Check "
                "that proxy.py (the provider's egress extra) and socat are installed on the worker."
            )
        time.sleep(0.02)


def _tail(path: str, size: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def start_gateway(
    directory: str,
    policy: EgressPolicy,
    *,
    expires_at: float,
    watch: Mapping[str, Any],
    forward: Sequence[Sequence[str]] = (),
    socket_owner: int | None = None,
    dir_mode: int = 0o700,
    max_connections: int = MAX_CONNECTIONS,
) -> int:
    """
    Start the gateway for ``policy`` in ``directory`` (made, mode 0700; the socket is ``gateway.sock``
    in it) and return its pid once it listens. It runs in a session of its own, detached from the worker.

    :param expires_at: Unix time (seconds) when the sandbox's lifetime ends, and the gateway's.
    :param watch: ``{"dir": path}`` (ends when that directory is gone) or ``{"pid": n, "netns": inode}``
        (ends when that process's network namespace is not that one any more).
    :param forward: command lines the gateway starts once it listens, and ends with itself.
    :param socket_owner: a user id to hand the socket to (mode 0600), else mode 0666.
    :param dir_mode: the directory's mode: 0711 lets a sandbox's own user reach the socket in it.
    :param max_connections: the most connections it holds at once; it refuses more (``503``), logging that.
    :raises SandboxTerminalError: if it does not listen within 30 s, or (with ``forward``) the socket
        path is longer than a Unix socket path may be.
    """
    socket_path = os.path.join(directory, SOCKET)
    # The gateway binds the socket relative to the directory (its working directory), so only the
    # forwarders that connect from outside by full path are bound by the kernel's path limit.
    if forward and len(socket_path.encode()) > _MAX_SOCKET_PATH:
        raise SandboxTerminalError(
            f"The egress gateway's socket path {socket_path!r} is longer than the {_MAX_SOCKET_PATH} bytes a Unix "
            "socket path may have; use a shorter state directory."
        )
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    os.chmod(directory, dir_mode)
    limits = {
        "max_connections": check_max_connections(max_connections),
        "queue_bytes": QUEUE_BYTES,
        "hold_bytes": HOLD_BYTES,
        "memory_bytes": GATEWAY_BASE_BYTES + 2 * HOLD_BYTES,
        "log_bytes": LOG_BYTES,
    }
    config_path = _write_config(directory, policy, expires_at, watch, forward, socket_owner is not None, limits)
    proc = _spawn(directory, config_path)
    _wait_ready(directory, proc, START_TIMEOUT)
    if socket_owner is not None:
        os.chown(socket_path, socket_owner, socket_owner)
    log.info(
        "Egress gateway of sandbox %s listening (pid %d): hosts %s on ports %s, ranges %s",
        policy.handle,
        proc.pid,
        list(policy.hosts),
        list(policy.ports),
        list(policy.cidrs),
    )
    return proc.pid


def _write_config(
    directory: str,
    policy: EgressPolicy,
    expires_at: float,
    watch: Mapping[str, Any],
    forward: Sequence[Sequence[str]],
    private_socket: bool,
    limits: Mapping[str, int],
) -> str:
    """Write the gateway's configuration (mode 0600) into ``directory``; return its path."""
    config = {
        "policy": policy.to_json(),
        "socket": SOCKET,
        "log": os.path.join(directory, LOG),
        "ready": os.path.join(directory, READY),
        "expires_at": expires_at,
        "watch": dict(watch),
        "forward": [list(argv) for argv in forward],
        "socket_mode": 0o600 if private_socket else 0o666,
        "forward_port": FORWARD_PORT,
        **limits,
    }
    config_path = os.path.join(directory, CONFIG)
    with open(os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return config_path


def _spawn(directory: str, config_path: str) -> subprocess.Popen[bytes]:
    """Start the gateway process on ``config_path``, in a session of its own, its errors into the log."""
    with open(os.open(os.path.join(directory, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as errors:
        return subprocess.Popen(
            [sys.executable, "-m", _MODULE, config_path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,
            cwd=directory,
            # The gateway connects directly: a proxy the worker itself is told to use is not the sandbox's.
            env={k: v for k, v in os.environ.items() if k.upper() not in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")},
        )


def start_local_gateway(
    path: str,
    spec: SandboxSpec,
    *,
    image: str | None,
    expires_at: float,
    ports: Sequence[int],
    pins: Mapping[str, Any],
    socket_owner: int | None,
    max_connections: int = MAX_CONNECTIONS,
) -> int:
    """
    Start the gateway of the local sandbox whose directory is ``path`` (its handle is the last part),
    ending when that directory is gone, holding at most ``max_connections`` at once; return its pid.

    :raises SandboxTerminalError: if the sandbox's ``image`` (a root filesystem; None for the worker's
        own) has no ``/usr/bin/socat``, or the gateway does not start.
    """
    if image and not os.path.exists(os.path.join(image, "usr/bin/socat")):
        raise SandboxTerminalError(
            f"An egress allowlist needs socat inside the sandbox, and the image {image!r} has no "
            "/usr/bin/socat: install socat into it, or drop the allow lists."
        )
    return start_gateway(
        local_gateway_dir(path),
        policy_for(os.path.basename(path), spec, ports=ports, pins=pins),
        expires_at=expires_at,
        watch={"dir": path},
        socket_owner=socket_owner,
        dir_mode=0o711,
        max_connections=max_connections,
    )


def _gateway_pid(directory: str, match: str | None = None) -> int | None:
    """
    The pid of the gateway of ``directory`` if it still runs: its command line must be the gateway's
    and hold ``match`` (default: the directory, where it was started).
    """
    try:
        with open(os.path.join(directory, READY), encoding="utf-8") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, ValueError):
        return None
    expected = (match or directory).encode()
    return pid if _MODULE.encode() in cmdline and expected in cmdline else None


def stop_gateway(directory: str, *, match: str | None = None, remove: bool = False) -> None:
    """
    End the gateway of ``directory`` (its forwarders with it); remove the directory with ``remove``.

    :param match: what the gateway's command line holds when ``directory`` was moved since it started
        (the original path, or a part of it); default ``directory``.
    """
    pid = _gateway_pid(directory, match)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _gateway_pid(directory, match) == pid and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        while running(pid) and time.monotonic() < deadline + 5:  # gone, or only a zombie, on return
            time.sleep(0.02)
    _relayed.pop(os.path.join(directory, LOG), None)
    if remove:
        shutil.rmtree(directory, ignore_errors=True)


def sweep_gateways(root: str) -> list[str]:
    """
    Under ``root`` (one directory per handle), remove the directories whose gateway no longer runs
    (it ended with its sandbox, or its worker was killed before cleaning up); return their handles.
    """
    removed = []
    with contextlib.suppress(OSError):
        for handle in sorted(os.listdir(root)):
            directory = os.path.join(root, handle)
            if _gateway_pid(directory) is None and _settled(directory):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(handle)
    return removed


def _settled(directory: str, grace: float = START_TIMEOUT * 2) -> bool:
    """
    Whether no gateway can be starting in ``directory`` now: one started there and wrote its pid
    (it has ended since), or the directory is older than a gateway takes to start.
    """
    with contextlib.suppress(OSError):
        with open(os.path.join(directory, READY), encoding="utf-8") as f:
            if f.read().strip().isdigit():
                return True
    try:
        return time.time() - os.stat(directory).st_mtime > grace
    except OSError:
        return False


def docker_gateway_dir(handle: str) -> str:
    """Where the gateway of Docker sandbox ``handle`` keeps its files on the worker."""
    return os.path.join(docker_gateway_root(), handle)


def docker_gateway_root() -> str:
    """The directory of every Docker sandbox's gateway on this worker, one per worker user."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"airflow-sandbox-egress-{os.geteuid()}")


_relayed: dict[str, int] = {}


def relay_log(directory: str, logger: logging.Logger = log) -> None:
    """Copy the lines the gateway of ``directory`` logged since the last call to ``logger`` (INFO)."""
    path = os.path.join(directory, LOG)
    try:
        with open(path, "rb") as f:
            f.seek(_relayed.get(path, 0))
            data = f.read()
    except OSError:
        return
    complete = data[: data.rfind(b"\n") + 1]
    _relayed[path] = _relayed.get(path, 0) + len(complete)
    for line in complete.decode(errors="replace").splitlines():
        if line.strip():
            logger.info("%s", line)


@dataclass(frozen=True)
class LocalLaunch:
    """What one local command of a sandbox with a gateway adds: bubblewrap mounts, environment, argv."""

    binds: list[str]
    env: dict[str, str]
    argv: list[str]


def local_launch(directory: str, argv: Sequence[str]) -> LocalLaunch:
    """
    How a local command reaches the gateway of ``directory``: its socket bound read-only at
    :data:`SANDBOX_SOCKET`, the proxy variables, and ``argv`` run through ``guest/egress_forward.sh``.
    """
    from sandbox_provider.hooks.egress import guest

    forward = ["/bin/sh", "-c", guest.program("egress_forward.sh"), "sandbox-egress", str(FORWARD_PORT), SANDBOX_SOCKET]
    return LocalLaunch(
        binds=["--ro-bind", os.path.join(directory, SOCKET), SANDBOX_SOCKET],
        env=proxy_env(),
        argv=[*forward, *argv],
    )


def docker_forward(
    directory: str, pid: int, max_connections: int = MAX_CONNECTIONS
) -> tuple[list[str], dict[str, int]]:
    """
    The forwarder of a Docker sandbox whose container's first process is host pid ``pid``: socat in
    that process's network namespace (``nsenter --net``) listening on ``127.0.0.1:3128``, handing
    connections to the gateway's socket, one child process per connection and at most
    ``max_connections`` + :data:`FORWARD_SPARE` of them (as many more wait to be taken, in the
    kernel's queue); and what the gateway watches (that namespace).

    :raises SandboxTerminalError: if that process's namespace cannot be seen from the worker.
    """
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError as err:
        raise SandboxTerminalError(
            f"The Docker sandbox's network namespace (process {pid}) is not visible on this worker ({err}); an "
            "egress allowlist on Docker needs the Engine on the worker's own host and a root worker."
        ) from err
    children = max_connections + FORWARD_SPARE
    argv = [
        shutil.which("nsenter") or "nsenter",
        f"--target={pid}",
        "--net",
        "--",
        shutil.which("socat") or "socat",
        f"TCP-LISTEN:{FORWARD_PORT},bind=127.0.0.1,reuseaddr,fork,max-children={children},backlog={children}",
        f"UNIX-CONNECT:{os.path.join(directory, SOCKET)}",
    ]
    return argv, {"pid": pid, "netns": inode}


def reach(base: NetworkReach, ports: Sequence[int]) -> NetworkReach:
    """``base`` with what a gateway lets through for hostnames and ranges, listed hosts on ``ports``."""
    shown = ", ".join(str(p) for p in ports)
    proxy = f"http://127.0.0.1:{FORWARD_PORT}"
    return replace(
        base,
        hosts=(
            f"only through the proxy at {proxy} that HTTPS_PROXY and HTTP_PROXY name, which curl, pip, requests and "
            f"urllib use, on port{'s' if len(ports) > 1 else ''} {shown}; the proxy resolves the names, DNS does not "
            "answer inside the sandbox and no address is routed, so a client that ignores the proxy variables fails, "
            "and a site served from the same address and port as a listed host is reached too"
        ),
        cidrs=(
            f"any TCP port, only through the proxy at {proxy} that HTTPS_PROXY and HTTP_PROXY name, with HTTP CONNECT, "
            "so other TCP protocols need a client that tunnels through it; no address is routed otherwise and UDP "
            "goes nowhere; loopback, link-local (cloud metadata) and the worker's own addresses only where a range "
            "names them, never through a catch-all such as 0.0.0.0/0"
        ),
        both="Only listed names are resolved, and only by the proxy.",
    )


def local_gateway_dir(sandbox_dir: str) -> str:
    """Where the gateway of the local sandbox in ``sandbox_dir`` keeps its files."""
    return os.path.join(sandbox_dir, "egress")


def refusal(
    backend: str, spec: SandboxSpec, *, ports: Sequence[int], pins: Mapping[str, Any] | None, **tools: bool
) -> str | None:
    """
    Why the ``backend`` (display name) cannot give ``spec`` its allowlist, phrased as what to change;
    None when it can (or the spec has none). Nothing is started.
    """
    if not spec.has_allowlist:
        return None
    try:
        policy_for("check", spec, ports=ports, pins=pins)
    except ValueError as err:
        return str(err)
    missing = missing_tools(**tools)
    if missing:
        return (
            f"The {backend} backend enforces allow_egress_to and allow_egress_to_cidrs through an egress gateway on "
            f"the worker, which needs {' and '.join(missing)}. Install that, or drop the allow lists."
        )
    return None
