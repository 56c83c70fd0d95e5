"""
The egress gateway process of one sandbox: proxy.py, an HTTP forward proxy (``CONNECT`` tunnels and
absolute ``http://`` requests), listening only on a Unix socket, with :class:`AllowlistPlugin`
deciding every connection attempt by :func:`~sandbox_provider.hooks.egress.rules.decide`.

Its cost is bounded whatever the sandbox does with the socket (threads, connections, flow control,
memory): see :mod:`~sandbox_provider.hooks.egress.bounds`.

Run as ``python -m sandbox_provider.hooks.egress.gateway <config.json>`` by
:func:`sandbox_provider.hooks.egress.start_gateway`, outside the sandbox, as the worker's user.
The configuration file names the policy, the socket, the log, the sandbox's end (Unix seconds) and
what to watch; the process ends by itself at the sandbox's end or when the sandbox is gone, so a
killed worker leaves no gateway past its sandbox. It may also start forwarders (``forward``): the
given command lines, ended with it.

proxy.py's web server, dashboard and every other plugin stay off: the socket answers only as a
forward proxy, and a request that names no destination is refused like any other.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from sandbox_provider.hooks.egress import bounds
from sandbox_provider.hooks.egress.rules import EgressPolicy, decide

#: This module's import name, by which proxy.py loads its plugin (``-m`` runs it as ``__main__``).
_MODULE = "sandbox_provider.hooks.egress.gateway"
#: The environment variable naming the configuration file, for the plugin in proxy.py's processes.
CONFIG_ENV = "SANDBOX_EGRESS_CONFIG"
#: Seconds between two looks at whether the sandbox is still there.
WATCH_EVERY = 0.5

log = logging.getLogger("sandbox_provider.egress")

_config: dict[str, Any] | None = None
_policy: EgressPolicy | None = None


def _load_config() -> dict[str, Any]:
    global _config
    if _config is None:
        with open(os.environ[CONFIG_ENV], encoding="utf-8") as f:
            _config = json.load(f)
    return _config


def _load_policy() -> EgressPolicy:
    global _policy
    if _policy is None:
        _policy = EgressPolicy.from_json(_load_config()["policy"])
    return _policy


def _plugin_class() -> type:
    from proxy.http.exception import HttpRequestRejected
    from proxy.http.proxy import HttpProxyBasePlugin

    class AllowlistPlugin(HttpProxyBasePlugin):
        """Refuses every destination the sandbox's policy does not list; logs each attempt."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._addresses: dict[tuple[str, int], str] = {}

        def before_upstream_connection(self, request: Any) -> Any:
            policy = _load_policy()
            host = request.host.decode("ascii", "replace") if request.host else None
            port = request.port
            kind = "CONNECT" if request.is_https_tunnel else (request.method or b"?").decode("ascii", "replace")
            decision = decide(policy, host, port)
            verdict = "allowed" if decision.allowed else "refused"
            target = f"{host}:{port}" if host else "(no destination)"
            via = f" -> {decision.address}" if decision.allowed else ""
            log.info("sandbox %s egress %s %s %s%s: %s", policy.handle, verdict, kind, target, via, decision.reason)
            if not decision.allowed:
                raise HttpRequestRejected(
                    status_code=403,
                    reason=b"Forbidden",
                    body=f"Refused by the sandbox's egress allowlist: {decision.reason}.\n".encode(),
                )
            assert host is not None and port is not None and decision.address is not None
            self._addresses[(host.lower().rstrip("."), int(port))] = decision.address
            return request

        def resolve_dns(self, host: str, port: int) -> tuple[str | None, None]:
            address = self._addresses.get((host.lower().rstrip("."), int(port)))
            if address is None:  # never resolve what before_upstream_connection did not decide
                raise HttpRequestRejected(status_code=403, reason=b"Forbidden")
            return address, None

    return AllowlistPlugin


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # proxy.py loads plugins by dotted name; the class is built on first use, so importing this
    # module does not need proxy.py.
    if name != "AllowlistPlugin":
        raise AttributeError(name)
    if name not in _built:
        _built[name] = _plugin_class()
    return _built[name]


def _still_there(watch: Mapping[str, Any]) -> bool:
    """Whether the sandbox the gateway serves is still there (its directory, or its network namespace)."""
    if "dir" in watch:
        return os.path.isdir(watch["dir"])
    if "netns" in watch:
        try:
            return os.stat(f"/proc/{int(watch['pid'])}/ns/net").st_ino == int(watch["netns"])
        except OSError:
            return False
    return True


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def _wait_listening(child: subprocess.Popen, port: int, timeout: float = 10.0) -> None:
    """Wait until the forwarder ``child`` listens on 127.0.0.1:``port`` in its network namespace."""
    line = f"0100007F:{port:04X} 00000000:0000 0A"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/net/tcp", encoding="ascii") as f:
                if line in f.read():
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"the egress forwarder did not listen on 127.0.0.1:{port} (status {child.poll()})")


def _proxy_args(config: Mapping[str, Any]) -> list[str]:
    """proxy.py's command line for ``config``: one acceptor, threadless, this module's handler and plugin."""
    return [
        "--unix-socket-path",
        config["socket"],
        "--threadless",
        "--local-executor",
        "1",
        "--num-acceptors",
        "1",
        "--work-klass",
        f"{bounds.__name__}.BoundedHandler",
        "--plugins",
        f"{_MODULE}.AllowlistPlugin",
        "--log-level",
        "ERROR",
        "--timeout",
        "120",
        # Reads of at most READ_BYTES from a side each time it is ready, and sends of up to 1 MiB to
        # the other: more than it reads, so a side that keeps up is not held back by the gateway.
        "--client-recvbuf-size",
        str(bounds.READ_BYTES),
        "--server-recvbuf-size",
        str(bounds.READ_BYTES),
        "--max-sendbuf-size",
        str(1024 * 1024),
    ]


def serve(config: Mapping[str, Any]) -> int:
    """Run the gateway ``config`` describes until the sandbox ends or is gone; the exit status."""
    from proxy import Proxy

    limits = bounds.Bounds.of(_load_policy().handle, config)
    handler = bounds.LogBudget(config["log"], limits.log_bytes)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S%z"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("proxy").setLevel(logging.ERROR)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    bounds.configure(limits)
    bounds.limit_process(limits)
    children: list[subprocess.Popen] = []
    with Proxy(_proxy_args(config)) as proxy:
        os.chmod(config["socket"], int(config.get("socket_mode", 0o666)))
        try:
            for argv in config.get("forward", []):
                children.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
                _wait_listening(children[-1], int(config["forward_port"]))
            # Whole or not there: a sweep on this worker that read an empty pid file would take the
            # gateway for one that had ended, and remove its directory (its socket with it).
            partial = f"{config['ready']}.partial"
            with open(partial, "w") as ready:
                ready.write(str(os.getpid()))
            os.replace(partial, config["ready"])
            watch = config.get("watch", {})
            while not stopping and time.time() < float(config["expires_at"]) and _still_there(watch):
                ended = _ended(children, proxy.acceptors.acceptors if proxy.acceptors else [])
                if ended:
                    log.info("sandbox %s egress %s; the gateway stops", _load_policy().handle, ended)
                    break
                time.sleep(WATCH_EVERY)
        finally:
            _stop(children)
    return 0


def _ended(children: list[subprocess.Popen], acceptors: list[Any]) -> str | None:
    """What of the gateway's own processes ended (a forwarder, proxy.py's acceptor), in words; None if none."""
    if any(child.poll() is not None for child in children):
        return "forwarder ended"
    for acceptor in acceptors:
        if not acceptor.is_alive():
            return (
                f"connection acceptor ended (status {acceptor.exitcode}), having met the gateway's cap on open "
                "descriptors or memory"
            )
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m sandbox_provider.hooks.egress.gateway CONFIG.json", file=sys.stderr)
        return 2
    os.environ[CONFIG_ENV] = os.path.abspath(argv[1])
    with open(argv[1], encoding="utf-8") as f:
        config = json.load(f)
    return serve(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
