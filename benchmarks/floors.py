"""
What ``bench_concurrency.py`` and ``bench_toolset.py`` share: the backends' hooks built the way the
tests build them, the raw tools they are measured against (``bwrap`` with the local backend's
namespaces and mounts as they were at commit 0af3f6f, ``docker run --rm`` of the same image with
no network), and the count of what a run left behind on each backend. The raw floors use none of
the provider's code, so a run on another tree of the provider measures against the same floor.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
DOCKER_CONN_ID = "sandbox_docker_bench"
os.environ.setdefault(
    f"AIRFLOW_CONN_{DOCKER_CONN_ID.upper()}", json.dumps({"conn_type": "sandbox_docker", "extra": {"image": IMAGE}})
)
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")

#: The label on the raw containers of one run, so a count sees only this run's.
RAW_LABEL = "airflow_sandbox_bench_run"
#: The lease directory the local backend uses by default on a root worker (one for the host).
UID_LEASE_DIR = os.path.join(tempfile.gettempdir(), "airflow-sandbox-uids")

BACKENDS = ("local", "docker")


def run_tag() -> str:
    """A tag naming this run of a benchmark script: its process id."""
    return f"bench-{os.getpid()}"


def provenance() -> str:
    """Which ``sandbox_provider`` is measured: its directory and that checkout's commit."""
    import sandbox_provider

    where = os.path.dirname(os.path.abspath(sandbox_provider.__file__))
    try:
        commit = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", where, "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "?", ""
    return f"sandbox_provider from {where} (commit {commit}{', modified' if dirty else ''})"


# -- the local backend ----------------------------------------------------------------------------------


def local_root() -> str:
    """A temporary directory for one run's state root and raw sandbox; a root worker's sandbox users pass through."""
    root = tempfile.mkdtemp(prefix="sandbox-bench-")
    os.chmod(root, 0o711)
    return root


def local_hook(root: str, cgroup_parent: str):
    """A ``LocalSandboxHook`` on ``<root>/state`` whose cgroups go under ``cgroup_parent`` (this run's own)."""
    from sandbox_provider.hooks.local import LocalSandboxHook

    return LocalSandboxHook(state_root=os.path.join(root, "state"), cgroup_parent=cgroup_parent)


#: The raw floor's read-only system mounts and ``/etc`` entries: the local backend's at commit 0af3f6f,
#: written out so the floor stays the same whichever tree of the provider is measured.
RAW_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
RAW_ETC_ENTRIES = (
    *("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd", "group"),
    *("nsswitch.conf", "hosts", "host.conf", "protocols", "services", "ssl", "ca-certificates"),
    *("ca-certificates.conf", "mime.types", "os-release", "debian_version", "lsb-release"),
    *("python3", "python3.11", "python3.12", "python3.13"),
)
#: The last id of the local backend's default uid range: the kind of user a root worker's sandboxes run as.
RAW_UID = 1900000000 + 65535


def _ro(source: str) -> list[str]:
    if os.path.islink(source):
        return ["--symlink", os.readlink(source), source]
    return ["--ro-bind", source, source] if os.path.exists(source) else []


def raw_bwrap_argv(box: str) -> list[str]:
    """
    ``bwrap`` with the namespaces, mounts and options the local backend gave a command at commit
    0af3f6f (new user, PID, IPC, UTS, cgroup and network namespaces, no capabilities, the system
    read-only, ``/proc``, ``/dev``, a 64 MiB ``/dev/shm``, ``box``'s ``tmp`` and ``workspace``, an
    empty environment), without its user id lease, cgroup, system-call filter or keyring.
    """
    args = [shutil.which("bwrap") or "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    args += ["--hostname", "sandbox", "--unshare-net"]
    for directory in RAW_SYSTEM_DIRS:
        args += _ro(directory)
    for entry in RAW_ETC_ENTRIES:
        args += _ro(os.path.join("/etc", entry))
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
    args += ["--bind", os.path.join(box, "tmp"), "/tmp", "--bind", os.path.join(box, "workspace"), "/workspace"]
    return [*args, "--remount-ro", "/", "--chdir", "/workspace", "--clearenv"]


def raw_bwrap(root: str) -> Callable[[Sequence[str]], subprocess.CompletedProcess]:
    """
    The raw tool under the local backend: :func:`raw_bwrap_argv` on a plain directory in ``root``,
    as an unprivileged user of the kind the backend uses when the worker is root, dropped to it
    with ``setpriv`` as the backend does. Returns a function running one argv that way, its
    output captured.
    """
    raw_uid = RAW_UID if os.geteuid() == 0 else os.getuid()
    box = os.path.join(root, "raw", "box")
    for sub in ("", "workspace", "tmp"):
        os.makedirs(os.path.join(box, sub), mode=0o700, exist_ok=True)
        os.chown(os.path.join(box, sub), raw_uid, raw_uid)
    os.chmod(os.path.join(root, "raw"), 0o711)
    argv = raw_bwrap_argv(box)
    drop = ["setpriv", f"--reuid={raw_uid}", f"--regid={raw_uid}", "--clear-groups"] if os.geteuid() == 0 else []
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def run(command: Sequence[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*drop, *argv, "--", *command], capture_output=True, stdin=subprocess.DEVNULL, env=env)

    return run


def destroy_as_a_task_does(hook, handle: str) -> None:
    """``hook.destroy(handle, wait=False)``, as a task's session destroys; a tree from before issue 32 has no ``wait``."""
    if _destroy_waits(type(hook)):
        hook.destroy(handle, wait=False)
    else:
        hook.destroy(handle)


@functools.cache
def _destroy_waits(hook_class: type) -> bool:
    """Whether ``hook_class.destroy`` takes ``wait`` (asked once per class: not timed as part of every round)."""
    import inspect

    return "wait" in inspect.signature(hook_class.destroy).parameters


def join_local_removals(timeout: float = 60.0) -> None:
    """Wait for the local sandboxes' removals this process still runs (``destroy(wait=False)`` leaves them)."""
    try:
        from sandbox_provider.hooks.local.hook import wait_for_removals
    except ImportError:  # a tree of the provider from before issue 32: its destroy waits
        return
    wait_for_removals(timeout)


def local_leftovers(root: str, cgroup_parent: str) -> dict[str, int]:
    """
    What is left of the local sandboxes of a run: entries of its state root, id leases whose
    sandbox lies in it, and sandbox cgroups under its own ``cgroup_parent`` (each controller's).
    """
    from sandbox_provider.hooks.local import cgroups

    state_root = os.path.join(root, "state")
    entries = os.listdir(state_root) if os.path.isdir(state_root) else []
    leases = 0
    if os.path.isdir(UID_LEASE_DIR):
        for name in os.listdir(UID_LEASE_DIR):
            try:
                target = os.readlink(os.path.join(UID_LEASE_DIR, name))
            except OSError:
                continue
            leases += target.startswith(state_root + os.sep)
    groups = 0
    found = cgroups.probe(cgroup_parent)
    for parent in found.parents.values() if found is not None else ():
        if os.path.isdir(parent):
            groups += sum(1 for entry in os.scandir(parent) if entry.is_dir())
    return {"state root entries": len(entries), "uid leases": leases, "cgroups": groups}


# -- the Docker backend ---------------------------------------------------------------------------------


def docker_hook(sandbox_uid: int):
    """
    A ``DockerSandboxHook`` on the bench connection (the image, defaults otherwise), built as the
    tests build it (``pull="never"``); its commands run as ``sandbox_uid``, which its containers
    carry in a label, so a count finds this run's containers among everyone else's.
    """
    from sandbox_provider.hooks.docker import DockerSandboxHook

    return DockerSandboxHook(DOCKER_CONN_ID, pull="never", sandbox_uid=sandbox_uid)


def bench_uid() -> int:
    """A sandbox user id for this run's Docker sandboxes, unlike the default 65432 and other runs'."""
    return 61000 + os.getpid() % 4000


def docker_run_argv(tag: str, command: Sequence[str]) -> list[str]:
    """``docker run --rm`` of the image with no network, labelled with this run's ``tag``."""
    return ["docker", "run", "--rm", "--network", "none", "--label", f"{RAW_LABEL}={tag}", IMAGE, *command]


def docker_leftovers(client, sandbox_uid: int, tag: str) -> dict[str, int]:
    """Containers of a run still on the Engine, in any state: the hook's (by user label) and the raw ones."""
    from sandbox_provider.hooks.docker import driver

    ours = client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{driver.USER_LABEL}={sandbox_uid}:{sandbox_uid}"}
    )
    raw = client.containers.list(all=True, ignore_removed=True, filters={"label": f"{RAW_LABEL}={tag}"})
    return {"hook containers": len(ours), "raw containers": len(raw)}


def docker_client():
    """A Docker SDK client to the worker's Engine, checked to have the image."""
    import docker

    client = docker.from_env(version="auto", timeout=120)
    client.images.get(IMAGE)
    return client


# -- two trees of the provider, interleaved ----------------------------------------------------------------


class TreeWorker:
    """
    A benchmark script run again in a child process on one tree of the provider (``src`` put first
    on its ``PYTHONPATH``; None: the tree this process imports), serving named actions one at a
    time (see :func:`serve`). The parent times each :meth:`do`, so two workers on two trees run
    interleaved in one ``harness.compare``; a request costs a pipe round trip (well under 1 ms).
    """

    def __init__(self, script: str, src: str | None, argv: Sequence[str]) -> None:
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(src), env.get("PYTHONPATH")) if p)
        command = [sys.executable, os.path.abspath(script), "--serve", *argv]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.tree = self._reply()

    def _reply(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark worker ended early with exit status {self.proc.wait()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"the benchmark worker failed: {reply['text']}")
        return reply["text"]

    def do(self, action: str) -> str:
        """Have the worker run ``action``; return its text. :raises RuntimeError: when the action failed."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(action + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> str:
        """End the worker; return its closing report (errors, leftovers)."""
        report = self.do("quit")
        self.proc.wait(timeout=300)
        return report


def serve(setup: Callable[[], tuple[dict[str, Callable[[], object]], Callable[[], str]]]) -> int:
    """
    The worker side of :class:`TreeWorker`: ``setup()`` returns the actions by name and the
    function that closes everything and returns the report. Each request line names an action
    (``quit`` ends); each reply is one JSON line, ``{"ok": ..., "text": ...}``, on the original
    standard output, which is kept for replies (anything else printed goes to standard error).
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(ok: bool, text: str) -> None:
        replies.write(json.dumps({"ok": ok, "text": text}) + "\n")

    try:
        actions, finish = setup()
    except Exception as err:
        reply(False, f"setup: {type(err).__name__}: {err}")
        return 1
    reply(True, provenance())
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        try:
            reply(True, str(actions[name]() or ""))
        except Exception as err:
            reply(False, f"{name}: {type(err).__name__}: {err}")
    reply(True, finish())
    return 0


def dispatch(args, *, serve, against_tree, against_floors) -> int:
    """
    A benchmark script's last step: ``serve(args)`` for the other tree's side (``--serve``), else
    ``against_tree(args)`` with ``--against``, else ``against_floors(args)`` after naming this tree.
    """
    logging.disable(logging.WARNING)
    if args.serve:
        return serve(args)
    if args.against:
        against_tree(args)
    else:
        print(provenance(), flush=True)
        against_floors(args)
    return 0
