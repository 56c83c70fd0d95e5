"""
Sandboxes as containers on a Docker Engine, driven through the ``docker`` SDK.

How the pieces map onto the Engine:

- **A sandbox** is a container named ``airflow-sandbox-<hex>`` (the handle) with the label
  ``airflow_sandbox``. Its main process is ``sleep <lifetime>`` under the Engine's init
  (``--init``), so it idles, reaps orphans and ends on its own.
- **The lifetime is the Engine's job, not the worker's.** The container is created with
  auto-remove: when ``sleep`` reaches the end of ``sandbox_timeout`` the container stops, and the
  daemon itself deletes it. A worker that is killed mid-task, or a machine that loses the worker,
  leaves nothing running past the lifetime, and no sweeper has to run for that to hold.
  :meth:`DockerSandboxHook.remove_expired` is still there for containers left over by daemons
  restarted mid-lifetime and the like.
- **Isolation**: no privileged mode, every capability dropped except the few a root shell needs
  to manage its own files and processes (chown, override file permissions, set ids, kill),
  ``no-new-privileges``, CPU, memory (no swap beyond it) and process-count limits. The Docker
  socket is never mounted and nothing from the worker's environment is passed; only ``spec.env``.
- **Network**: ``block_network=True`` gives the container no interface but loopback
  (network mode ``none``). ``block_network=False`` joins the default bridge, or the network named
  in the connection. Allow lists are refused until egress enforcement exists for this backend.
- **Commands** run through exec under coreutils ``timeout -s KILL`` inside the container, so the
  deadline is enforced where the process tree runs, even with the worker gone: ``timeout`` leads
  its own process group and at the deadline sends SIGKILL to the whole group, which also stops
  children that ignore SIGTERM. (A SIGTERM first would not do: once the direct child dies of it,
  ``timeout`` stops and leaves the rest of the group running.) After the deadline, and after a
  command that ended by itself, every process the container's init adopted (background jobs,
  ``nohup`` and ``setsid`` daemons) is killed too, so nothing a command started outlives it. A
  sandbox therefore runs one command at a time. The container stays usable. The worker waits a
  short grace past the deadline, then stops reading in any case.
- **Files** go over the Engine's archive API as tar streams built and read with :mod:`tarfile`,
  one piece at a time, so memory stays bounded whatever the file size. Paths and symbolic links
  are resolved by the Engine inside the container, as a process there would see them.
"""

from __future__ import annotations

import io
import json
import logging
import math
import posixpath
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, ClassVar

from sandbox_provider.hooks.forms.docker import FORM
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles, check_export_size
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    check_byte_count,
    is_named_sandbox,
)

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

__all__ = ["DockerSandboxBackend", "DockerSandboxHook", "DockerSandboxInfo"]

#: The label every sandbox container of this provider carries; its value is the handle.
SANDBOX_LABEL = "airflow_sandbox"
#: Image used when neither the hook nor the connection names one.
#: Seconds for one API call to the Engine (command output streams are not bound by it).
API_TIMEOUT = 60
#: Capabilities kept; all others are dropped.
KEPT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")
#: Seconds the Engine may take past a deadline to end a killed command's stream.
KILL_AFTER = 2.0
#: Seconds the worker waits past a deadline for the Engine to end the command's stream.
WAIT_GRACE = 10.0
#: Longest deadline sent for a command when the sandbox's own end is unknown (30 days).
MAX_COMMAND_SECONDS = 30 * 24 * 3600.0
#: Shortest deadline sent: coreutils ``timeout`` reads a deadline of 0 as none at all.
MIN_COMMAND_SECONDS = 0.001
#: Largest holder stamp file read back; the provider writes a few hundred bytes.
TAGS_MAX_BYTES = 64 * 1024
#: Bytes per piece when moving files.
CHUNK_BYTES = 1024 * 1024
#: Sources up to this size are spooled in memory before upload; larger ones go to a temp file.
SPOOL_MEMORY_BYTES = 8 * 1024 * 1024
#: Where the changeable stamps (the holder) live inside the container; see ``write_tags``.
TAGS_DIR = ".airflow-sandbox"
TAGS_FILE = "/" + TAGS_DIR + "/tags.json"
#: Stamps fixed as labels when the container is created.
_LABEL_STAMPS = (OWNER_TAG, EXPIRES_AT_TAG, NETWORK_TAG, WORKDIR_TAG)
_PULL_POLICIES = ("missing", "never", "always")
#: How messages name the Engine of a connection without a host.
_DEFAULT_ENGINE = "the Docker Engine that DOCKER_HOST or the local socket names"

# Go's os.FileMode bits, as the Engine reports them in a path stat.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_TYPE = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
_SYMLINK_HOPS = 40
#: The characters a container name may hold, as the Engine allows them.


@dataclass(frozen=True)
class DockerSandboxInfo:
    """
    One sandbox container this provider created, as :meth:`DockerSandboxHook.list_sandboxes` finds it.

    :param handle: the container name, which is the sandbox handle.
    :param owner: the owner stamp, or None.
    :param expires_at: Unix time (seconds) when the Engine ends it, or None if unknown.
    :param status: the Engine's container status (``running``, ``exited``, ...).
    """

    handle: str
    owner: str | None
    expires_at: float | None
    status: str

    def expired(self, now: float | None = None) -> bool:
        """True when the lifetime has run out at ``now`` (default: the current time)."""
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)


class _ChunkReader(io.RawIOBase):
    """A read-only binary file over an iterator of byte chunks (an archive download)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


class DockerSandboxHook(ShellFiles, Attachable, SandboxHook):
    """
    Provision sandboxes as containers on a Docker Engine.

    Connection (type ``sandbox_docker``, default id ``sandbox_docker_default``; when that default
    connection is not defined, the worker's own Engine is used as ``DOCKER_HOST`` or the local
    socket names it):

    - ``host``: the daemon address, ``unix:///var/run/docker.sock`` or ``tcp://host:2376``.
    - ``login`` / ``password``: registry credentials, used only to pull an image that is missing.
    - extras ``tls_ca_cert``, ``tls_client_cert``, ``tls_client_key`` (paths on the worker) and
      ``tls_verify`` for a TLS-protected daemon.
    - extras ``image``, ``network``, ``cpus``, ``memory_bytes``, ``pids_limit``,
      ``sandbox_timeout``: defaults that the hook arguments below override.

    :param sandbox_conn_id: the Airflow connection to read.
    :param image: the image sandboxes run; default the connection's, else ``python:3.12-slim``. It
        needs ``sh``, ``sleep`` and coreutils ``timeout``.
    :param cpus: CPUs per sandbox (fractions allowed); default 1.
    :param memory_bytes: memory limit per sandbox in bytes, swap included; default 1 GiB.
    :param pids_limit: most processes at once per sandbox; default 512.
    :param sandbox_timeout: lifetime in seconds, after which the Engine stops and removes the
        container; default 3600.
    :param network: Docker network joined when a spec sets ``block_network=False``; default
        ``bridge``.
    :param pull: ``"missing"`` (default) pulls an image the Engine lacks, ``"never"`` refuses,
        ``"always"`` pulls before each create.
    :raises ValueError: for a non-positive limit or an unknown pull policy.
    """

    name: ClassVar[str] = "docker"
    display_name: ClassVar[str] = "Docker"
    capabilities = Capabilities(
        max_command_seconds=MAX_COMMAND_SECONDS,
        network=NetworkReach(
            blocked="has no network access at all, not even DNS: its container has only a loopback interface",
            open=(
                "has outbound network access through the Docker network the backend is set to ('bridge' unless its "
                "network setting names another): any host and port the Docker host can reach, DNS included, and "
                "other containers on that network"
            ),
        ),
        advice=(
            "Drop the allow lists to keep the network blocked, set block_network=False to give the sandbox the open "
            "network of the connection's Docker network, or use a backend that enforces allow lists."
        ),
    )
    form = FORM

    def __init__(
        self,
        sandbox_conn_id: str = FORM.default_conn_name,
        *,
        image: str | None = None,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        pids_limit: int | None = None,
        sandbox_timeout: float | None = None,
        network: str | None = None,
        pull: str = "missing",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(sandbox_conn_id, str) or not sandbox_conn_id.strip():
            raise ValueError(f"sandbox_conn_id must be a connection id, got {sandbox_conn_id!r}.")
        if image is not None and (not isinstance(image, str) or not image.strip()):
            raise ValueError(f"image must be an image reference such as 'python:3.12-slim', got {image!r}.")
        if network is not None and (not isinstance(network, str) or not network.strip()):
            raise ValueError(f"network must be the name of a Docker network, got {network!r}.")
        if pull not in _PULL_POLICIES:
            raise ValueError(f"pull must be one of {', '.join(_PULL_POLICIES)}; got {pull!r}.")
        self.sandbox_conn_id = sandbox_conn_id
        self._args = self.settings.check_args(
            {
                "image": image,
                "network": network,
                "cpus": cpus,
                "memory_bytes": memory_bytes,
                "pids_limit": pids_limit,
                "sandbox_timeout": sandbox_timeout,
            }
        )
        self.image = image
        self.pull = pull
        self._lock = threading.Lock()
        self._client_obj: docker.DockerClient | None = None
        self._settings_obj: dict[str, Any] | None = None
        self._where = _DEFAULT_ENGINE

    # -- connection ------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is not None:
            return self._settings_obj
        from airflow.exceptions import AirflowNotFoundException

        host = login = password = None
        extra: dict[str, Any] = {}
        try:
            conn = self.get_connection(self.sandbox_conn_id)
        except AirflowNotFoundException:
            if self.sandbox_conn_id != self.default_conn_name:
                raise SandboxTerminalError(
                    f"The Airflow connection {self.sandbox_conn_id!r} does not exist. Define it with type "
                    f"sandbox_docker, or leave sandbox_conn_id unset to use the worker's own Docker Engine."
                ) from None
            log.debug("No connection %r; using the worker's Docker Engine defaults", self.sandbox_conn_id)
        else:
            host, login, password = conn.host or None, conn.login or None, conn.password or None
            extra = dict(conn.extra_dejson or {})
        try:
            settings = self.settings.resolve(self._args, extra, conn_id=self.sandbox_conn_id)
        except ValueError as err:
            raise SandboxTerminalError(f"{err} Fix the extra or pass the setting to the hook.") from None
        settings.update(host=host, login=login, password=password)
        self._settings_obj = settings
        return settings

    def _client(self) -> docker.DockerClient:
        with self._lock:
            if self._client_obj is not None:
                return self._client_obj
            try:
                import docker
            except ImportError as err:
                from airflow.exceptions import AirflowOptionalProviderFeatureException

                raise AirflowOptionalProviderFeatureException(
                    "The Docker sandbox backend needs the docker package: pip install 'airflow-provider-sandbox[docker]'."
                ) from err
            settings = self._resolved()
            host = settings["host"]
            if host and "://" not in host:
                host = ("unix://" + host) if host.startswith("/") else ("tcp://" + host)
            tls: Any = False
            cert, key, ca = settings["tls_client_cert"], settings["tls_client_key"], settings["tls_ca_cert"]
            if cert or key or ca or settings["tls_verify"]:
                if bool(cert) != bool(key):
                    raise SandboxTerminalError(
                        f"Connection {self.sandbox_conn_id!r} names only one of tls_client_cert and tls_client_key; "
                        "a client certificate needs both."
                    )
                verify = settings["tls_verify"]
                tls = docker.tls.TLSConfig(
                    client_cert=(cert, key) if cert else None,
                    ca_cert=ca,
                    verify=bool(ca) if verify is None else (ca if (verify and ca) else bool(verify)),
                )
            self._where = f"the Docker Engine at {host}" if host else _DEFAULT_ENGINE
            try:
                if host:
                    client = docker.DockerClient(base_url=host, version="auto", tls=tls, timeout=API_TIMEOUT)
                else:
                    client = docker.DockerClient.from_env(version="auto", timeout=API_TIMEOUT)
            except Exception as err:  # the SDK raises DockerException, requests or OS errors alike
                raise self._unreachable(err) from err
            self._client_obj = client
            return client

    def _unreachable(self, err: BaseException) -> SandboxTerminalError:
        return SandboxTerminalError(
            f"Cannot reach {self._where} for connection {self.sandbox_conn_id!r}: {err}. Start the Docker "
            "daemon, or fix the connection's host (and TLS extras) so the Engine can be reached from here."
        )

    def _engine_error(self, err: BaseException, doing: str, handle: str | None = None) -> SandboxError:
        """Map an SDK error to the contract's errors."""
        import docker.errors
        import requests

        if isinstance(err, docker.errors.NotFound) and handle:
            self._known_expiry.pop(handle, None)
            return SandboxTerminalError(
                f"Sandbox {handle!r} does not exist on {self._where} (connection {self.sandbox_conn_id!r}): it was "
                "destroyed or reached the end of its lifetime."
            )
        if isinstance(err, docker.errors.APIError) and err.status_code == 409 and handle:
            return SandboxTerminalError(
                f"Sandbox {handle!r} is not running on {self._where}: it has ended, or is being removed. "
                f"({err.explanation or err})"
            )
        if isinstance(err, (requests.exceptions.ConnectionError, ConnectionError)):
            return self._unreachable(err)
        if isinstance(err, docker.errors.APIError) and (err.status_code or 0) >= 500:
            return SandboxTerminalError(f"{self._where} failed while {doing}: {err.explanation or err}")
        return SandboxError(f"{self._where} refused {doing}: {getattr(err, 'explanation', None) or err}")

    # -- lifecycle -------------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        spec = request.spec
        settings = self._resolved()
        client = self._client()
        api = client.api
        lifetime = request.lifetime
        handle = request.name
        labels = {**request.stamps, SANDBOX_LABEL: handle}
        memory = int(settings["memory_bytes"])
        host_config = api.create_host_config(
            init=True,
            auto_remove=True,
            network_mode="none" if spec.block_network else settings["network"],
            cap_drop=["ALL"],
            cap_add=list(KEPT_CAPABILITIES),
            security_opt=["no-new-privileges"],
            privileged=False,
            nano_cpus=int(float(settings["cpus"]) * 1e9),
            mem_limit=memory,
            memswap_limit=memory,
            pids_limit=int(settings["pids_limit"]),
        )
        kwargs = {
            "image": settings["image"],
            "name": handle,
            "entrypoint": ["sleep", str(math.ceil(lifetime))],
            "command": [],
            "environment": dict(spec.env or {}),
            "working_dir": self.workdir,
            "labels": labels,
            "host_config": host_config,
            "hostname": "sandbox",
        }
        if settings["image"] and self.pull == "always":
            self._pull(settings["image"])
        container_id = self._create_container(kwargs)
        try:
            api.start(container_id)
        except Exception as err:
            self._remove_quietly(container_id)
            raise SandboxTerminalError(
                f"Sandbox container {handle} did not start on {self._where} (connection "
                f"{self.sandbox_conn_id!r}): {getattr(err, 'explanation', None) or err}"
            ) from err
        log.info(
            "Started Docker sandbox %s from %s on %s, lifetime %ss", handle, settings["image"], self._where, lifetime
        )
        return handle

    def _create_container(self, kwargs: dict[str, Any]) -> str:
        import docker.errors

        api = self._client().api
        image = kwargs["image"]
        for attempt in (1, 2):
            try:
                return api.create_container(**kwargs)["Id"]
            except docker.errors.ImageNotFound as err:
                if attempt == 2 or self.pull == "never":
                    raise SandboxTerminalError(
                        f"Image {image!r} is not on {self._where} (connection {self.sandbox_conn_id!r}) and this hook "
                        "does not pull it (pull='never'). Load or build it there (scripts/docker/prepare.sh builds "
                        "the project's test image), or name another image in the connection's image extra."
                    ) from err
                self._pull(image)
            except Exception as err:
                raise self._engine_error(err, "creating a sandbox container") from err
        raise AssertionError("unreachable")

    def _pull(self, image: str) -> None:
        settings = self._resolved()
        auth = None
        if settings["login"]:
            auth = {"username": settings["login"], "password": settings["password"] or ""}
        log.info("Pulling image %s on %s", image, self._where)
        try:
            # The SDK splits the reference into repository and tag (or digest) itself.
            self._client().api.pull(image, auth_config=auth)
        except Exception as err:
            raise SandboxTerminalError(
                f"Image {image!r} is not on {self._where} (connection {self.sandbox_conn_id!r}) and could not be "
                f"pulled: {getattr(err, 'explanation', None) or err}. Load or build the image on that Engine "
                "(scripts/docker/prepare.sh builds the project's test image), set the connection's login and "
                "password for a private registry, or name another image in the connection's image extra."
            ) from err

    def _remove_quietly(self, container: str) -> None:
        try:
            self._client().api.remove_container(container, force=True)
        except Exception:
            log.warning("Could not remove sandbox container %s", container, exc_info=True)

    def _destroy(self, handle: str) -> None:
        # A sandbox that is gone (destroyed, or removed at the end of its lifetime) is not an error.
        import docker.errors

        try:
            self._client().api.remove_container(handle, force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as err:
            if err.status_code == 409:  # the Engine's own auto-remove is already under way
                return
            raise self._engine_error(err, f"removing sandbox {handle!r}") from err
        except Exception as err:
            raise self._engine_error(err, f"removing sandbox {handle!r}") from err

    # -- commands --------------------------------------------------------------------------------------

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        # The deadline is enforced inside the container by coreutils ``timeout``, which SIGKILLs the
        # command's whole process group, rounded up to whole milliseconds (never 0, which ``timeout``
        # reads as no deadline). The base caps deadlines at 30 days.
        if not _is_utf8(command):
            raise SandboxError(
                "command must be valid UTF-8 text; it holds characters that cannot be encoded (undecodable "
                "bytes carried as surrogates)."
            )
        deadline = _deadline_arg(timeout)
        budget = float(deadline)
        api = self._client().api
        argv = ["sh", "-c", guest.program("docker_run.sh"), "sandbox-run", deadline, command]
        try:
            exec_id = api.exec_create(handle, argv, stdout=True, stderr=True, stdin=False, tty=False)["Id"]
            began = time.monotonic()
            stream = api.exec_start(exec_id, stream=True, demux=True)
        except Exception as err:
            raise self._engine_error(err, "starting a command", handle) from err
        failure: list[BaseException] = []

        def pump() -> None:
            try:
                for chunk_out, chunk_err in stream:
                    if chunk_out:
                        output.stdout(chunk_out)
                    if chunk_err:
                        output.stderr(chunk_err)
            except Exception as exc:  # reported below; a closed stream ends here too
                failure.append(exc)

        reader = threading.Thread(target=pump, daemon=True, name=f"docker-exec-{handle}")
        reader.start()
        reader.join(budget + KILL_AFTER + WAIT_GRACE)
        abandoned = reader.is_alive()
        if abandoned:
            log.warning("Command in sandbox %s outlived its deadline; no longer waiting for its output", handle)
            try:
                stream.close()
            except Exception:  # closing a stream the Engine already ended is harmless
                log.debug("Closing the output stream of sandbox %s failed", handle, exc_info=True)
            reader.join(5)
        elapsed = time.monotonic() - began
        try:
            exit_code = api.exec_inspect(exec_id).get("ExitCode")
        except Exception as exc:
            raise self._engine_error(exc, "reading a command's exit status", handle) from exc
        terminated = False
        if exit_code is None or exit_code >= 128 or failure:
            try:
                terminated = not self._is_running(handle)
            except Exception as exc:
                raise self._engine_error(exc, "checking the sandbox after a command", handle) from exc
        timed_out = abandoned or (exit_code in (124, 137) and elapsed >= budget and not terminated)
        return RunOutcome(
            exit_code=-1 if exit_code is None else int(exit_code), timed_out=timed_out, sandbox_terminated=terminated
        )

    def _remaining_lifetime(self, handle: str) -> float | None:
        # The expiry label, read once per handle; a sandbox without one has no known end.
        expires = self._known_expiry.get(handle)
        if expires is None:
            expires = self._known_expiry[handle] = _expiry_of(self._container_labels(handle))
        return expires - time.time()

    def _is_running(self, handle: str) -> bool:
        import docker.errors

        try:
            state = self._client().api.inspect_container(handle)["State"]
        except docker.errors.NotFound:
            self._known_expiry.pop(handle, None)
            return False
        return bool(state.get("Running")) and not state.get("Paused")

    # -- files -----------------------------------------------------------------------------------------

    def _abs(self, path: str) -> str:
        if not isinstance(path, str):
            raise SandboxError(f"A path must be a string, got {type(path).__name__} {path!r}.")
        if not path:
            raise SandboxError(
                "The path is empty; name a file, relative to the sandbox's working directory or absolute."
            )
        if "\0" in path:
            raise SandboxError(f"{path!r} contains a NUL character, which no path in the sandbox can hold.")
        if not _is_utf8(path):
            raise SandboxError(
                f"{path!r} is not valid UTF-8 (it carries undecodable bytes as surrogates); paths in a Docker "
                "sandbox must be valid UTF-8 text."
            )
        joined = path if path.startswith("/") else posixpath.join(self.workdir, path)
        return posixpath.normpath(joined).replace("//", "/")

    def _stat(self, handle: str, path: str) -> dict[str, Any] | None:
        """The Engine's stat of ``path`` in the container (not following a final symlink), or None if missing."""
        import docker.errors
        from docker.utils import decode_json_header

        api = self._client().api
        # The SDK has no call for the archive API's HEAD (the stat ``docker cp`` makes first), so
        # it goes through the SDK's own session, URL builder and error mapping.
        try:
            res = api.head(api._url("/containers/{0}/archive", handle), params={"path": path}, timeout=API_TIMEOUT)
            if res.status_code == 404 and "x-docker-container-path-stat" not in res.headers:
                # A missing path and a missing container both answer 404; tell them apart.
                if not self._is_running(handle):
                    raise docker.errors.NotFound(f"No such container: {handle}")
                return None
            if res.status_code >= 500 and self._is_running(handle):
                # A HEAD answer has no body; the Engine fails this way on a path through a file.
                raise SandboxError(
                    f"{path!r} cannot be looked up in the sandbox: a part of it is not a directory, or is "
                    f"not accessible (status {res.status_code})."
                )
            api._raise_for_status(res)
        except SandboxError:
            raise
        except Exception as err:
            raise self._engine_error(err, f"looking up {path!r}", handle) from err
        header = res.headers.get("x-docker-container-path-stat")
        return decode_json_header(header) if header else None

    def _resolve(self, handle: str, path: str) -> tuple[str, dict[str, Any] | None]:
        """Follow symbolic links as the container sees them; return the final path and its stat (None if missing)."""
        current = self._abs(path)
        for _ in range(_SYMLINK_HOPS):
            info = self._stat(handle, current)
            if info is None or not int(info.get("mode", 0)) & _GO_MODE_SYMLINK:
                return current, info
            target = info.get("linkTarget") or ""
            if not target:
                return current, info
            current = (
                target
                if target.startswith("/")
                else posixpath.normpath(posixpath.join(posixpath.dirname(current), target))
            )
        raise SandboxError(f"{path!r} has too many levels of symbolic links.")

    def _regular_file(self, handle: str, path: str, max_bytes: int, verb: str) -> tuple[str, int]:
        resolved, info = self._resolve(handle, path)
        if info is None:
            raise SandboxError(f"{path!r} does not exist in the sandbox, or cannot be read.")
        mode = int(info.get("mode", 0))
        if mode & _GO_MODE_DIR:
            raise SandboxError(f"{path!r} is a directory; list it with list_directory.")
        if mode & _GO_MODE_TYPE:
            raise SandboxError(f"{path!r} is not a regular file; only a regular file can be {verb}.")
        size = int(info.get("size", 0))
        if size > max_bytes:
            raise SandboxFileTooLargeError(path, size, max_bytes)
        return resolved, size

    def _download(self, handle: str, resolved: str, path: str, sink: IO[bytes], max_bytes: int) -> int:
        """Stream the one regular file at ``resolved`` into ``sink``; return the bytes written."""
        api = self._client().api
        try:
            chunks, _ = api.get_archive(handle, resolved, chunk_size=CHUNK_BYTES)
        except Exception as err:
            raise self._engine_error(err, f"reading {path!r}", handle) from err
        reader = io.BufferedReader(_ChunkReader(iter(chunks)), buffer_size=CHUNK_BYTES)
        copied = 0
        try:
            with tarfile.open(fileobj=reader, mode="r|", bufsize=CHUNK_BYTES) as archive:
                member = archive.next()
                if member is None or not member.isreg():
                    raise SandboxError(f"{path!r} is not a regular file; only a regular file can be read.")
                if member.size > max_bytes:
                    raise SandboxFileTooLargeError(path, member.size, max_bytes)
                source = archive.extractfile(member)
                assert source is not None
                while True:
                    piece = source.read(CHUNK_BYTES)
                    if not piece:
                        break
                    copied += len(piece)
                    sink.write(piece)
        except SandboxError:
            raise
        except tarfile.TarError as err:
            raise SandboxError(f"The Engine sent an unreadable archive for {path!r}: {err}") from err
        except Exception as err:
            raise self._engine_error(err, f"reading {path!r}", handle) from err
        finally:
            reader.close()
        return copied

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path``; relative paths resolve in the workdir and
        symbolic links are followed inside the container.

        The size is checked before any content moves, so no more than ``max_bytes`` is transferred.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, a directory or not a regular file.
        :raises SandboxTerminalError: if the sandbox is gone.
        """
        self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        resolved, _ = self._regular_file(handle, path, int(max_bytes), "read")
        buffer = io.BytesIO()
        self._download(handle, resolved, path, buffer, int(max_bytes))
        return buffer.getvalue()

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Copy the regular file at ``path`` into the writable binary ``stream``; return the bytes copied.

        The archive is read one 1 MiB piece at a time, so memory stays bounded for any size.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed while it was copied.
        :raises SandboxTerminalError: if the sandbox is gone.
        """
        self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        resolved, size = self._regular_file(handle, path, int(max_bytes), "exported")
        copied = self._download(handle, resolved, path, stream, int(max_bytes))
        check_export_size(path, size, copied)
        return copied

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """
        List the entries of the directory at ``path`` as ``(name, is_directory)`` pairs, sorted by name.

        :raises SandboxError: if ``path`` is unusable, missing or not a directory.
        """
        self.check_handle(handle)
        self._abs(path)
        return super().list_directory(handle, path)

    def write_file(self, handle: str, path: str, data: bytes) -> None:
        """
        Write ``data`` to ``path``, creating parent directories and replacing what was there
        (through a symbolic link, as a shell redirection would).

        :raises SandboxError: if the path cannot be written (a directory there, say).
        """
        if isinstance(data, str):
            data = data.encode()
        self.import_file(handle, path, io.BytesIO(data))

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into the file at ``path`` over the archive API; return the bytes written.

        A source that cannot report its size is spooled first (memory up to 8 MiB, then a temporary
        file), because a tar header carries the size. Parent directories are created; an existing
        file keeps its permission bits.

        :raises SandboxError: if the path is a directory or cannot be written.
        :raises SandboxTerminalError: if the sandbox is gone.
        """
        import docker.errors

        self.check_handle(handle)
        resolved, info = self._resolve(handle, path)
        if info is not None and int(info.get("mode", 0)) & _GO_MODE_DIR:
            raise SandboxError(f"{path!r} is a directory; write to a file path inside it.")
        mode = (int(info.get("mode", 0)) & 0o7777) if info is not None else 0o644
        parent, name = posixpath.split(resolved)
        if not name:
            raise SandboxError(f"{path!r} names no file.")
        if info is None:
            parent_info = self._stat(handle, parent)
            if parent_info is None:
                self._mkdir(handle, parent, path)
            elif not int(parent_info.get("mode", 0)) & (_GO_MODE_DIR | _GO_MODE_SYMLINK):
                raise SandboxError(f"Cannot write {path!r}: {parent!r} is not a directory.")
        spooled: IO[bytes] | None = None
        size = _remaining_size(source)
        if size is None:
            spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115 (closed below)
            shutil.copyfileobj(source, spooled, CHUNK_BYTES)
            size = spooled.tell()
            spooled.seek(0)
            source = spooled
        member = tarfile.TarInfo(name)
        member.size = size
        member.mode = mode
        member.mtime = int(time.time())
        sent = [0]

        def body() -> Iterator[bytes]:
            yield member.tobuf(format=tarfile.PAX_FORMAT)
            while sent[0] < size:
                piece = source.read(min(CHUNK_BYTES, size - sent[0]))
                if not piece:
                    break
                sent[0] += len(piece)
                yield piece
            if sent[0] < size:  # a source that shrank; pad so the archive stays well-formed, then refuse
                yield bytes(size - sent[0])
            pad = (-size) % tarfile.BLOCKSIZE
            yield bytes(pad + 2 * tarfile.BLOCKSIZE)

        try:
            self._client().api.put_archive(handle, parent, body())
        except docker.errors.NotFound as err:
            if not self._is_running(handle):
                raise self._engine_error(err, f"writing {path!r}", handle) from err
            raise SandboxError(f"Cannot write {path!r}: its directory {parent!r} is missing.") from err
        except docker.errors.APIError as err:
            if (err.status_code or 0) < 500 and err.status_code != 409:
                raise SandboxError(f"Cannot write {path!r}: {err.explanation or err}") from err
            raise self._engine_error(err, f"writing {path!r}", handle) from err
        except Exception as err:
            raise self._engine_error(err, f"writing {path!r}", handle) from err
        finally:
            if spooled is not None:
                spooled.close()
        if sent[0] != size:
            raise SandboxError(f"The source for {path!r} ended after {sent[0]} of the {size} bytes it reported.")
        return size

    def _mkdir(self, handle: str, directory: str, path: str) -> None:
        quoted = "'" + directory.replace("'", "'\\''") + "'"
        result = self.run_command(handle, f"mkdir -p -- {quoted}", timeout=60, max_output_bytes=4096)
        if result.sandbox_terminated:
            raise SandboxTerminalError(f"The sandbox ended while writing {path!r}.")
        if not result.ok:
            detail = result.stderr.strip() or f"exit status {result.exit_code}"
            raise SandboxError(f"Cannot create the directory for {path!r}: {detail}")

    # -- stamps ----------------------------------------------------------------------------------------

    def _container_labels(self, handle: str) -> dict[str, str]:
        self.check_handle(handle)
        try:
            info = self._client().api.inspect_container(handle)
        except Exception as err:
            raise self._engine_error(err, f"reading sandbox {handle!r}", handle) from err
        labels = dict(info.get("Config", {}).get("Labels") or {})
        if labels.get(SANDBOX_LABEL) != handle:
            raise SandboxTerminalError(f"Container {handle!r} was not created by this provider; it cannot be attached.")
        state = info.get("State") or {}
        if not state.get("Running"):
            raise SandboxTerminalError(f"Sandbox {handle!r} has ended (status {state.get('Status')!r}).")
        return labels

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """
        Return the sandbox's stamps: owner, expiry, network and workdir from its labels, and the
        holder (with any other changeable stamp) from the stamp file inside it; see :meth:`write_tags`.

        :raises SandboxTerminalError: if the sandbox is missing or has ended.
        """
        labels = self._container_labels(handle)
        tags = {key: labels[key] for key in _LABEL_STAMPS if key in labels}
        self._known_expiry[handle] = _expiry_of(labels)
        for key, value in self._read_stamp_file(handle).items():
            if key not in _LABEL_STAMPS:  # the labels stay the authority for what they hold
                tags[key] = value
        return tags

    def _read_stamp_file(self, handle: str) -> dict[str, str]:
        """The changeable stamps from the file inside the sandbox; empty when there is none yet."""

        def tampered(what: str) -> SandboxTerminalError:
            return SandboxTerminalError(
                f"The holder stamp of Docker sandbox {handle!r} was tampered with from inside the sandbox: "
                f"{TAGS_FILE} {what}, but the provider keeps a regular JSON file of string pairs there. Code "
                "running in the sandbox changed it, so who holds the sandbox cannot be told. Destroy the "
                "sandbox and provision a new one."
            )

        try:
            info = self._stat(handle, TAGS_FILE)
        except SandboxTerminalError:
            raise
        except SandboxError:  # a part of the path is no longer a directory
            raise tampered("cannot be looked up") from None
        if info is None:
            return {}
        mode = int(info.get("mode", 0))
        if mode & _GO_MODE_TYPE:
            kind = "not a regular file"
            if mode & _GO_MODE_SYMLINK:
                kind = "a symbolic link"
            elif mode & _GO_MODE_DIR:
                kind = "a directory"
            raise tampered(f"is {kind}")
        if int(info.get("size", 0)) > TAGS_MAX_BYTES:
            raise tampered(f"holds {int(info.get('size', 0))} bytes, more than any stamp file")
        buffer = io.BytesIO()
        try:
            self._download(handle, TAGS_FILE, TAGS_FILE, buffer, TAGS_MAX_BYTES)
        except SandboxTerminalError:
            raise
        except SandboxError as err:  # replaced between the look-up and the read
            raise tampered(f"could not be read as a regular file ({err})") from None
        try:
            stored = json.loads(buffer.getvalue().decode("utf-8"))
        except ValueError:  # JSON and UTF-8 errors alike
            raise tampered("is not JSON") from None
        if not isinstance(stored, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in stored.items()
        ):
            raise tampered("is JSON but not an object of string pairs")
        return stored

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """
        Replace the sandbox's changeable stamps with ``tags``.

        Owner, expiry, network and workdir are container labels, set at create: the Engine has no
        call that changes a container's labels, and labels are out of reach of code inside the
        sandbox, which suits the stamps that attach checks. The holder must change after create,
        so it (with any other stamp not among those four) lives in a small JSON file at
        ``/.airflow-sandbox/tags.json`` inside the container, written and read over the archive
        API. Any process that reaches the Engine can read it, it goes away with the container, and
        it needs no store beside the Engine.

        Code running in the sandbox can rewrite or delete that file, so the holder stamp is
        attribution, not a lock: it catches one task attaching to a sandbox another still uses,
        not a sandbox that clears its own claim. The owner, which attach checks, stays in a label
        out of the sandbox's reach. A stamp file replaced by something other than the JSON written
        here makes :meth:`read_tags` fail with :class:`SandboxTerminalError`.

        :raises SandboxTerminalError: if the sandbox is missing or ended, or ``tags`` changes or
            drops a stamp fixed at create.
        """
        labels = self._container_labels(handle)
        for key in _LABEL_STAMPS:
            if labels.get(key) != tags.get(key):
                raise SandboxTerminalError(
                    f"Stamp {key!r} of Docker sandbox {handle!r} is fixed when the sandbox is provisioned "
                    f"({labels.get(key)!r}); only the holder and other stamps can change afterwards."
                )
        changeable = {k: v for k, v in tags.items() if k not in _LABEL_STAMPS}
        payload = json.dumps(changeable, sort_keys=True).encode()
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
            directory = tarfile.TarInfo(TAGS_DIR)
            directory.type, directory.mode, directory.mtime = tarfile.DIRTYPE, 0o700, int(time.time())
            tar.addfile(directory)
            member = tarfile.TarInfo(TAGS_FILE.lstrip("/"))
            member.size, member.mode, member.mtime = len(payload), 0o600, int(time.time())
            tar.addfile(member, io.BytesIO(payload))
        try:
            self._client().api.put_archive(handle, "/", archive.getvalue())
        except Exception as err:
            raise self._engine_error(err, f"writing the stamps of sandbox {handle!r}", handle) from err

    # -- finding what is left ---------------------------------------------------------------------------

    def list_sandboxes(self, *, owner: str | None = None, dag_id: str | None = None) -> list[DockerSandboxInfo]:
        """
        List this provider's sandbox containers on the Engine, running or not.

        :param owner: only those stamped with this owner, e.g. ``dag_run_owner(context)`` for one Dag run.
        :param dag_id: only those whose owner belongs to this Dag (``"<dag_id>/..."``).
        :raises SandboxTerminalError: if the Engine cannot be reached.
        """
        filters: dict[str, Any] = {"label": [SANDBOX_LABEL]}
        if owner is not None:
            filters["label"].append(f"{OWNER_TAG}={owner}")
        try:
            found = self._client().api.containers(all=True, filters=filters)
        except Exception as err:
            raise self._engine_error(err, "listing sandboxes") from err
        result = []
        for item in found:
            labels = item.get("Labels") or {}
            handle = labels.get(SANDBOX_LABEL) or (item.get("Names") or ["?"])[0].lstrip("/")
            found_owner = labels.get(OWNER_TAG)
            if dag_id is not None and not (found_owner or "").startswith(dag_id + "/"):
                continue
            try:
                expires: float | None = float(labels[EXPIRES_AT_TAG])
            except (KeyError, ValueError):
                expires = None
            result.append(DockerSandboxInfo(handle, found_owner, expires, str(item.get("State") or "")))
        return sorted(result, key=lambda info: info.handle)

    def remove_expired(
        self, *, owner: str | None = None, dag_id: str | None = None, now: float | None = None
    ) -> list[str]:
        """
        Remove this provider's containers that are past their lifetime, or stopped and not yet
        removed; return their handles. The Engine normally removes them itself; this catches
        what a restarted daemon or an interrupted removal left behind.

        :param now: the Unix time to judge expiry by; default the current time.
        """
        removed = []
        for info in self.list_sandboxes(owner=owner, dag_id=dag_id):
            if not is_named_sandbox(info.handle):
                log.warning("Skipping container %r: its %s label is not a usable handle", info.handle, SANDBOX_LABEL)
                continue
            if info.expired(now) or info.status in ("exited", "dead"):
                self.destroy(info.handle)
                removed.append(info.handle)
        if removed:
            log.info("Removed %d leftover Docker sandboxes: %s", len(removed), ", ".join(removed))
        return removed

    # -- connection test -------------------------------------------------------------------------------

    def _check_connection(self) -> str:
        """Ping the Engine; report its version and whether it has the default image (nothing is created)."""
        client = self._client()
        client.api.ping()
        version = client.api.version()
        image = self._resolved()["image"]
        try:
            client.api.inspect_image(image)
            image_note = f"image {image} is there"
        except Exception:
            if self.pull == "never":
                image_note = f"image {image} is not there, and pull='never' refuses to pull it"
            else:
                image_note = f"image {image} is not there yet: the first sandbox pulls it (pull={self.pull!r})"
        return (
            f"Docker Engine {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) answered at "
            f"{self._where}; {image_note}."
        )


def _flag(value: Any) -> bool | None:
    """A boolean extra as the connection form or a JSON string may give it."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _expiry_of(labels: Mapping[str, str]) -> float:
    """The Unix time a sandbox ends, from its expiry label; infinity when it carries no usable one."""
    try:
        expires = float(labels[EXPIRES_AT_TAG])
    except (KeyError, ValueError):
        return math.inf
    return math.inf if math.isnan(expires) else expires


def _deadline_arg(seconds: float) -> str:
    """The deadline as coreutils ``timeout`` reads it, rounded up to whole milliseconds and never 0."""
    # The small allowance keeps float noise (1.1 * 1000 = 1100.0000000000002) from adding a millisecond.
    millis = max(math.ceil(seconds * 1000 - 1e-6), round(MIN_COMMAND_SECONDS * 1000))
    return f"{millis // 1000}.{millis % 1000:03d}"


def _is_utf8(text: str) -> bool:
    """False for a string carrying undecodable bytes as surrogates (``os.fsdecode`` of non-UTF-8 names)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _remaining_size(source: IO[bytes]) -> int | None:
    """Bytes left in a seekable source, or None when it cannot tell."""
    try:
        if not source.seekable():
            return None
        here = source.tell()
        end = source.seek(0, io.SEEK_END)
        source.seek(here)
        return end - here
    except (AttributeError, OSError, ValueError):
        return None


#: The same class, under the name the public sandbox guide uses for backends.
DockerSandboxBackend = DockerSandboxHook
