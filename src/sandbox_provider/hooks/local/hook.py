"""
``LocalSandboxHook``: sandboxes on the worker itself, isolated by bubblewrap (``bwrap``).

The embedded default backend: no daemon, no account. A sandbox is a directory on the worker; every
command runs in a fresh ``bwrap`` with its own user, PID, IPC, UTS, cgroup and (unless the spec
opens it) network namespaces, no capabilities, the host's system directories (or ``image``)
read-only, its workspace at ``workdir`` and a ``/tmp`` of its own (both kept between commands), a
fresh ``/dev/shm``, and an environment of ``PATH``, ``HOME``, ``LANG``, ``TMPDIR`` and ``spec.env``.

Every command starts in a fresh session keyring of its own (``spawner.py``), under a system-call
filter of the shape of Docker's default profile (``seccomp.py`` lists it), with ``spec.env``
handed over through a descriptor, never a command line (``driver.py``). A root worker gives each
sandbox a host uid of its own from ``uid_range`` (``ids.py``), owning its files at mode 0700;
a worker that is not root runs sandboxes as itself in a user namespace. Where the worker can write
a cgroup hierarchy (v2 or v1), each sandbox gets a cgroup for ``max_processes``, ``memory_bytes``
(tmpfs and page cache included) and ``cpu_limit`` (``cgroups.py``); without one,
``max_processes`` becomes ``RLIMIT_NPROC`` of the sandbox's user and the other two are refused.
``disk_bytes`` is a tmpfs of that size on a root worker, refused elsewhere. Directories are made and
removed crash-safely (``state.py``). The README's local backend section gives the model per
kind of worker.

``block_network=False`` shares the worker's network namespace: the sandbox reaches whatever the
worker reaches, its loopback services and abstract Unix sockets included. ``allow_egress_to`` and
``allow_egress_to_cidrs`` keep the empty namespace and add a gateway outside the sandbox
(:mod:`sandbox_provider.hooks.egress`), its socket bound in and presented on ``127.0.0.1:3128``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from sandbox_provider.hooks import egress
from sandbox_provider.hooks.egress.mixin import GatewayEgress
from sandbox_provider.hooks.forms.local import FORM
from sandbox_provider.hooks.local import cgroups as cgroups_mod
from sandbox_provider.hooks.local import driver, removals, state
from sandbox_provider.hooks.local import plan as plans
from sandbox_provider.hooks.local.files import LocalFiles
from sandbox_provider.hooks.local.ids import IdLeases, parse_uid_range, shared_leases
from sandbox_provider.hooks.local.reads import HostReads
from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles
from sandbox_provider.sandbox.hook import (
    Capabilities,
    OutputSink,
    ProvisionRequest,
    RunOutcome,
    SandboxHook,
)
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
)

log = logging.getLogger(__name__)

__all__ = ["LocalSandboxBackend", "LocalSandboxHook", "SweepReport", "wait_for_removals"]

SweepReport = state.SweepReport
default_state_root = state.default_state_root
UID_TAG = state.UID_TAG
_EXPORT_MIN_RATE = 1024 * 1024  # bytes per second a local export is allowed to be slow to
_LEASE_SWEEP_EVERY = 60.0  # seconds between lease sweeps on the create path, per host
_OOM = "the sandbox reached its memory limit (memory_bytes=%s)."
#: State roots this worker process has shown a root worker's sandbox users can reach.
_REACHABLE: set[str] = set()


class LocalSandboxHook(GatewayEgress, HostReads, LocalFiles, ShellFiles, Attachable, SandboxHook):
    """
    Sandboxes on the worker, isolated with bubblewrap. Attachable by tasks on the same host.

    :param sandbox_conn_id: a ``sandbox_local`` connection whose extras give defaults for the
        settings below; arguments given here win. None (the default): the ``sandbox_local_default``
        connection when it exists, else none. A connection named here must exist.
    :param workdir: where the workspace is mounted inside; relative paths resolve there.
    :param bwrap_path: the bubblewrap program, by name or path.
    :raises ValueError: for a bad argument (a non-positive limit, a relative workdir, a bad range).
    """

    name = "local"
    detached_refusal = (
        "its sandboxes live on the worker that made them (bubblewrap processes and state in that worker's own "
        "directories), where a triggerer, on another machine or in another container, cannot reach them."
    )
    display_name = "local"
    capabilities = Capabilities(
        egress_hosts=True,
        egress_cidrs=True,
        # Each entry is three bubblewrap arguments (--setenv NAME VALUE, even through --args), and bwrap takes
        # at most 9000 in all.
        max_env_entries=2500,
        network=NetworkReach(
            blocked="has no network access at all, not even DNS: it has only a loopback interface of its own",
            open=(
                "shares the worker's network: it reaches whatever the worker reaches, on any port and DNS included, "
                "and localhost is the worker's, so services listening there answer too"
            ),
        ),
        advice=(
            "A sandbox here has no network, the worker's, or allowlisted hosts and ranges through the egress gateway. "
            "Stage what the job needs with inputs or files and keep block_network=True, list the hosts it needs in "
            "allow_egress_to, or pass SandboxSpec(block_network=False) to accept open egress."
        ),
    )
    form = FORM
    test_connection_note = (
        "A task's sandboxes run on the worker that runs the task, which needs bubblewrap as this host does."
    )

    def __init__(
        self,
        sandbox_conn_id: str | None = None,
        *,
        state_root: str | os.PathLike[str] | None = None,
        image: str | os.PathLike[str] | None = None,
        workdir: str = DEFAULT_WORKDIR,
        sandbox_timeout: float | None = None,
        cpu_seconds: int | None = None,
        cpu_limit: float | None = None,
        memory_bytes: int | None = None,
        max_processes: int | None = None,
        max_file_bytes: int | None = None,
        disk_bytes: int | None = None,
        shm_bytes: int | None = None,
        uid_range: str | None = None,
        uid_lease_dir: str | os.PathLike[str] | None = None,
        cgroup_parent: str | None = None,
        bwrap_path: str = "bwrap",
        egress_ports: Sequence[int] | None = None,
        egress_pins: Mapping[str, Any] | None = None,
        egress_max_connections: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sandbox_conn_id = sandbox_conn_id
        self._args = self.settings.arguments(locals())
        if uid_range is not None:
            parse_uid_range(uid_range)
        if cgroup_parent is not None:
            cgroups_mod.check_parent(cgroup_parent)
        self.workdir = driver.check_local_workdir(workdir)
        self.bwrap_path = bwrap_path
        self._settings: dict[str, Any] | None = None
        self._plans: dict[str, plans.Plan] = {}

    # -- settings --------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings is not None:
            return self._settings
        extras: Mapping[str, Any] = {}
        conn = self._connection()
        if conn is not None:
            if conn.conn_type not in (None, "", self.conn_type):
                raise SandboxTerminalError(
                    f"Connection {conn.conn_id!r} has type {conn.conn_type!r}; LocalSandboxHook needs "
                    f"a {self.conn_type!r} connection."
                )
            extras = conn.extra_dejson
        try:
            settings = self.settings.resolve(self._args, extras, conn_id=conn.conn_id if conn is not None else None)
        except ValueError as err:
            raise SandboxTerminalError(f"{err} Fix the connection's extra, or pass the setting to the hook.") from err
        tmp = tempfile.gettempdir()
        if settings["state_root"] is None:
            settings["state_root"] = state.default_state_root()
        if settings["uid_lease_dir"] is None:
            settings["uid_lease_dir"] = os.path.join(tmp, "airflow-sandbox-uids")
        for key in ("state_root", "uid_lease_dir", "image"):
            if settings[key] is not None and not os.path.isabs(settings[key]):
                raise SandboxTerminalError(
                    f"{key} must be an absolute path on the worker, got {settings[key]!r}: a relative one would "
                    "depend on the directory the task happens to start in."
                )
        if settings["image"] is not None and not os.path.isdir(settings["image"]):
            raise SandboxTerminalError(f"image {settings['image']!r} is not a directory on this worker.")
        self._settings = settings
        return settings

    def _connection(self) -> Any:
        """The connection named by ``sandbox_conn_id``, or ``sandbox_local_default`` if it exists, or None."""
        conn = self.connection_or_none()
        if conn is not None and not self.sandbox_conn_id:
            log.info("Using the %s connection for the local backend's settings", self.default_conn_name)
        return conn

    @property
    def state_root(self) -> str:
        """The directory that holds this hook's sandboxes."""
        return self._resolved()["state_root"]

    def _system_binds(self, network: bool) -> list[str]:
        """The read-only system mounts (or ``image``'s), looked up once per worker process."""
        return plans.system_binds(self._resolved()["image"], self.workdir, network)

    def _bwrap(self) -> str:
        found = plans.program(self.bwrap_path, os.environ.get("PATH"))  # found once per worker process
        if not found:
            raise SandboxTerminalError(
                f"bubblewrap ({self.bwrap_path!r}) is not installed on this worker. Install the 'bubblewrap' "
                "package (apt-get install bubblewrap, dnf install bubblewrap, apk add bubblewrap) or pass "
                "bwrap_path= to LocalSandboxHook."
            )
        return found

    @staticmethod
    def _tool(name: str) -> str:
        found = plans.which(name)
        if not found:
            raise SandboxTerminalError(f"The local backend needs {name!r} on the worker: install {driver.TOOLS[name]}.")
        return found

    @property
    def _drops_root(self) -> bool:
        return os.geteuid() == 0

    @property
    def _dir_mode(self) -> int:
        # The state root of a root worker: its sandboxes' users must pass through to their own directories.
        return 0o711 if self._drops_root else 0o700

    def _cgroups(self) -> cgroups_mod.Cgroups | None:
        return cgroups_mod.probe(plans.checked(self._resolved()["cgroup_parent"], cgroups_mod.check_parent))

    def _leases(self) -> IdLeases | None:
        if not self._drops_root:
            return None
        first, last = plans.checked(self._resolved()["uid_range"], parse_uid_range)
        return shared_leases(self._resolved()["uid_lease_dir"], first, last)

    def uid_of(self, handle: str) -> int:
        """The host user id the sandbox's commands run as (the worker's own when it is not root)."""
        return int(self.read_tags(handle).get(UID_TAG, os.getuid()))

    def _dir(self, handle: str) -> str:
        self.check_handle(handle)
        path = os.path.join(self._root(), handle)
        if not os.path.isfile(os.path.join(path, state.RECORD)):
            raise SandboxTerminalError(
                f"Sandbox {handle!r} does not exist on this worker (under {self.state_root}); it was destroyed, "
                "expired, or provisioned on another host."
            )
        return path

    # -- stamps ----------------------------------------------------------------------------------------

    def read_tags(self, handle: str) -> dict[str, str]:
        """Return the sandbox's stamps (owner, holder, expiry, network, workdir, user id, the task that made it)."""
        return {str(k): str(v) for k, v in state.read_record(self._dir(handle))["stamps"].items()}

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's stamps, atomically (a rename); its user id stays what it was."""
        path = self._dir(handle)
        record = state.read_record(path)
        new = dict(tags)
        if UID_TAG in record["stamps"]:
            new[UID_TAG] = record["stamps"][UID_TAG]
        state.write_record(path, {**record, "stamps": new})
        self._plans.pop(handle, None)

    @contextlib.contextmanager
    def _stamp_lock(self, handle: str):
        """Hold an exclusive lock on the sandbox's stamps, across processes of this host."""
        fd = os.open(os.path.join(self._dir(handle), "stamps.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def attach(self, handle: str, *, owner: str, holder: str):
        """
        Claim a sandbox another task on this host provisioned; see :meth:`Attachable.attach`.

        Here the claim is exclusive: it runs under a lock on the sandbox's stamps, so of two tasks
        attaching at once exactly one wins.
        """
        with self._stamp_lock(handle):
            return super().attach(handle, owner=owner, holder=holder)

    def release(self, handle: str, *, holder: str) -> None:
        """Clear the holder stamp if it is ``holder``'s, under the same lock as :meth:`attach`."""
        with self._stamp_lock(handle):
            super().release(handle, holder=holder)

    def _remaining_lifetime(self, handle: str) -> float | None:
        expires = self._plan(handle).expires_at
        return None if expires is None else expires - time.time()

    # -- egress gateway (hooks/egress) ---------------------------------------------------------------

    def _start_gateway(self, handle: str, request: ProvisionRequest) -> None:
        """Start the gateway of a new sandbox whose spec has allowlists; destroy the sandbox if it fails."""
        try:
            egress.start_local_gateway(
                os.path.join(self._root(), handle),
                request.spec,
                image=self._resolved()["image"],
                expires_at=request.expires_at,
                ports=self.egress_ports,
                pins=self.egress_pins,
                socket_owner=self.uid_of(handle) if self._drops_root else None,
                max_connections=self.egress_max_connections,
            )
        except BaseException:
            self._destroy(handle)
            raise

    # -- lifecycle -------------------------------------------------------------------------------------

    def _root(self, *, create: bool = False) -> str:
        return state.checked_root(self.state_root, self._dir_mode, create=create)

    def _new_limits(self) -> dict[str, Any]:
        """The limits a new sandbox gets; :raises SandboxTerminalError: for one this worker cannot enforce."""
        return cgroups_mod.plan(self._resolved(), self._cgroups(), root_worker=self._drops_root)

    def _provision(self, request: ProvisionRequest) -> str:
        self._bwrap()
        for tool in driver.TOOLS:
            self._tool(tool)
        limits = self._new_limits()
        self._leases()  # a bad uid_range is refused before anything is made
        root = self._root(create=True)
        if self._drops_root and root not in _REACHABLE:
            state.check_reachable(root)
            _REACHABLE.add(root)
        report = self._sweep(full=False)
        if report.failed:
            log.warning("Could not remove %d sandbox(es) under %s: %s", len(report.failed), root, report.failed)
        handle = request.name
        try:
            with state.building(root, handle, 0o700) as staging:
                record = self._fill(staging, handle, request, limits)
        except OSError as err:
            raise SandboxTerminalError(f"Could not provision a sandbox under {root}: {err}") from err
        self._plans[handle] = self._new_plan(os.path.join(root, handle), record)  # not read back from disk
        if request.spec.has_allowlist:
            self._start_gateway(handle, request)
        return handle

    def location(self, handle: str) -> str:
        """``in <state root>/<handle> on this worker``: the sandbox's directory, for the provisioning log line."""
        return f"in {os.path.join(self.state_root, handle)} on this worker"

    def _fill(self, staging: str, handle: str, request: ProvisionRequest, limits: Mapping[str, Any]) -> dict[str, Any]:
        """Make the sandbox's user, box, cgroup and state in its ``.creating-`` directory; return its record."""
        owner = os.path.join(os.path.dirname(staging), handle)
        leases = self._leases()
        uid = leases.lease(owner) if leases is not None else os.getuid()
        cgroups = self._cgroups() if limits["cgroup"] else None
        try:
            os.chown(staging, uid, uid)  # the sandbox's own, 0700: no other user but root gets in
            box = state.box_path(staging, limits)
            if box != staging:
                os.mkdir(box, 0o700)
                state.mount_box(box, size_bytes=limits["disk_bytes"], uid=uid, gid=uid)
            for directory in (os.path.join(box, "workspace"), os.path.join(box, "tmp")):
                os.mkdir(directory, 0o700)
                os.chown(directory, uid, uid)
            if cgroups is not None:
                cgroups.create(handle, cgroups_mod.SandboxLimits.of(limits))
            stamps = {**request.stamps, UID_TAG: str(uid)}
            # created_at: the worker's clock, in the worker's record beside the box, which nothing
            # inside the sandbox can write; a sweep by age (airflow sandboxes --older-than) reads it.
            record = {
                "stamps": stamps,
                "env": dict(request.spec.env or {}),
                "limits": dict(limits),
                "created_at": time.time(),
            }
            state.write_record(staging, record, fresh=True)
            return record
        except BaseException:
            if cgroups is not None:
                cgroups.remove(handle)
            if leases is not None:
                state.remove_sandbox_dir(staging)  # nothing of its user outlives the lease
                leases.release(uid, owner)
            raise

    def _destroy(self, handle: str) -> None:
        plan = self._plans.pop(handle, None)
        root = self._root()
        trash = state.mark_destroyed(root, handle)
        if trash is not None:
            known = plan.uid if plan is not None and plan.path == os.path.join(root, handle) else None
            self._teardown(handle, trash, wait=True, uid=known)

    def _end(self, handle: str) -> None:
        """
        ``destroy(wait=False)``: the sandbox is renamed away (gone for every caller) and everything of
        it that runs is killed (its cgroup emptied, its gateway stopped) before this returns; its
        files, its emptied cgroup and its user id go in this worker's removal thread
        (``removals.py``, which the worker process waits for as it exits). A worker killed before
        that leaves its ``.destroyed-`` directory, unlocked, to the next sweep (any create on the
        host's state root, or ``gc_expired``).
        """
        plan = self._plans.pop(handle, None)
        root = self._root()
        trash = state.mark_destroyed(root, handle)
        if trash is None:
            return
        known = plan.uid if plan is not None and plan.path == os.path.join(root, handle) else None
        # The lock stays held until the removal thread is done, so that no sweep (a create here or
        # in another worker) takes the removal on meanwhile; a worker that dies lets it go.
        held = state.lock(trash, wait=True)
        if held is None:
            return
        try:
            self._stop(handle, trash, remove_cgroup=False)
        except BaseException:
            os.close(held)
            raise
        removals.submit(functools.partial(self._reap, handle, trash, known, held))

    def _reap(self, handle: str, trash: str, uid: int | None, held: int) -> None:
        try:
            self._remove(handle, trash, uid)
        except Exception:  # the next sweep removes what is left
            log.warning("Could not remove the files of sandbox %s; the next sweep will", handle, exc_info=True)
        finally:
            os.close(held)

    def _stop(self, handle: str, path: str, *, remove_cgroup: bool = True) -> None:
        """
        Kill everything of the sandbox under ``path`` that runs: its cgroup (then removed, unless
        ``remove_cgroup`` is False: emptied only), its gateway, its marked commands.
        """
        root = os.path.dirname(path)
        cgroups = self._cgroups()
        if cgroups is not None:
            if remove_cgroup:
                cgroups.remove(handle)
            else:
                cgroups.kill(handle)
        egress.stop_gateway(egress.local_gateway_dir(path), match=os.path.join(root, handle) + "/")
        driver.kill_marked(path, match=os.path.join(root, handle) + "/")

    def _teardown(self, handle: str, path: str, *, wait: bool, uid: int | None = None) -> bool:
        """
        Finish off a sandbox under its ``.destroyed-`` or ``.creating-`` name: kill what runs, remove
        its cgroup, its files (the workspace last) and release its user id (``uid``, when this hook
        has it from the record already). False if another live worker holds it (``wait=False``), or it is gone.
        """
        with state.claim(path, wait=wait) as got:
            if got:
                self._remove(handle, path, uid)
        return got

    def _remove(self, handle: str, path: str, uid: int | None) -> None:
        """:meth:`_teardown`'s work, under the directory's lock."""
        uid = uid if uid is not None else state.recorded_uid(path)
        self._stop(handle, path)
        state.remove_sandbox_dir(path)
        leases = self._leases()
        if leases is not None and uid is not None:
            leases.release(uid, os.path.join(os.path.dirname(path), handle))

    def gc_expired(self) -> SweepReport:
        """
        Remove every sandbox under the state root whose lifetime has run out, and what workers
        killed during a create or destroy left behind; free user ids no sandbox holds any more.

        Keeps going past a sandbox it cannot remove (and logs it).

        :returns: a :class:`SweepReport`: ``removed`` handles, ``failed`` handle -> reason.
        """
        return self._sweep(full=True)

    def _sweep(self, *, full: bool) -> SweepReport:
        root = self._root()
        report = SweepReport()
        now = time.time()
        for kind, handle, path in state.classify(root):
            try:
                if kind == "sandbox":
                    if not state.expired(path, now):
                        continue
                    self.destroy(handle)
                elif kind == "creating" and not state.settled(path, now):
                    continue
                elif not self._teardown(handle, path, wait=False):
                    continue
                report.removed.append(handle)
                log.info("Removed %s sandbox %s", "expired" if kind == "sandbox" else f"{kind}-interrupted", handle)
            except Exception as err:  # keep sweeping: one sandbox must not shelter the others
                report.failed[handle] = f"{type(err).__name__}: {err}"
                log.warning("Could not remove sandbox %s under %s", handle, root, exc_info=True)
        cgroups = self._cgroups() if full else None
        if cgroups is not None:
            cgroups.remove_parents()
        leases = self._leases()
        if leases is not None:
            leases.sweep(state.abandoned, every=None if full else _LEASE_SWEEP_EVERY)
        return report

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """The sandboxes under the state root whose stamps hold every item of ``stamps``: ``{handle: stamps}``."""
        return {
            handle: tags
            for handle, tags, _ in self._records()
            if all(tags.get(key) == value for key, value in stamps.items())
        }

    def sandbox_records(self) -> list[SandboxRecord]:
        """Every sandbox under the state root, with when the worker made it (None for one made before it was recorded)."""
        return [SandboxRecord(handle, tags, None, created) for handle, tags, created in sorted(self._records())]

    def _records(self) -> list[tuple[str, dict[str, str], float | None]]:
        """``(handle, stamps, created_at)`` of each sandbox under the state root whose record can be read."""
        found = []
        for kind, handle, path in state.classify(self._root()):
            if kind != "sandbox":
                continue
            try:
                record = state.read_record(path)
            except SandboxTerminalError:
                continue  # being made or removed right now
            stamps = {str(k): str(v) for k, v in record["stamps"].items()}
            found.append((handle, stamps, record.get("created_at")))
        return found

    # -- running ---------------------------------------------------------------------------------------

    def _confinement(self, handle: str, limits: Mapping[str, Any], max_file_bytes: int | None):
        """The cgroup (or None) and the rlimits one command of the sandbox runs under."""
        return cgroups_mod.confinement(handle, limits, self._cgroups(), max_file_bytes)

    def _plan(self, handle: str) -> plans.Plan:
        """What every launch of the sandbox needs, worked out once per sandbox (and hook)."""
        path = self._dir(handle)
        plan = self._plans.get(handle)
        if plan is None or plan.path != path:
            plan = self._plans[handle] = self._new_plan(path, state.read_record(path))
        return plan

    def _new_plan(self, path: str, record: Mapping[str, Any]) -> plans.Plan:
        return plans.build(
            path,
            record,
            bwrap=self._bwrap(),
            image=self._resolved()["image"],
            workdir=self.workdir,
            shm_default=self.settings["shm_bytes"].default,
            tools={name: self._tool(name) for name in driver.TOOLS},
        )

    def _exec(
        self,
        handle: str,
        argv: list[str],
        *,
        timeout: float,
        output: OutputSink,
        stdin: IO[bytes] | None = None,
        stdin_fd: int | None = None,
        stdout_fd: int | None = None,
        max_file_bytes: int | None = None,
        binds: Sequence[tuple[int, str]] = (),
        base_env_only: bool = False,
    ) -> RunOutcome:
        """
        Run ``argv`` in the sandbox for at most ``timeout`` seconds; stdin from ``stdin`` or the
        descriptor ``stdin_fd`` (closed here), stdout into ``output`` or the descriptor ``stdout_fd``.
        ``binds``: ``(descriptor of a worker directory, path inside)`` mounted writable for this launch
        only, by the descriptor (the caller's to close): a link put at the directory's name is not followed.
        ``base_env_only``: no ``spec.env`` (whose PATH or LD_PRELOAD could name the sandbox's own
        programs), for the worker's programs when they hold a worker descriptor or directory.
        """
        try:
            plan = self._plan(handle)
        except BaseException:
            if stdin_fd is not None:
                os.close(stdin_fd)
            raise
        limits = plan.limits
        cgroups, rlimits = self._confinement(handle, limits, max_file_bytes)
        ooms = cgroups.oom_kills(handle) if cgroups is not None and limits.get("memory_bytes") else None
        stdin_kind = stdin_fd if stdin_fd is not None else subprocess.PIPE if stdin is not None else subprocess.DEVNULL
        popen_kwargs = {
            "stdin": stdin_kind,
            "stdout": subprocess.PIPE if stdout_fd is None else stdout_fd,
            "env": driver.BWRAP_ENV,
        }
        try:
            env = driver.base_env(self.workdir) if base_env_only else plan.env
            started = plans.start(
                handle,
                plan,
                argv,
                binds=binds,
                env=env,
                cgroups=cgroups,
                rlimits=rlimits,
                drops_root=self._drops_root,
                popen_kwargs=popen_kwargs,
            )
        finally:
            if stdin_fd is not None:
                os.close(stdin_fd)  # the launch holds it now: a feeder sees EPIPE when the sandbox stops
        try:
            outcome = self._follow(handle, plan.path, started, output, stdin, timeout, has_cgroup=cgroups is not None)
        finally:
            if plan.prefix:  # the gateway's account of this launch's connections, into the task log
                egress.relay_log(egress.local_gateway_dir(plan.path), log)
        if ooms is not None and not outcome.timed_out and cgroups.oom_kills(handle) > ooms:
            output.stderr(f"\n[sandbox] the kernel killed a process: {_OOM % limits['memory_bytes']}\n")
        return outcome

    def _follow(self, handle, path, started: driver.Started, output: OutputSink, stdin, timeout, *, has_cgroup: bool):
        """Stream a started command's output until it ends or ``timeout`` passes; how did it end?"""
        timed_out, status = driver.follow(
            started, output.stdout, output.stderr, stdin, timeout, marker_dir=None if has_cgroup else path
        )
        if not os.path.isdir(path):  # destroyed while the command ran, however far bwrap had got
            return RunOutcome(exit_code=-1, timed_out=timed_out, sandbox_terminated=True)
        if not timed_out and "child-pid" not in status:
            message = output.err.text().strip() or f"bwrap exited with status {started.proc.returncode}"
            raise SandboxTerminalError(f"bubblewrap could not set up the sandbox on this worker: {message}")
        exit_code = status.get("exit-code", started.proc.returncode)
        return RunOutcome(exit_code=int(exit_code) if isinstance(exit_code, int) else -1, timed_out=timed_out)

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        # On timeout the whole process tree dies with its PID namespace (children ignoring SIGTERM
        # too); the sandbox and its files stay.
        return self._exec(handle, ["/bin/sh", "-c", command], timeout=timeout, output=output)


def wait_for_removals(timeout: float = 60.0) -> bool:
    """
    Wait (up to ``timeout`` seconds in all) for the removals of local sandboxes that
    ``destroy(wait=False)`` left running in this worker process; return whether none is left.
    For a caller that counts what is left on the host (a test, a benchmark).
    """
    return removals.wait(timeout)


#: The guide's name for this backend.
LocalSandboxBackend = LocalSandboxHook
