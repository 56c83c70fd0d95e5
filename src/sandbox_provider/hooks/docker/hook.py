"""
Sandboxes as containers on a Docker Engine, driven through the ``docker`` SDK.

- **A sandbox** is a container named ``airflow-sandbox-<hex>`` (the handle), labelled
  ``airflow_sandbox``, with its creation stamps (owner, expiry, network, workdir, and the Dag, run,
  task, map index and try that made it) and its command user (``airflow_sandbox_user``) as labels.
- **The keeper** (``guest/docker_keeper.sh``) is PID 1, as root: it ends at the lifetime, which ends
  the container, and the Engine removes it. A killed worker leaves nothing running past the lifetime.
- **Commands** run through exec as ``sandbox_uid`` (default 65432, an id no account of a common
  image has), without capabilities, under ``no-new-privileges``: they cannot signal, stop or trace
  the keeper. With ``run_as_root`` they run as root with a few capabilities and can stop it, so the
  lifetime is also enforced from outside: every create, and ``remove_expired()``, remove the
  provider's containers past their expiry label, and those created but never started.
- **Deployments**: the ``[sandbox] deployment`` option's name is a label (``airflow_deployment``) of
  every sandbox; the sweeps and listings consider only the containers with this deployment's name
  (none when the option is empty), so deployments that share an Engine never remove each other's.
- **Nothing outlives its command**, by construction: the runner (``guest/docker_run.sh``, under
  the keeper's copy of sh that the command user can run but not read, so not trace) ends with one
  ``kill(-1)`` as the command user. A command can only kill or stop it; then the keeper (root,
  CAP_KILL) kills everything but itself, and the hook waits for its witness. A sandbox whose keeper
  does not answer is destroyed. Commands and file operations run one at a time per sandbox.
- **Files** go through exec as the command user with the shared guest programs: permissions and
  symbolic links apply as a command meets them, and a read takes its bytes from one open file. A
  batch (a whole mapping, a directory) is one tar through one exec per direction, and files staged
  with the first command travel in that command's own exec (see ``commands.py`` and
  ``batch.py``, which says why the Engine's archive API, run as root, is not used for them).
  Only the provider's stamp file goes over the archive API, into the keeper's private directory.
- **Requests**: a create is the sweep, create and start (the first program waits inside for the
  keeper); an exec is two (its status comes in the stream's last bytes, see ``exec.py``),
  and a file read right after a staged command can ride on that command's status
  (``run_command(read_back=...)``).
- **Limits**: CPU, memory (no swap beyond it), processes, disk (``disk_bytes``) where the storage
  driver supports it; network mode ``none`` unless the spec opens it; only ``spec.env`` is passed.
- **Egress allowlists** (``allow_egress_to``, ``allow_egress_to_cidrs``): network mode ``none``
  still, plus a gateway on the worker (:mod:`sandbox_provider.hooks.egress`) whose forwarder
  listens on ``127.0.0.1:3128`` in the container's network namespace, started from outside the
  container, so nothing in it can stop or replace it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sandbox_provider.hooks import egress
from sandbox_provider.hooks.docker import driver
from sandbox_provider.hooks.docker.commands import DockerExec
from sandbox_provider.hooks.egress.mixin import GatewayEgress
from sandbox_provider.hooks.forms.docker import FORM
from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.batch import ImportEntry
from sandbox_provider.sandbox.deployment import deployment
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles, StreamFiles
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    TRACE_TAGS,
    WORKDIR_TAG,
    is_named_sandbox,
)

if TYPE_CHECKING:
    import docker

log = logging.getLogger(__name__)

__all__ = ["DockerSandboxBackend", "DockerSandboxHook", "DockerSandboxInfo"]

SANDBOX_LABEL = driver.SANDBOX_LABEL
#: Longest deadline for a command when the sandbox's own end is unknown (30 days).
MAX_COMMAND_SECONDS = 30 * 24 * 3600.0
#: Largest holder stamp file read back; the provider writes a few hundred bytes.
TAGS_MAX_BYTES = 64 * 1024
#: Where the changeable stamps (the holder) live inside the container; see ``write_tags``.
TAGS_FILE = driver.STATE_DIR + "/tags.json"
#: Stamps fixed as labels when the container is created.
_LABEL_STAMPS = (OWNER_TAG, EXPIRES_AT_TAG, NETWORK_TAG, WORKDIR_TAG, *TRACE_TAGS)
#: How messages name the Engine of a connection without a host.
_DEFAULT_ENGINE = "the Docker Engine that DOCKER_HOST or the local socket names"

DockerSandboxInfo = driver.DockerSandboxInfo


class DockerSandboxHook(GatewayEgress, DockerExec, StreamFiles, ShellFiles, Attachable, SandboxHook):
    """
    Provision sandboxes as containers on a Docker Engine.

    Connection (type ``sandbox_docker``, default id ``sandbox_docker_default``; when that default
    connection is not defined, the worker's own Engine is used as ``DOCKER_HOST`` or the local
    socket names it): ``host`` (``unix:///var/run/docker.sock``, ``tcp://host:2376``), ``login`` and
    ``password`` (registry credentials, only to pull a missing image), and the extras of the
    settings below, which the hook arguments override.

    :param sandbox_conn_id: the Airflow connection to read.
    :raises ValueError: for a setting out of bounds or an unknown pull policy.
    """

    name: ClassVar[str] = "docker"
    display_name: ClassVar[str] = "Docker"
    capabilities = Capabilities(
        egress_hosts=True,
        egress_cidrs=True,
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
            "Keep the network blocked, list the hosts the job needs in allow_egress_to (enforced by the egress "
            "gateway on a root worker beside the Engine), or set block_network=False to give the sandbox the open "
            "network of the connection's Docker network."
        ),
    )
    form = FORM
    egress_from_outside = True
    detached_commands = True
    #: Seconds a container may stay created but never started before a sweep removes it.
    created_grace: float = driver.CREATED_GRACE

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
        sandbox_uid: int | None = None,
        run_as_root: bool | None = None,
        disk_bytes: int | None = None,
        pull: str | None = None,
        egress_ports: Sequence[int] | None = None,
        egress_pins: Mapping[str, Any] | None = None,
        egress_max_connections: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(sandbox_conn_id, str) or not sandbox_conn_id.strip():
            raise ValueError(f"sandbox_conn_id must be a connection id, got {sandbox_conn_id!r}.")
        self.sandbox_conn_id = sandbox_conn_id
        self._args = self.settings.arguments(locals())
        self._lock = threading.Lock()
        self._client_obj: docker.DockerClient | None = None
        self._settings_obj: dict[str, Any] | None = None
        self._where = _DEFAULT_ENGINE
        #: Labels of the sandboxes this hook used, by handle; they never change.
        self._labels_seen: dict[str, dict[str, str]] = {}
        #: The file the next command's runner reads back, and what the last one read back, by handle.
        self._read_back_paths: dict[str, str] = {}
        self._read_backs: dict[str, tuple[str, bytes]] = {}

    # -- connection ------------------------------------------------------------------------------------

    @property
    def pull(self) -> str:
        """When a missing image is pulled: ``missing``, ``never`` or ``always`` (the ``pull`` setting)."""
        return str(self._resolved()["pull"])

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is not None:
            return self._settings_obj
        host = login = password = None
        extra: dict[str, Any] = {}
        conn = self.connection_or_none(otherwise="the worker's own Docker Engine")
        if conn is None:
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
            if self._client_obj is None:
                settings = self._resolved()
                host = driver.daemon_url(settings["host"])
                self._where = f"the Docker Engine at {host or driver.environment_daemon()}"
                try:
                    self._client_obj = driver.make_client(host, settings, conn_id=self.sandbox_conn_id)
                except SandboxError:
                    raise
                except Exception as err:  # the SDK raises DockerException, requests or OS errors alike
                    raise self._unreachable(err) from err
            return self._client_obj

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
            self._forget(handle)
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

    def _forget(self, handle: str) -> None:
        self._known_expiry.pop(handle, None)
        self._labels_seen.pop(handle, None)
        self._read_back_paths.pop(handle, None)
        self._read_backs.pop(handle, None)
        driver.mark_swept(handle, False)
        driver.mark_fresh(handle, False)

    # -- egress gateway (hooks/egress) ---------------------------------------------------------------

    def _start_gateway(self, handle: str, container_id: str, request: ProvisionRequest) -> None:
        """Start the gateway of a new sandbox whose spec has allowlists, its forwarder in the container's network."""
        pid = int((self._client().api.inspect_container(container_id).get("State") or {}).get("Pid") or 0)
        directory = egress.docker_gateway_dir(handle)
        forward, watch = egress.docker_forward(directory, pid, self.egress_max_connections)
        egress.start_gateway(
            directory,
            egress.policy_for(handle, request.spec, ports=self.egress_ports, pins=self.egress_pins),
            expires_at=request.expires_at,
            watch=watch,
            forward=[forward],
            max_connections=self.egress_max_connections,
        )

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        try:
            return super()._run(handle, command, timeout=timeout, output=output)
        finally:
            egress.relay_log(egress.docker_gateway_dir(handle), log)

    def _run_staged(
        self, handle: str, command: str, stage: Sequence[ImportEntry], *, timeout: float, output: OutputSink
    ) -> RunOutcome:
        try:
            return super()._run_staged(handle, command, stage, timeout=timeout, output=output)
        finally:
            egress.relay_log(egress.docker_gateway_dir(handle), log)

    # -- lifecycle -------------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        scope = deployment()  # a bad [sandbox] deployment fails here, before the Engine is asked anything
        settings = self._resolved()
        api = self._client().api
        self._sweep_engine(request.stamps)
        handle = request.name
        kwargs = driver.container_config(api, settings, request, scope)
        if request.spec.has_allowlist:
            kwargs["environment"] = {**egress.proxy_env(), **kwargs["environment"]}
        if self.pull == "always":
            self._pull(settings["image"])
        container_id = self._create_container(kwargs, settings.get("disk_bytes"))
        # Created and started as one step: whatever stops it in between (an error, the task being
        # killed) removes the container, and a worker killed outright leaves it to the next sweep.
        # The keeper gets ready while the first program starts, which waits for it (see wait_argv).
        try:
            api.start(container_id)
            if request.spec.has_allowlist:
                self._start_gateway(handle, container_id, request)
        except BaseException as err:
            egress.stop_gateway(egress.docker_gateway_dir(handle), remove=True)
            self._remove_quietly(container_id)
            if not isinstance(err, Exception):
                raise
            raise SandboxTerminalError(
                f"Sandbox container {handle} did not start on {self._where} (connection "
                f"{self.sandbox_conn_id!r}): {getattr(err, 'explanation', None) or err}"
            ) from err
        driver.mark_fresh(handle, True)
        driver.mark_swept(handle, True)
        self._labels_seen[handle] = dict(kwargs["labels"])  # what the Engine would answer: no inspect needed
        user = kwargs["labels"][driver.USER_LABEL]
        log.info(
            "Started Docker sandbox %s from %s on %s, lifetime %ss, commands as %s",
            handle,
            settings["image"],
            self._where,
            request.lifetime,
            "root" if user == "0:0" else f"uid {user.split(':')[0]}",
        )
        return handle

    def _keeper_log(self, container: str) -> str:
        try:
            text = self._client().api.logs(container, tail=5).decode(errors="replace").strip()
        except Exception:  # the container may already be gone
            return ""
        return f" ({text})" if text else ""

    def _create_container(self, kwargs: dict[str, Any], disk_bytes: int | None) -> str:
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
                refusal = driver.disk_refusal(api, err, disk_bytes)
                if refusal:
                    raise SandboxTerminalError(refusal) from err
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

        self._forget(handle)
        egress.stop_gateway(egress.docker_gateway_dir(handle), remove=True)
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

    def _end(self, handle: str) -> None:
        """
        ``destroy(wait=False)``: kill the container (the Engine answers once it has stopped) and leave
        its removal to the Engine, which removes it as it stops (auto-remove); one the Engine does
        not remove that way (never started) is removed here. The lifetime and the sweep of every
        create still guarantee it goes.
        """
        import docker.errors

        self._forget(handle)
        egress.stop_gateway(egress.docker_gateway_dir(handle), remove=True)
        try:
            self._client().api.kill(handle)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as err:
            if err.status_code != 409:  # 409: not running (stopped, being removed, never started)
                raise self._engine_error(err, f"ending sandbox {handle!r}") from err
            self._destroy(handle)
        except Exception as err:
            raise self._engine_error(err, f"ending sandbox {handle!r}") from err

    # -- exec: commands and file operations --------------------------------------------------------------

    def _labels(self, handle: str) -> dict[str, str]:
        """The labels of a running sandbox of this provider, read once per handle."""
        labels = self._labels_seen.get(handle)
        if labels is not None:
            return labels
        try:
            info = self._client().api.inspect_container(handle)
        except Exception as err:
            raise self._engine_error(err, f"reading sandbox {handle!r}", handle) from err
        labels = dict(info.get("Config", {}).get("Labels") or {})
        if labels.get(SANDBOX_LABEL) != handle:
            raise SandboxTerminalError(f"Container {handle!r} was not created by this provider; it cannot be used.")
        if not (info.get("State") or {}).get("Running"):
            raise SandboxTerminalError(f"Sandbox {handle!r} has ended (status {info['State'].get('Status')!r}).")
        if driver.USER_LABEL not in labels:
            raise SandboxTerminalError(
                f"Sandbox {handle!r} was provisioned by an older version of this provider, whose commands run as root "
                "and whose keeper cannot sweep; destroy it and provision a new one."
            )
        self._labels_seen[handle] = labels
        return labels

    def _remaining_lifetime(self, handle: str) -> float | None:
        # The expiry label, read once per handle; a sandbox without one has no known end.
        expires = self._known_expiry.get(handle)
        if expires is None:
            expires = self._known_expiry[handle] = driver.expiry_of(self._labels(handle))
        return expires - time.time()

    # -- stamps ----------------------------------------------------------------------------------------

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """
        Return the sandbox's stamps: the creation stamps from its labels, and the holder (with any
        other changeable stamp) from the stamp file in the keeper's directory; see :meth:`write_tags`.

        :raises SandboxTerminalError: if the sandbox is missing or has ended.
        """
        handle = self.check_handle(handle)
        labels = self._labels(handle)
        tags = {key: labels[key] for key in _LABEL_STAMPS if key in labels}
        self._known_expiry[handle] = driver.expiry_of(labels)
        for key, value in self._read_stamp_file(handle).items():
            if key not in _LABEL_STAMPS:  # the labels stay the authority for what they hold
                tags[key] = value
        return tags

    def _await_keeper(self, handle: str) -> None:
        """Before the archive API touches the keeper's directory of a new sandbox: wait until the keeper made it."""
        if driver.is_fresh(handle):
            if not driver.wait_for_keeper(self._client().api, handle):
                driver.mark_fresh(handle, False)
                self._keeper_failed(handle)
            driver.mark_fresh(handle, False)

    def _read_stamp_file(self, handle: str) -> dict[str, str]:
        """The changeable stamps from the file inside the sandbox; empty when there is none yet."""
        self._await_keeper(handle)
        try:
            return driver.read_stamp_file(self._client().api, handle, TAGS_FILE, TAGS_MAX_BYTES)
        except driver.StampFileDamaged as err:
            raise SandboxTerminalError(
                f"The holder stamp of Docker sandbox {handle!r} was tampered with from inside the sandbox: "
                f"{TAGS_FILE} {err}, but the provider keeps a regular JSON file of string pairs there. Code "
                "running in the sandbox as root changed it, so who holds the sandbox cannot be told. Destroy the "
                "sandbox and provision a new one."
            ) from None
        except Exception as err:
            raise self._engine_error(err, f"reading the stamps of sandbox {handle!r}", handle) from err

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """
        Replace the sandbox's changeable stamps (the holder) with ``tags``.

        The creation stamps are labels, fixed at create and out of reach of the sandbox. The holder
        lives in ``/.airflow-sandbox/tags.json``, the keeper's private directory, over the archive
        API: the command user cannot touch it; root commands (``run_as_root``) can, and a file they
        spoiled makes :meth:`read_tags` raise :class:`SandboxTerminalError`.

        :raises SandboxTerminalError: if the sandbox is missing or ended, or ``tags`` changes or
            drops a stamp fixed at create.
        """
        handle = self.check_handle(handle)
        labels = self._labels(handle)
        for key in _LABEL_STAMPS:
            if labels.get(key) != tags.get(key):
                raise SandboxTerminalError(
                    f"Stamp {key!r} of Docker sandbox {handle!r} is fixed when the sandbox is provisioned "
                    f"({labels.get(key)!r}); only the holder and other stamps can change afterwards."
                )
        changeable = {k: v for k, v in tags.items() if k not in _LABEL_STAMPS}
        self._await_keeper(handle)
        try:
            driver.write_stamp_file(self._client().api, handle, TAGS_FILE, changeable)
        except Exception as err:
            raise self._engine_error(err, f"writing the stamps of sandbox {handle!r}", handle) from err

    # -- finding what is left ---------------------------------------------------------------------------

    def list_sandboxes(
        self,
        *,
        owner: str | None = None,
        dag_id: str | None = None,
        run_id: str | None = None,
        task_id: str | None = None,
        map_index: int | None = None,
    ) -> list[DockerSandboxInfo]:
        """
        List this provider's sandbox containers on the Engine of this deployment (those labelled with
        the ``[sandbox] deployment`` option's name; with the option empty, those with no such label),
        in any state, with their stamps.

        :param owner: only those stamped with this owner, e.g. ``dag_run_owner(context)``.
        :param dag_id: only those a task of this Dag made, or whose owner belongs to it (``"<dag_id>/..."``).
        :param run_id: only those a task of this Dag run made.
        :param task_id: only those this task made.
        :param map_index: only those this map index made (-1 for an unmapped task).
        :raises SandboxTerminalError: if the Engine cannot be reached, or ``[sandbox] deployment`` is no
            valid name.
        """
        scope = deployment()
        filters = driver.label_filters(scope, owner=owner, run_id=run_id, task_id=task_id, map_index=map_index)
        try:
            found = self._client().api.containers(all=True, filters=filters)
        except Exception as err:
            raise self._engine_error(err, "listing sandboxes") from err
        infos = [driver.info_of(item) for item in found if driver.in_deployment(item.get("Labels") or {}, scope)]
        return sorted((i for i in infos if dag_id is None or i.made_in(dag_id)), key=lambda i: i.handle)

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """
        This deployment's containers (see :meth:`list_sandboxes`) whose labels hold every item of
        ``stamps``: ``{handle: labels}``.
        """
        scope = deployment()
        filters = driver.label_filters(scope)
        filters["label"] += [f"{key}={value}" for key, value in stamps.items()]
        try:
            found = self._client().api.containers(all=True, filters=filters)
        except Exception as err:
            raise self._engine_error(err, "listing sandboxes") from err
        result = {}
        for item in found:
            tags = {str(k): str(v) for k, v in (item.get("Labels") or {}).items()}
            if is_named_sandbox(tags.get(SANDBOX_LABEL, "")) and driver.in_deployment(tags, scope):
                result[tags[SANDBOX_LABEL]] = tags
        return result

    def sandbox_records(self) -> list[SandboxRecord]:
        """This provider's containers on the Engine, in any state, with their Engine status and creation time."""
        return [
            SandboxRecord(info.handle, dict(info.stamps), info.status, info.created_at or None)
            for info in self.list_sandboxes()
            if is_named_sandbox(info.handle)
        ]

    def remove_expired(
        self, *, owner: str | None = None, dag_id: str | None = None, now: float | None = None
    ) -> list[str]:
        """
        Remove this provider's containers that are past their expiry label (in any state, so also
        one whose keeper a root command stopped), created and never started for longer than
        ``created_grace`` seconds, or stopped and not removed; return their handles. Only this
        deployment's containers are considered (see :meth:`list_sandboxes`): another Airflow deployment
        on the same Engine, with another ``[sandbox] deployment``, sweeps its own. Every ``create`` runs
        the same sweep over the Engine first.

        :param now: the Unix time to judge by; default the current time.
        """
        judged = time.time() if now is None else now
        found = self.list_sandboxes(owner=owner, dag_id=dag_id)
        return self._remove(driver.leftovers(found, now=judged, created_grace=self.created_grace))

    def _remove(self, leftovers: list[driver.Leftover]) -> list[str]:
        removed = []
        for leftover in leftovers:
            if not is_named_sandbox(leftover.handle):
                log.warning("Skipping container %r: its %s label is no usable handle", leftover.handle, SANDBOX_LABEL)
                continue
            self._destroy(leftover.handle)
            log.info("Removed Docker sandbox %s: %s", leftover.handle, leftover.reason)
            removed.append(leftover.handle)
        return removed

    def _sweep_engine(self, stamps: Mapping[str, str]) -> None:
        """
        What every create does first: remove this deployment's leftovers on the Engine (the session ends
        what earlier tries of the task left, by their stamps). A failure to sweep never stops the create.
        """
        try:
            self.remove_expired()
        except (SandboxError, ValueError):
            log.warning("Could not sweep leftover Docker sandboxes on %s", self._where, exc_info=True)
        egress.sweep_gateways(egress.docker_gateway_root())

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


#: The same class, under the name the public sandbox guide uses for backends.
DockerSandboxBackend = DockerSandboxHook
