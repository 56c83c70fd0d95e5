"""
Kernel control groups for the local backend: one cgroup per sandbox, holding every process of every
command it runs, with a process count (``pids.max``), a memory limit that covers what the sandbox's
processes, its tmpfs files and its page cache hold (``memory.max``; ``memory.limit_in_bytes`` and
``memory.memsw.limit_in_bytes`` on v1) and a CPU share (``cpu.max``; ``cpu.cfs_quota_us`` on v1).

Where the cgroups go: ``<parent>/<handle>``. ``parent`` is ``cgroup_parent``: a relative path lies
under the worker's own cgroup (default ``airflow-sandbox``), an absolute one is a path from the
hierarchy's root. On cgroup v2 the
controllers must be available to that parent: a worker at the root of its cgroup namespace (as in
a container) enables them itself; elsewhere, delegate a cgroup the worker does not sit in (systemd:
a slice with ``Delegate=yes``) and name it in ``cgroup_parent``. On cgroup v1 each controller's
hierarchy gets the same path. A worker that cannot write there (not root, no delegation) has no
cgroups: :func:`probe` says so once per process in the log and the caller falls back to rlimits.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["CONTROLLERS", "CPU_PERIOD_US", "Cgroups", "SandboxLimits", "probe"]

#: The controllers the backend uses: pids (processes), memory, cpu (a share of the CPUs).
CONTROLLERS = ("pids", "memory", "cpu")
#: The scheduling period cpu.max / cpu.cfs_period_us is expressed in, in microseconds.
CPU_PERIOD_US = 100_000
DEFAULT_PARENT_NAME = "airflow-sandbox"
_KILL_WAIT = 10.0  # seconds to wait for a killed sandbox's processes to leave its cgroup
_warned: set[str] = set()


@dataclass(frozen=True)
class SandboxLimits:
    """
    What a sandbox's cgroup enforces; None leaves that resource unlimited.

    :param max_processes: processes and threads at once (``pids.max``).
    :param memory_bytes: memory in bytes, tmpfs and page cache included (``memory.max``).
    :param cpu_cores: CPU time per wall-clock time, in CPUs (1.5 = one and a half cores; ``cpu.max``).
    """

    max_processes: int | None = None
    memory_bytes: int | None = None
    cpu_cores: float | None = None

    def needs(self) -> tuple[str, ...]:
        """The controllers these limits need."""
        wanted = {"pids": self.max_processes, "memory": self.memory_bytes, "cpu": self.cpu_cores}
        return tuple(c for c in CONTROLLERS if wanted[c] is not None)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(path: str) -> list[int]:
    try:
        with open(path, encoding="ascii") as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


class Cgroups:
    """
    Sandbox cgroups under one parent: ``version`` 2 (one directory) or 1 (one per controller).

    :param version: 1 or 2.
    :param parents: controller -> the parent directory (on v2 every controller maps to the same one).
    """

    def __init__(self, version: int, parents: Mapping[str, str]) -> None:
        self.version = version
        self.parents = dict(parents)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(self.parents)

    def _dirs(self, handle: str) -> list[str]:
        return sorted({os.path.join(parent, handle) for parent in self.parents.values()})

    def _dir(self, handle: str, controller: str) -> str:
        return os.path.join(self.parents[controller], handle)

    def create(self, handle: str, limits: SandboxLimits) -> None:
        """Make the sandbox's cgroup and set its limits. Idempotent (limits are written again)."""
        for path in self._dirs(handle):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
        if limits.max_processes is not None:
            _write(os.path.join(self._dir(handle, "pids"), "pids.max"), str(limits.max_processes))
        if limits.memory_bytes is not None:
            self._limit_memory(self._dir(handle, "memory"), limits.memory_bytes)
        if limits.cpu_cores is not None:
            quota = max(1000, int(limits.cpu_cores * CPU_PERIOD_US))
            here = self._dir(handle, "cpu")
            if self.version == 2:
                _write(os.path.join(here, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
            else:
                _write(os.path.join(here, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(here, "cpu.cfs_quota_us"), str(quota))

    def _limit_memory(self, here: str, limit: int) -> None:
        if self.version == 2:
            _write(os.path.join(here, "memory.max"), str(limit))
            swap = os.path.join(here, "memory.swap.max")
            if os.path.exists(swap):  # swapping out would let tmpfs files grow past the limit
                _write(swap, "0")
            return
        _write(os.path.join(here, "memory.limit_in_bytes"), str(limit))
        memsw = os.path.join(here, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # memory plus swap: no more than the memory limit itself
            _write(memsw, str(limit))

    def join(self, handle: str, pid: int) -> None:
        """Move process ``pid`` (one that has not forked yet) into the sandbox's cgroup."""
        for path in self._dirs(handle):
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def members(self, handle: str) -> list[int]:
        """The processes in the sandbox's cgroup (every controller's, merged)."""
        found: set[int] = set()
        for path in self._dirs(handle):
            found.update(_read_pids(os.path.join(path, "cgroup.procs")))
        return sorted(found)

    def oom_kills(self, handle: str) -> int:
        """How many processes the kernel killed for reaching the memory limit (0 if unknown)."""
        if "memory" not in self.parents:
            return 0
        here = self._dir(handle, "memory")
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(here, name), encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def kill(self, handle: str) -> None:
        """SIGKILL every process of the sandbox and wait (up to 10 s) until its cgroup is empty."""
        kill_file = os.path.join(self._dirs(handle)[0], "cgroup.kill")
        if self.version == 2 and os.path.exists(kill_file):
            with contextlib.suppress(FileNotFoundError):
                _write(kill_file, "1")
        deadline = time.monotonic() + _KILL_WAIT
        while True:
            pids = self.members(handle)
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self, handle: str) -> None:
        """Kill what runs in the sandbox's cgroup and remove it. Idempotent: a missing cgroup is fine."""
        self.kill(handle)
        deadline = time.monotonic() + _KILL_WAIT
        for path in self._dirs(handle):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    # EBUSY: a killed process is still leaving (the kernel tears the pid namespace down).
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    self.kill(handle)
                    time.sleep(0.005)


# -- finding a writable hierarchy -------------------------------------------------------------------


def _mounts(mountinfo: str) -> list[tuple[str, str, set[str]]]:
    """(mount point, ``cgroup`` or ``cgroup2``, super options) of every cgroup mount."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """The worker's cgroup per v1 controller, and under the key ``""`` its v2 cgroup."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _parent_path(own: str, cgroup_parent: str | None) -> str:
    """An absolute ``cgroup_parent`` is a path from the hierarchy's root; a relative one lies under ``own``."""
    name = cgroup_parent or DEFAULT_PARENT_NAME
    if name.startswith("/"):
        return "/" + name.strip("/")
    return os.path.join(own, name.strip("/"))


def _v2_parent(mount: str, own: str, cgroup_parent: str | None) -> dict[str, str] | None:
    parent = os.path.join(mount, _parent_path(own, cgroup_parent).lstrip("/"))
    base = os.path.dirname(parent)
    try:
        if not set(_words(os.path.join(base, "cgroup.controllers"))) & set(CONTROLLERS):
            return None  # a hybrid host's unified hierarchy without these controllers
        # Every cgroup from the mount down to the parent hands the controllers on to its children
        # (the worker's own cgroup can do so only if it is a root: no process may sit in an inner one).
        here = mount
        for part in [p for p in os.path.relpath(base, mount).split("/") if p not in ("", ".")]:
            _enable(here)
            here = os.path.join(here, part)
        _enable(base)
        os.makedirs(parent, exist_ok=True)
        _enable(parent)
        enabled = set(_words(os.path.join(parent, "cgroup.subtree_control")))
    except OSError:
        return None
    return {c: parent for c in CONTROLLERS if c in enabled} or None


def _words(path: str) -> list[str]:
    with open(path, encoding="ascii") as f:
        return f.read().split()


def _enable(path: str) -> None:
    enabled = set(_words(os.path.join(path, "cgroup.subtree_control")))
    available = set(_words(os.path.join(path, "cgroup.controllers")))
    missing = [c for c in CONTROLLERS if c in available and c not in enabled]
    if missing:
        _write(os.path.join(path, "cgroup.subtree_control"), " ".join("+" + c for c in missing))


def _v1_parents(mounts, own: Mapping[str, str], cgroup_parent: str | None) -> dict[str, str]:
    parents = {}
    for point, kind, options in mounts:
        for controller in CONTROLLERS:
            if kind == "cgroup" and controller in options and controller not in parents:
                parent = os.path.join(point, _parent_path(own.get(controller, "/"), cgroup_parent).lstrip("/"))
                try:
                    os.makedirs(parent, exist_ok=True)
                except OSError:
                    continue
                parents[controller] = parent
    return parents


def find(mountinfo: str, proc_cgroup: str, cgroup_parent: str | None = None) -> Cgroups | None:
    """
    The writable sandbox cgroups of this worker: cgroup v2 when its unified hierarchy offers the
    controllers, else cgroup v1's hierarchies, else None. Creates the parent directories.

    :param mountinfo: the text of ``/proc/self/mountinfo``.
    :param proc_cgroup: the text of ``/proc/self/cgroup``.
    """
    mounts = _mounts(mountinfo)
    own = _own_paths(proc_cgroup)
    for point, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            parents = _v2_parent(point, own[""], cgroup_parent)
            if parents:
                return Cgroups(2, parents)
    parents = _v1_parents(mounts, own, cgroup_parent)
    return Cgroups(1, parents) if parents else None


@functools.lru_cache(maxsize=8)
def probe(cgroup_parent: str | None = None) -> Cgroups | None:
    """
    :func:`find` for this worker process, once per ``cgroup_parent``; logs once when there is none.
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mountinfo = f.read()
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            proc_cgroup = f.read()
    except OSError:
        mountinfo = proc_cgroup = ""
    found = find(mountinfo, proc_cgroup, cgroup_parent)
    key = cgroup_parent or ""
    if found is None and key not in _warned:
        _warned.add(key)
        log.warning(
            "No writable cgroup hierarchy on this worker%s: local sandboxes get rlimits instead (processes per "
            "sandbox user, no memory or CPU-share limit); a memory_bytes or cpu_limit setting will be refused.",
            f" under {cgroup_parent!r}" if cgroup_parent else "",
        )
    elif found is not None:
        missing = [c for c in CONTROLLERS if c not in found.parents]
        if missing and key not in _warned:
            _warned.add(key)
            log.warning("cgroup v%s on this worker lacks the %s controller(s)", found.version, ", ".join(missing))
    return found
