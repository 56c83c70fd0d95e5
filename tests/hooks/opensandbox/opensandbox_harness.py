"""
The real ``opensandbox-server`` (from PyPI), started by the tests on loopback against the local Docker
Engine, with the project's guest daemon as its execd image.

``scripts/setup.sh`` installs the server into ``.venv-opensandbox-server`` (it needs a newer FastAPI than
Airflow allows); ``scripts/docker/prepare.sh`` builds the execd image (``SANDBOX_EXECD_IMAGE`` names
another one, built by ``scripts/docker/opensandbox-execd-image.sh``). The guest daemon in it waits about a
second after each command as the vendor's does; a sandbox whose env holds ``FAST`` does not. Every sandbox container this server
creates carries ``AIRFLOW_SANDBOX_TEST_SERVER=<token>`` in its environment, which is how :meth:`cleanup`
finds exactly this server's containers on an Engine that others use at the same time. The
``opensandbox_server`` fixture in ``conftest.py`` runs one per session.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
#: The guest daemon and its entrypoint, beside this file: test infrastructure, never in the wheel.
GUEST = Path(__file__).resolve().parent
SANDBOX_IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
EXECD_IMAGE = os.environ.get("SANDBOX_EXECD_IMAGE", "airflow-sandbox-execd:bookworm")
MARK = "AIRFLOW_SANDBOX_TEST_SERVER"
#: The env that turns off the guest daemon's wait after each command, for tests that run many commands.
FAST = {"EXECD_API_GRACE_SHUTDOWN": "0"}


def server_binary() -> Path:
    """The ``opensandbox-server`` executable: ``SANDBOX_OPENSANDBOX_SERVER`` or the repository's own."""
    configured = os.environ.get("SANDBOX_OPENSANDBOX_SERVER")
    if configured:
        return Path(configured)
    venv = os.environ.get("SANDBOX_OPENSANDBOX_SERVER_VENV") or str(REPO / ".venv-opensandbox-server")
    return Path(venv) / "bin" / "opensandbox-server"


def missing_prerequisite(docker_client) -> str | None:
    """Why the server tier cannot run here, or None when the binary and both images are ready."""
    if not server_binary().exists():
        return f"{server_binary()} is missing (bash scripts/setup.sh installs it)"
    import docker

    for image in (SANDBOX_IMAGE, EXECD_IMAGE):
        try:
            docker_client.images.get(image)
        except docker.errors.ImageNotFound:
            return f"the Engine has no image {image!r}"
    if execd_in_image(docker_client) != (GUEST / "opensandbox_execd.py").read_bytes():
        return f"{EXECD_IMAGE} holds an older guest daemon than the repository"
    return None


def execd_in_image(docker_client) -> bytes:
    """The bytes of ``/execd`` in the execd image, read the way the server reads them."""
    import io
    import tarfile

    container = docker_client.containers.create(EXECD_IMAGE, command=["true"])
    try:
        stream, _ = container.get_archive("/execd")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
            return archive.extractfile("execd").read()
    finally:
        container.remove(force=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + " }"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


class OpenSandboxServer:
    """
    One ``opensandbox-server`` process on ``127.0.0.1``, its state (config, sqlite store, metadata files)
    under ``root``, its sandboxes published on loopback only.

    :param egress_mode: the ``[egress] mode`` the config declares (``dns`` or ``dns+nft``).
    """

    def __init__(self, root: Path, docker_client, *, egress_mode: str = "dns+nft") -> None:
        self.root = root
        self.docker = docker_client
        self.port = _free_port()
        self.api_key = secrets.token_urlsafe(24)
        self.token = secrets.token_hex(8)
        self.egress_mode = egress_mode
        self.process: subprocess.Popen | None = None
        (root / "home").mkdir(parents=True, exist_ok=True)
        self.config_path = root / "config.toml"
        self.log_path = root / "server.log"
        self.config_path.write_text(self._config())

    @property
    def domain(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> str:
        sections = {
            "server": {"host": "127.0.0.1", "port": self.port, "api_key": self.api_key},
            "log": {"level": "INFO"},
            "runtime": {"type": "docker", "execd_image": EXECD_IMAGE},
            "store": {"type": "sqlite", "path": str(self.root / "home" / "opensandbox.db")},
            "docker": {
                "network_mode": "bridge",
                "publish_host": "127.0.0.1",
                "sandbox_env": {MARK: self.token},
            },
            # No egress sidecar image can be had here. A local image that is none (so nothing is pulled from a
            # registry) makes a sandbox with a policy fail fast, as on a server whose sidecar cannot start.
            "egress": {"image": SANDBOX_IMAGE, "mode": self.egress_mode, "readiness_timeout_seconds": 2},
        }
        lines = []
        for name, values in sections.items():
            lines.append(f"[{name}]")
            lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)

    def start(self, timeout: float = 120.0) -> None:
        """Start the process and wait until ``/health`` answers; raises RuntimeError with its log otherwise."""
        env = {**os.environ, "HOME": str(self.root / "home")}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(server_binary()), "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"opensandbox-server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.domain}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"opensandbox-server did not answer /health within {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 20 s); its sandboxes keep running."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def connection_config(self, **overrides):
        """
        A fresh ``ConnectionConfigSync`` for this server (the SDK closes it with each sandbox); a sandbox's
        access token goes in ``headers={"X-EXECD-ACCESS-TOKEN": token}``.
        """
        from datetime import timedelta

        from opensandbox.config import ConnectionConfigSync

        options = {"domain": self.domain, "api_key": self.api_key, "request_timeout": timedelta(seconds=30)}
        return ConnectionConfigSync(**{**options, **overrides})

    def sandbox_container(self, sandbox_id: str):
        """The server's Docker container for ``sandbox_id`` (``sandbox-<id>``), or None when there is none."""
        import docker

        try:
            return self.docker.containers.get(f"sandbox-{sandbox_id}")
        except docker.errors.NotFound:
            return None

    def own_containers(self) -> list:
        """Every container on the Engine that this server created (found by its environment mark)."""
        mine = []
        for container in self.docker.containers.list(all=True, ignore_removed=True, filters={"name": "sandbox-"}):
            env = container.attrs.get("Config", {}).get("Env") or []
            if f"{MARK}={self.token}" in env:
                mine.append(container)
        return mine

    def cleanup(self) -> None:
        """Stop the server and remove what it created and left: containers and their runtime volumes."""
        self.stop()
        for container in self.own_containers():
            sandbox_id = container.name.removeprefix("sandbox-")
            container.remove(force=True)
            for name in (f"sandbox-egress-{sandbox_id}", f"opensandbox-runtime-{sandbox_id}"):
                for remove in (self.docker.containers.get, self.docker.volumes.get):
                    try:
                        remove(name).remove(force=True)
                    except Exception:  # noqa: BLE001 - absent is the usual case
                        pass
