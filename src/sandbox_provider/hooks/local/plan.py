"""
What every launch of one local sandbox needs, worked out once per sandbox: bubblewrap's options,
the environment, the limits, the user and the tools (``Plan``), and the caches behind it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sandbox_provider.hooks import egress
from sandbox_provider.hooks.local import driver, state
from sandbox_provider.sandbox.attach import expiry_of
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.spec import NETWORK_TAG


@dataclasses.dataclass(frozen=True)
class Plan:
    """One sandbox's launch: its directory, bwrap's options, environment, limits, user, tools, expiry."""

    path: str
    bwrap_argv: list[str]
    env: dict[str, str]
    limits: Mapping[str, Any]
    uid: int
    tools: dict[str, str]
    expires_at: float | None
    #: what runs before each launch's own program (the egress forwarder), or nothing
    prefix: list[str] = dataclasses.field(default_factory=list)


def build(
    path: str,
    record: Mapping[str, Any],
    *,
    bwrap: str,
    image: str | None,
    workdir: str,
    shm_default: int,
    tools: dict[str, str],
) -> Plan:
    """The plan of the sandbox in directory ``path`` from its crash-safe ``record`` (``state.read_record``'s shape)."""
    tags, limits = record["stamps"], record["limits"]
    network = '"block_network":false' in tags.get(NETWORK_TAG, "")
    gateway = (
        egress.local_launch(egress.local_gateway_dir(path), []) if egress.has_allowlist(tags.get(NETWORK_TAG)) else None
    )
    argv = driver.bwrap_argv(
        bwrap,
        box=state.box_path(path, limits),
        workdir=workdir,
        binds=system_binds(image, workdir, network) + (gateway.binds if gateway else []),
        network=network,
        shm_bytes=int(limits.get("shm_bytes") or shm_default),
    )
    return Plan(
        path=path,
        bwrap_argv=argv,
        env={**driver.base_env(workdir), **(gateway.env if gateway else {}), **record["env"]},
        prefix=gateway.argv if gateway else [],
        limits=limits,
        uid=int(tags.get(state.UID_TAG, os.getuid())),
        tools=tools,
        expires_at=expiry_of(tags),
    )


def start(
    handle: str,
    plan: Plan,
    argv: list[str],
    *,
    binds: Sequence[tuple[int, str]],
    env: Mapping[str, str],
    cgroups: Any,
    rlimits: Mapping[str, int],
    drops_root: bool,
    popen_kwargs: Mapping[str, Any],
) -> driver.Started:
    """
    Start one launch of ``plan`` running ``argv`` with ``binds`` and ``env``, in the sandbox's cgroup
    when ``cgroups`` has one, as the sandbox's user when the worker ``drops_root``.

    :raises SandboxTerminalError: when bubblewrap cannot be started.
    """
    placement = cgroups.placement(handle) if cgroups is not None else None
    try:
        return driver.start(
            plan.tools,
            with_binds(plan.bwrap_argv, binds),
            [*plan.prefix, *argv],
            env=env,
            rlimits=rlimits,
            uid=plan.uid if drops_root else None,
            placement=placement,
            join_cgroup=(lambda pid: cgroups.join(handle, pid)) if cgroups and not placement else None,
            held_fds=[fd for fd, _ in binds],
            popen_kwargs=popen_kwargs,
        )
    except OSError as err:
        raise SandboxTerminalError(f"Could not start bubblewrap in sandbox {handle}: {err}") from err


def with_binds(bwrap_argv: list[str], binds: Sequence[tuple[int, str]]) -> list[str]:
    """
    ``bwrap_argv`` with ``binds`` (a descriptor of a worker directory, the path inside) mounted writable,
    before the root goes read-only. Mounted by descriptor (``--bind-fd``): the directory the worker
    opened, never whatever its name leads to at launch (a link put there meanwhile, say).
    """
    if not binds:
        return bwrap_argv
    at = bwrap_argv.index("--remount-ro")
    extra = [arg for fd, dest in binds for arg in ("--bind-fd", str(fd), dest)]
    return [*bwrap_argv[:at], *extra, *bwrap_argv[at:]]


@functools.cache
def binds_by_descriptor(bwrap: str) -> bool:
    """
    Whether ``bwrap`` mounts a directory by descriptor (``--bind-fd``: recent releases, and the
    security updates of older ones, Debian 12's 0.8.0-2+deb12u1 among them); asked once per bwrap.
    """
    try:
        shown = subprocess.run([bwrap, "--help"], capture_output=True, env=driver.BWRAP_ENV, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return b"--bind-fd" in shown.stdout + shown.stderr


@functools.lru_cache(maxsize=16)
def system_binds(image: str | None, workdir: str, network: bool) -> list[str]:
    """The read-only system binds of a sandbox on ``image`` (None: the worker's own), computed once."""
    return driver.system_binds(image, workdir, network)


#: Programs found: (name, search path) -> where; a program not found is looked for again next time.
_FOUND: dict[tuple[str, str | None], str] = {}


def program(name: str, path: str | None) -> str | None:
    """Where program ``name`` is on the search path ``path`` (None: the default), found once per worker process."""
    found = _FOUND.get((name, path))
    if found is None:
        found = shutil.which(name, path=path)
        if found is not None:
            _FOUND[(name, path)] = found
    return found


def which(name: str) -> str | None:
    """Where a tool bubblewrap launches is, on bwrap's own PATH; looked up once per worker process."""
    return program(name, driver.BWRAP_ENV["PATH"])


def checked(value: Any, check: Callable[[Any], Any]) -> Any:
    """A setting of a shape its table cannot say, checked: :raises SandboxTerminalError: saying what to fix."""
    try:
        return check(value)
    except ValueError as err:
        raise SandboxTerminalError(f"{err} Fix the connection's extra, or pass the setting to the hook.") from err
