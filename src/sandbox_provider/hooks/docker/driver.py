"""
Plain functions under the Docker backend: the container a sandbox is, the sweep of its processes,
the leftovers on the Engine, and exec streams. They take a ``docker`` API client and plain values;
the hook holds the state.
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox_provider.hooks.docker import guest as docker_guest
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.deployment import DEPLOYMENT_TAG
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    EXPIRES_AT_TAG,
    MAP_INDEX_TAG,
    OWNER_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
)

#: The label every sandbox container of this provider carries; its value is the handle.
SANDBOX_LABEL = "airflow_sandbox"
#: The label naming the user commands run as, ``uid:gid``; a container without it is not one of ours.
USER_LABEL = "airflow_sandbox_user"
#: The provider's directory inside a sandbox: the keeper's, root's only.
STATE_DIR = "/.airflow-sandbox"
#: The keeper appends a byte here after each sweep; see ``docker_keeper.sh``.
WITNESS_FILE = STATE_DIR + "/swept"
#: The keeper's copy of sh that the command user can run but not read (so not trace): the runner's.
RUNNER_SHELL = STATE_DIR + "/sh"
#: The default user commands run as: an id no account of a common image has (Debian reserves
#: 65000-65533 and uses none of them; distroless's nonroot is 65532, nobody 65534).
DEFAULT_SANDBOX_UID = 65432
#: What the keeper needs, as root: handing the workdir over, and killing the command user's processes.
#: Commands as another user get no capability at all (``no-new-privileges`` keeps it so).
KEEPER_CAPABILITIES = ("CHOWN", "KILL")
#: With ``run_as_root``: what a root shell needs to manage its own files and processes.
ROOT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")
#: Seconds for one API call to the Engine; exec streams have no such limit.
API_TIMEOUT = 60
#: Seconds a sweep may take before the sandbox is given up as unsweepable.
SWEEP_TIMEOUT = 10.0
#: Seconds between two signals to the keeper while a sweep waits.
SWEEP_RESIGNAL = 1.0
#: Seconds a new container's keeper may take to start.
KEEPER_START_TIMEOUT = 30.0
#: What ``docker_wait.sh`` writes on standard output when the keeper is ready, before the program starts.
STARTED_MARK = b"sandbox-started\n"
#: The status and stderr mark of ``docker_wait.sh`` when the keeper of a new sandbox never got ready.
KEEPER_MISSING_STATUS, KEEPER_MISSING_MARK = 125, b"sandbox-keeper-missing"
#: Seconds a container may stay created and never started before a sweep removes it.
CREATED_GRACE = 300.0
#: Shortest deadline sent: coreutils ``timeout`` reads a deadline of 0 as none at all.
MIN_DEADLINE_SECONDS = 0.001
#: Storage drivers whose ``size`` storage option limits a container's writable layer.
QUOTA_DRIVERS = "overlay2 on xfs mounted with pquota, btrfs, zfs, devicemapper, windowsfilter"


# One command or file operation at a time per sandbox, across every hook of this process, and the
# sandboxes known to hold no process of a command (swept after the last one, or new).
_GUARD = threading.Lock()
_LOCKS: dict[str, threading.Lock] = {}
_SWEPT: set[str] = set()


_FRESH: set[str] = set()


def mark_fresh(handle: str, fresh: bool) -> None:
    """Record whether sandbox ``handle`` was just started here, its keeper maybe not ready yet."""
    with _GUARD:
        (_FRESH.add if fresh else _FRESH.discard)(handle)


def is_fresh(handle: str) -> bool:
    """True while no program has run in sandbox ``handle`` since this process started it."""
    with _GUARD:
        return handle in _FRESH


def sandbox_lock(handle: str) -> threading.Lock:
    """The lock that one command or file operation at a time holds on sandbox ``handle``."""
    with _GUARD:
        return _LOCKS.setdefault(handle, threading.Lock())


def mark_swept(handle: str, swept: bool) -> None:
    """Record whether sandbox ``handle`` is known to hold no process of a command."""
    with _GUARD:
        (_SWEPT.add if swept else _SWEPT.discard)(handle)


def known_swept(handle: str) -> bool:
    """True when this process swept sandbox ``handle`` after its last command, or made it."""
    with _GUARD:
        return handle in _SWEPT


def command_user(sandbox_uid: int, run_as_root: bool) -> str:
    """The ``uid:gid`` commands run as."""
    return "0:0" if run_as_root else f"{int(sandbox_uid)}:{int(sandbox_uid)}"


def keeper_entrypoint(lifetime: float, user: str) -> list[str]:
    """The container's command: the keeper, handing the workdir to ``user`` unless that is root."""
    owner = "" if user == "0:0" else user
    return ["sh", "-c", _code("docker_keeper.sh"), "sandbox-keeper", owner, str(math.ceil(lifetime))]


#: Largest file the runner reads back with its command (``read_back``); a bigger one is read on its own.
READ_BACK_MAX_BYTES = 64 * 1024


def runner_argv(command: str, seconds: float, *, staged: bool = False, read_back: str | None = None) -> list[str]:
    """
    The exec's argv for one command with a deadline of ``seconds``, under the keeper's copy of sh;
    ``staged``: the archive on its standard input is extracted first (``stage.sh``); ``read_back``:
    once the command succeeded, the runner sends that file (at most ``READ_BACK_MAX_BYTES``) on its
    status trailer.
    """
    stage = _code("stage.sh") if staged else ""
    back = [_code("file.sh"), read_back, str(READ_BACK_MAX_BYTES)] if read_back is not None else ["", "", ""]
    return [RUNNER_SHELL, "-c", _code("docker_run.sh"), "sandbox-run", deadline_arg(seconds), command, stage, *back]


def op_argv(program: str, name: str, *args: str) -> list[str]:
    """The exec's argv for a file operation: the guest program ``program`` (named ``name``) under ``docker_op.sh``."""
    return ["sh", "-c", _code("docker_op.sh"), "sandbox-op", program, name, *args]


def wait_argv(argv: list[str]) -> list[str]:
    """
    ``argv`` started once the keeper of a new sandbox is ready (its witness file is there), after
    :data:`STARTED_MARK` on standard output.
    """
    ticks = str(int(KEEPER_START_TIMEOUT * 100))
    return ["sh", "-c", _code("docker_wait.sh"), "sandbox-wait", ticks, WITNESS_FILE, *argv]


def _code(name: str) -> str:
    """
    A guest program (Docker's own, ``docker_*.sh``, or a shared one) without its comment lines, so
    that ``ps`` in the sandbox shows a short command line.
    """
    text = docker_guest.program(name) if name.startswith("docker_") else guest.program(name)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def deadline_arg(seconds: float) -> str:
    """The deadline as coreutils ``timeout`` reads it, rounded up to whole milliseconds and never 0."""
    # The small allowance keeps float noise (1.1 * 1000 = 1100.0000000000002) from adding a millisecond.
    millis = max(math.ceil(seconds * 1000 - 1e-6), round(MIN_DEADLINE_SECONDS * 1000))
    return f"{millis // 1000}.{millis % 1000:03d}"


def container_config(api: Any, settings: Mapping[str, Any], request: Any, deployment: str = "") -> dict[str, Any]:
    """
    The ``create_container`` arguments for a sandbox (``request``, a ``ProvisionRequest``): the keeper
    as root, the command user, the creation stamps and the deployment (``[sandbox] deployment``, no
    label when empty) as labels, ``HOME`` the workdir unless the spec sets one.
    """
    user = command_user(settings["sandbox_uid"], settings["run_as_root"])
    return {
        "image": settings["image"],
        "name": request.name,
        "entrypoint": keeper_entrypoint(request.lifetime, user),
        "command": [],
        "user": "0:0",
        "environment": {"HOME": request.workdir, **dict(request.spec.env or {})},
        "working_dir": request.workdir,
        "labels": {**request.stamps, **deployment_labels(deployment), SANDBOX_LABEL: request.name, USER_LABEL: user},
        "host_config": host_config(
            api, settings, block_network=request.spec.block_network, run_as_root=settings["run_as_root"]
        ),
        "hostname": "sandbox",
    }


def host_config(api: Any, settings: Mapping[str, Any], *, block_network: bool, run_as_root: bool) -> dict:
    """The host config of a sandbox container: no init (the keeper is PID 1), auto-remove, limits."""
    memory, network = int(settings["memory_bytes"]), settings["network"]  # network: with block_network=False
    extra: dict[str, Any] = {}
    if settings.get("disk_bytes"):
        extra["storage_opt"] = {"size": str(int(settings["disk_bytes"]))}
    return api.create_host_config(
        init=False,
        auto_remove=True,
        network_mode="none" if block_network else network,
        cap_drop=["ALL"],
        cap_add=list(ROOT_CAPABILITIES if run_as_root else KEEPER_CAPABILITIES),
        security_opt=["no-new-privileges"],
        privileged=False,
        nano_cpus=int(float(settings["cpus"]) * 1e9),
        mem_limit=memory,
        memswap_limit=memory,
        pids_limit=int(settings["pids_limit"]),
        **extra,
    )


def disk_refusal(api: Any, err: Exception, disk_bytes: int | None) -> str | None:
    """
    The message for a create the Engine refused because its storage driver cannot limit a
    container's disk, or None when ``err`` is something else.
    """
    text = str(getattr(err, "explanation", None) or err)
    if not disk_bytes:
        return None
    if "quota exceeded" in text.lower():  # btrfs counts the image's files in the limit too
        return (
            f"disk_bytes={disk_bytes} is too small for this Docker Engine to create the sandbox ({text}): its "
            "storage driver counts the image's own files in the limit. Raise disk_bytes above the image's size "
            "plus what the job writes."
        )
    if "storage-opt" not in text and "storage opt" not in text.lower():
        return None
    try:
        info = api.info()
        status = dict(info.get("DriverStatus") or [])
        driver = f"{info.get('Driver', '?')} on {status.get('Backing Filesystem', 'an unknown filesystem')}"
    except Exception:  # the refusal itself is what matters
        driver = "its storage driver"
    return (
        f"disk_bytes={disk_bytes} cannot be enforced: this Docker Engine stores containers with {driver}, which "
        f"cannot limit a container's disk ({text}). Drivers that can: {QUOTA_DRIVERS}. Unset disk_bytes, or run "
        "sandboxes on an Engine with one of those drivers."
    )


def path_stat(api: Any, container: str, path: str) -> tuple[int, dict[str, Any] | None]:
    """
    The Engine's stat of ``path`` in ``container`` (not following a final symlink), as
    ``(HTTP status, stat or None)``; 404 without a stat is a missing path or container.
    """
    from docker.utils import decode_json_header

    # The SDK has no call for the archive API's HEAD (the stat ``docker cp`` makes first), so it
    # goes through the SDK's own session and URL builder.
    res = api.head(api._url("/containers/{0}/archive", container), params={"path": path}, timeout=API_TIMEOUT)
    header = res.headers.get("x-docker-container-path-stat")
    if res.status_code not in (200, 404):
        api._raise_for_status(res)
    return res.status_code, (decode_json_header(header) if header else None)


def witness(api: Any, container: str) -> int | None:
    """How many sweeps the keeper has done, or None when it has not started (or its file is gone)."""
    import docker.errors

    try:
        status, info = path_stat(api, container, WITNESS_FILE)
    except docker.errors.APIError as err:
        if (err.status_code or 0) >= 500:  # the Engine fails so on a path through a file: it was replaced
            return None
        raise
    if status != 200 or info is None:
        return None
    return int(info.get("size", 0))


def wait_for_keeper(api: Any, container: str, timeout: float = KEEPER_START_TIMEOUT) -> bool:
    """True once the keeper of a started container is ready (its witness file exists)."""
    end = time.monotonic() + timeout
    pause = 0.002
    while True:
        if witness(api, container) is not None:
            return True
        if time.monotonic() >= end or not is_running(api, container):
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def sweep(api: Any, container: str, timeout: float = SWEEP_TIMEOUT) -> bool:
    """
    Have the keeper kill every process in the container but itself; return True once its witness
    shows that it did, False if it did not within ``timeout`` seconds.

    :raises docker.errors.APIError: when the container is gone or not running (409, 404).
    """
    before = witness(api, container)
    if before is None:  # a keeper still starting, or one whose witness is gone
        if not wait_for_keeper(api, container, timeout):
            return False
        before = witness(api, container) or 0
    end = time.monotonic() + timeout
    next_signal = 0.0
    pause = 0.001
    while time.monotonic() < end:
        if time.monotonic() >= next_signal:
            api.kill(container, "SIGUSR1")
            next_signal = time.monotonic() + SWEEP_RESIGNAL
        after = witness(api, container)
        if after is not None and after > before:
            return True
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return False


def is_running(api: Any, container: str) -> bool:
    """True while ``container`` exists and runs (not paused)."""
    import docker.errors

    try:
        state = api.inspect_container(container)["State"]
    except docker.errors.NotFound:
        return False
    return bool(state.get("Running")) and not state.get("Paused")


@dataclass(frozen=True)
class DockerSandboxInfo:
    """
    One sandbox container of this provider, as ``DockerSandboxHook.list_sandboxes`` finds it.

    :param handle: the container name, which is the sandbox handle.
    :param owner: the owner stamp, or None.
    :param expires_at: Unix time (seconds) when its lifetime ends, or None if unknown.
    :param status: the Engine's container status (``created``, ``running``, ``exited``, ...).
    :param created_at: Unix time (seconds) the Engine created it.
    :param stamps: its creation stamps (its ``airflow_*`` labels): expiry, network, workdir, owner,
        the command user, and the Dag, run, task, map index and try that made it.
    """

    handle: str
    owner: str | None
    expires_at: float | None
    status: str
    created_at: float = 0.0
    stamps: Mapping[str, str] = field(default_factory=dict)

    def expired(self, now: float | None = None) -> bool:
        """True when the lifetime has run out at ``now`` (default: the current time)."""
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)

    def made_in(self, dag_id: str) -> bool:
        """True when a task of Dag ``dag_id`` made it, or its owner belongs to that Dag."""
        return self.stamps.get(DAG_ID_TAG) == dag_id or (self.owner or "").startswith(dag_id + "/")


def label_filters(deployment: str, **stamps: Any) -> dict[str, list[str]]:
    """
    The Engine's label filter for the provider's containers of ``deployment`` with these stamps (None:
    any). The Engine cannot filter on a missing label: for ``deployment=""``, :func:`in_deployment`
    leaves out the containers of named deployments.
    """
    keys = {"owner": OWNER_TAG, "run_id": RUN_ID_TAG, "task_id": TASK_ID_TAG, "map_index": MAP_INDEX_TAG}
    wanted = [f"{keys[name]}={value}" for name, value in stamps.items() if value is not None]
    return {"label": [SANDBOX_LABEL, *wanted, *(f"{k}={v}" for k, v in deployment_labels(deployment).items())]}


def deployment_labels(deployment: str) -> dict[str, str]:
    """The label a sandbox of ``deployment`` carries: none for the unnamed deployment (``""``)."""
    return {DEPLOYMENT_TAG: deployment} if deployment else {}


def in_deployment(labels: Mapping[str, str], deployment: str) -> bool:
    """True when a container with ``labels`` belongs to ``deployment`` (``""``: it carries no deployment label)."""
    return labels.get(DEPLOYMENT_TAG, "") == deployment


def info_of(item: Mapping[str, Any]) -> DockerSandboxInfo:
    """A container as the Engine lists it, as a :class:`DockerSandboxInfo`."""
    labels = item.get("Labels") or {}
    expires = expiry_of(labels)
    return DockerSandboxInfo(
        handle=labels.get(SANDBOX_LABEL) or (item.get("Names") or ["?"])[0].lstrip("/"),
        owner=labels.get(OWNER_TAG),
        expires_at=None if math.isinf(expires) else expires,
        status=str(item.get("State") or ""),
        created_at=float(item.get("Created") or 0),
        stamps={k: v for k, v in labels.items() if k.startswith("airflow_") and k != SANDBOX_LABEL},
    )


@dataclass(frozen=True)
class Leftover:
    """A container a sweep of the Engine removes, and why."""

    handle: str
    reason: str


def leftovers(found: Iterable[DockerSandboxInfo], *, now: float, created_grace: float) -> list[Leftover]:
    """
    Of the provider's containers, those a sweep removes: past their expiry label in any state,
    created and never started for longer than ``created_grace`` seconds, or stopped and not removed.
    """
    result = []
    for info in found:
        if info.expired(now):
            result.append(Leftover(info.handle, f"past its lifetime ({info.status})"))
        elif info.status == "created" and now - info.created_at >= created_grace:
            result.append(Leftover(info.handle, f"created {int(now - info.created_at)}s ago and never started"))
        elif info.status in ("exited", "dead"):
            result.append(Leftover(info.handle, f"{info.status} and not removed"))
    return result


# -- the client --------------------------------------------------------------------------------------


def daemon_url(host: str | None) -> str | None:
    """The connection's host as the SDK takes it: a bare path is a unix socket, a bare name TCP."""
    if host and "://" not in host:
        return ("unix://" + host) if host.startswith("/") else ("tcp://" + host)
    return host or None


def environment_daemon() -> str:
    """The Engine a client made with no host talks to, as words for a log line: ``DOCKER_HOST``, else the local socket."""
    if os.environ.get("DOCKER_HOST"):
        return f"{os.environ['DOCKER_HOST']} (DOCKER_HOST)"
    return "unix:///var/run/docker.sock (the local socket)"


def make_client(host: str | None, settings: Mapping[str, Any], *, conn_id: str) -> Any:
    """
    A ``docker`` client for ``host`` (None: the environment's, ``DOCKER_HOST`` or the local socket).

    :raises SandboxTerminalError: for TLS extras that cannot work together.
    """
    import docker

    tls: Any = False
    cert, key_file, ca = settings["tls_client_cert"], settings["tls_client_key"], settings["tls_ca_cert"]
    if cert or key_file or ca or settings["tls_verify"]:
        if bool(cert) != bool(key_file):
            raise SandboxTerminalError(
                f"Connection {conn_id!r} names only one of tls_client_cert and tls_client_key; a client "
                "certificate needs both."
            )
        verify = settings["tls_verify"]
        tls = docker.tls.TLSConfig(
            client_cert=(cert, key_file) if cert else None,
            ca_cert=ca,
            verify=bool(ca) if verify is None else (ca if (verify and ca) else bool(verify)),
        )
    # The API version is negotiated once per Engine and process (one request), not once per hook.
    key = (host or os.environ.get("DOCKER_HOST"), repr((cert, key_file, ca, settings["tls_verify"])))
    version = _API_VERSIONS.get(key, "auto")
    if host:
        client = docker.DockerClient(base_url=host, version=version, tls=tls, timeout=API_TIMEOUT)
    else:
        client = docker.DockerClient.from_env(version=version, timeout=API_TIMEOUT)
    _API_VERSIONS[key] = client.api.api_version
    return client


#: The API version each Engine (by URL and TLS settings) negotiated, for the next client of this process.
_API_VERSIONS: dict[tuple[str | None, str], str] = {}


# -- the stamp file, in the keeper's directory --------------------------------------------------------


class StampFileDamaged(Exception):
    """The stamp file is not what the provider wrote; the message says how."""


def read_stamp_file(api: Any, container: str, path: str, max_bytes: int) -> dict[str, str]:
    """
    The string pairs in the JSON file at ``path`` (over the archive API); empty when it does not exist.

    :raises StampFileDamaged: when it is not a regular file of at most ``max_bytes`` holding them.
    :raises docker.errors.NotFound: when the container is gone.
    """
    import docker.errors

    try:
        status, info = path_stat(api, container, path)
    except docker.errors.APIError as err:
        # The Engine fails so on a path it cannot look up (through a file, a symlink loop).
        if (err.status_code or 0) >= 500 and is_running(api, container):
            raise StampFileDamaged("cannot be looked up") from None
        raise
    if status == 404 and info is None:
        if not is_running(api, container):
            raise docker.errors.NotFound(f"No such container: {container}")
        return {}
    if info is None:
        raise StampFileDamaged("cannot be looked up")
    if int(info.get("mode", 0)) & _GO_MODE_TYPE:
        raise StampFileDamaged("is not a regular file")
    if int(info.get("size", 0)) > max_bytes:
        raise StampFileDamaged(f"holds {int(info.get('size', 0))} bytes, more than any stamp file")
    chunks, _ = api.get_archive(container, path)
    archive = io.BytesIO()
    for chunk in chunks:
        archive.write(chunk)
        if archive.tell() > max_bytes + 64 * 1024:
            raise StampFileDamaged("grew while it was read")
    archive.seek(0)
    try:
        with tarfile.open(fileobj=archive, mode="r:") as tar:
            member = tar.next()
            source = tar.extractfile(member) if member is not None and member.isreg() else None
            if source is None:
                raise StampFileDamaged("is not a regular file")
            stored = json.loads(source.read().decode("utf-8"))
    except (tarfile.TarError, ValueError):  # JSON and UTF-8 errors alike
        raise StampFileDamaged("is not JSON") from None
    if not isinstance(stored, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in stored.items()):
        raise StampFileDamaged("is JSON but not an object of string pairs")
    return stored


def write_stamp_file(api: Any, container: str, path: str, stamps: Mapping[str, str]) -> None:
    """Replace the JSON file at ``path`` with ``stamps``, root's and private, over the archive API."""
    payload = json.dumps(dict(stamps), sort_keys=True).encode()
    directory, name = path.rsplit("/", 1)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo(name)
        member.size, member.mode, member.mtime = len(payload), 0o600, int(time.time())
        tar.addfile(member, io.BytesIO(payload))
    api.put_archive(container, directory, archive.getvalue())


# Go's os.FileMode bits for anything but a regular file, as the Engine reports them in a path stat.
_GO_MODE_TYPE = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)


# -- small conversions ---------------------------------------------------------------------------------


def expiry_of(labels: Mapping[str, str]) -> float:
    """The Unix time a sandbox ends, from its expiry label; infinity when it carries no usable one."""
    try:
        expires = float(labels[EXPIRES_AT_TAG])
    except (KeyError, ValueError):
        return math.inf
    return math.inf if math.isnan(expires) else expires
