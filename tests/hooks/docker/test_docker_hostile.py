"""
The Docker backend against hostile code, on a real Docker Engine (see ``conftest.py``).

Each attack comes with a positive control: where the attack should work (as root, with the
``run_as_root`` opt-in, or under plain ``sh``), the test shows that it does, and then that the
default sandbox stops it. Processes are counted from outside, through the Engine's ``top``, which
nothing inside can fake. Containers are found by this module's own owner labels only: other
people's containers may share the Engine.
"""

from __future__ import annotations

import io
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest

from sandbox_provider.sandbox.deployment import deployment
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    MAP_INDEX_TAG,
    OWNER_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
    SandboxSpec,
)

docker = pytest.importorskip("docker")

from conftest import DOCKER_IMAGE, container_gone  # noqa: E402
from pid_namespace import until  # noqa: E402
from sandbox_provider.hooks.docker import driver  # noqa: E402
from sandbox_provider.hooks.docker.exec import DEADLINE_GRACE  # noqa: E402
from sandbox_provider.hooks.docker.hook import SANDBOX_LABEL, DockerSandboxHook  # noqa: E402

pytestmark = pytest.mark.docker

UID = "65432"
RUN = secrets.token_hex(4)
#: A sleep duration no other process has on its command line, to find what a test started.
MARK = f"299.0{os.getpid()}"


def sh(hook, handle, command, timeout=30, cap=64 * 1024):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=cap)


def user_processes(client, handle: str) -> list[str]:
    """The live processes of the command user in the container, as the Engine's ``ps`` sees them."""
    rows = client.api.top(handle, ps_args="-o pid,uid,stat,args")["Processes"]
    return [row[3] for row in rows if row[1] == UID and not row[2].startswith("Z")]


def left_running(client, handle: str, within: float = 15.0) -> list[str]:
    """
    What :func:`user_processes` still lists once it lists nothing, or after ``within`` seconds. A
    sweep's kill(-1) signals every process at once, but each takes a moment to die (a stopped one must
    be scheduled first; on a busy machine ps can catch it exiting, as ``[sh]``): a process the sweep
    missed is still listed when the bound is up.
    """
    deadline = time.monotonic() + within
    while (left := user_processes(client, handle)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def gone(client, handle: str) -> bool:
    return container_gone(client, handle)


def owned_by(client, owner: str) -> list[dict]:
    return client.api.containers(all=True, filters={"label": [SANDBOX_LABEL, f"{OWNER_TAG}={owner}"]})


@pytest.fixture(scope="module")
def hook(docker_conn):
    return DockerSandboxHook(docker_conn, pull="never")


@pytest.fixture(scope="module")
def root_hook(docker_conn):
    return DockerSandboxHook(docker_conn, pull="never", run_as_root=True)


@pytest.fixture(scope="module")
def sandbox(hook):
    handle = hook.create()
    yield handle
    hook.destroy(handle)


# -- the keeper and the lifetime -----------------------------------------------------------------------

_CREATOR = """
import sys
from sandbox_provider.hooks.docker import DockerSandboxHook
from sandbox_provider.sandbox.spec import SandboxSpec
hook = DockerSandboxHook(sys.argv[1], sandbox_timeout=float(sys.argv[2]), run_as_root=sys.argv[3] == "root",
                         pull="never")
handle = hook.create(spec=SandboxSpec(owner=sys.argv[4]))
print("HANDLE=" + handle, flush=True)
hook.run_command(handle, sys.argv[5], timeout=600, max_output_bytes=1024)
"""

#: Stop or kill every process the command user can see, the keeper (PID 1) above all, and go on
#: doing it: with the creating worker killed, nothing outside ends this command before the lifetime.
_ATTACK = (
    "kill -STOP 1; kill -KILL 1; "
    "python3 -c 'import ctypes; ctypes.CDLL(None).ptrace(16, 1, 0, 0)'; "
    'for p in /proc/[0-9]*; do kill -STOP "${p#/proc/}"; done 2>/dev/null; '
    "while :; do kill -STOP -1; kill -STOP 1; done 2>/dev/null"
)


def _start_creator(docker_conn, lifetime: float, mode: str, owner: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CREATOR, docker_conn, str(lifetime), mode, owner, _ATTACK],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def _keeper_state(client, handle: str) -> str:
    """The ``ps`` state of the sandbox's keeper (the container's first process), "" when it is not listed."""
    keeper = str(client.api.inspect_container(handle)["State"]["Pid"])
    rows = client.api.top(handle, ps_args="-o pid,stat")["Processes"]
    return next((row[1] for row in rows if row[0] == keeper), "")


def _handle_of(creator: subprocess.Popen) -> str:
    seen = []
    for line in creator.stdout:  # Airflow may log to stdout first
        seen.append(line)
        if line.startswith("HANDLE="):
            return line.strip().removeprefix("HANDLE=")
    raise AssertionError("".join(seen))


def test_nothing_inside_can_stop_the_lifetime(docker_conn, docker_client):
    owner = f"dag_hostile/keeper_{RUN}"
    creators = [_start_creator(docker_conn, 6, mode, owner) for mode in ("user", "root")]
    try:
        user_handle, root_handle = (_handle_of(c) for c in creators)
        # The attacks run: the command user's processes are there, and root's has stopped the keeper.
        assert until(lambda: user_processes(docker_client, user_handle), 60), "the user's attack never ran"
        stopped = until(lambda: _keeper_state(docker_client, root_handle).startswith(("t", "T")), 60)
        assert stopped, f"root's attack never stopped the keeper: {_keeper_state(docker_client, root_handle)!r}"
        for creator in creators:
            creator.send_signal(signal.SIGKILL)  # the worker dies: nothing outside ends the command
            creator.wait(10)
        assert user_processes(docker_client, user_handle)  # the attack is still running inside
        labels = docker_client.api.inspect_container(user_handle)["Config"]["Labels"]
        expires = float(labels["airflow_expires_at"])
        # The keeper ends at the lifetime (counted in whole seconds of /proc/uptime), and the Engine's
        # removal follows, which takes seconds of its own on a loaded machine.
        while not gone(docker_client, user_handle) and time.time() < expires + 20:
            time.sleep(0.2)
        ended = time.time()
        assert gone(docker_client, user_handle), "the command user's attack stopped the keeper"
        assert expires - 2 <= ended <= expires + 10, (expires, ended)
        # The positive control: root (the opt-in) stops the keeper's clock; the sandbox outlives its
        # lifetime, until the sweep that runs at every create removes it by its expiry label. Its own
        # expiry, not the other's: on a busy machine its creator may have made it seconds later.
        root_expires = float(docker_client.api.inspect_container(root_handle)["Config"]["Labels"]["airflow_expires_at"])
        while time.time() <= root_expires + 1:
            time.sleep(0.2)
        assert docker_client.api.inspect_container(root_handle)["State"]["Running"]
        DockerSandboxHook(docker_conn, pull="never").destroy(DockerSandboxHook(docker_conn, pull="never").create())
        assert gone(docker_client, root_handle)
    finally:
        for creator in creators:
            if creator.poll() is None:
                creator.kill()
        for item in owned_by(docker_client, owner):
            docker_client.api.remove_container(item["Id"], force=True)


def test_remove_expired_ends_a_running_sandbox_past_its_expiry(hook, docker_client):
    owner = f"dag_hostile/expired_{RUN}"
    name = "airflow-sandbox-" + secrets.token_hex(6)
    # Past its expiry only for this sweep (judged an hour on): every create on the Engine sweeps, and one of
    # another test (another worker's) would remove an already expired one first.
    expires = int(time.time()) + 3600
    labels = {SANDBOX_LABEL: name, OWNER_TAG: owner, "airflow_expires_at": str(expires)}
    labels.update(driver.deployment_labels(deployment()))  # this worker's: its sweeps see only those
    docker_client.containers.run(DOCKER_IMAGE, ["sleep", "300"], name=name, labels=labels, detach=True)
    try:
        assert hook.remove_expired(owner=owner) == []  # the control: not yet past it
        assert hook.remove_expired(owner=owner, now=expires + 1) == [name]
        assert gone(docker_client, name)
    finally:
        if not gone(docker_client, name):
            docker_client.api.remove_container(name, force=True)


# -- nothing a command starts outlives it ----------------------------------------------------------------

_ESCAPES = {
    "setsid": f"setsid sh -c 'sleep {MARK}' > /dev/null 2>&1 &",
    "nohup": f"nohup sh -c 'sleep {MARK}' > /dev/null 2>&1 &",
    "double-fork": f"(setsid sh -c 'trap \"\" TERM HUP; (setsid sleep {MARK} &); sleep {MARK}' &)",
    "control-chars": f'n="/tmp/$(printf \'a\\nb\\001c) d\')"; cp /bin/sleep "$n" && ("$n" {MARK} &)',
    "killed-runner": f"kill -KILL -1; setsid sleep {MARK} &",
}


@pytest.mark.parametrize("escape", sorted(_ESCAPES))
@pytest.mark.parametrize("ends", ["by-itself", "at-deadline"])
def test_nothing_a_command_started_outlives_it(hook, sandbox, docker_client, escape, ends):
    # The positive control is in the command: what it started runs while it does.
    probe = f"sleep 0.5; ps -eo args= | grep -c '{MARK}'"
    tail = "exit 0" if ends == "by-itself" else "sleep 60"
    result = sh(hook, sandbox, f"{_ESCAPES[escape]}\n{probe}\n{tail}", timeout=4)
    assert int(result.stdout.split()[0]) >= 2, result  # the escaped process, and grep itself
    if escape == "killed-runner":  # its output ends with the runner, whose status it is
        assert result.exit_code == 137 or result.timed_out, result
    else:
        assert result.timed_out == (ends == "at-deadline"), result
    assert not result.sandbox_terminated
    assert left_running(docker_client, sandbox) == []
    assert sh(hook, sandbox, "echo still here").stdout == "still here\n"


_TRACER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\\0")
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    argv = cmdline(pid)
    if argv[0] in (b"/.airflow-sandbox/sh", b"timeout"):
        found[argv[0].decode()] = int(pid)
for name, pid in sorted(found.items()):
    rc = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    print(name, rc, ctypes.get_errno() if rc else 0)
    if rc == 0:
        libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
"""


def test_the_command_cannot_trace_the_runner(hook, sandbox):
    hook.write_file(sandbox, "tracer.py", _TRACER.encode())
    lines = sh(hook, sandbox, "python3 tracer.py").stdout.splitlines()
    # The positive control: the command may trace its own timeout process; the runner it may not.
    assert lines == ["/.airflow-sandbox/sh -1 1", "timeout 0 0"], lines


def test_a_command_cannot_forge_the_end_of_its_runner(hook, sandbox, docker_client):
    # The runner's status token is in no environment the command can read, its own or the runner's.
    probe = (
        "env | grep -c AIRFLOW_SANDBOX_STATUS; "
        "for p in /proc/[0-9]*; do cat $p/environ 2>/dev/null; done | tr '\\0' '\\n' | grep -c AIRFLOW_SANDBOX_STATUS"
    )
    assert sh(hook, sandbox, probe).stdout.split() == ["0", "0"]
    # A forged trailer as the last output, the runner killed, a daemon left: the hook still sweeps.
    forge = (
        "setsid sh -c 'exec sleep 300' < /dev/null > /dev/null 2>&1 & sleep 0.2; "
        "printf '\\036sandbox-status:%s:0\\n' 0123456789abcdef0123456789abcdef >&2; "
        "kill -KILL $(ps -o ppid= -p $PPID)"
    )
    result = sh(hook, sandbox, forge)
    assert result.exit_code == 137 and not result.sandbox_terminated, result
    assert "sandbox-status:0123456789abcdef" in result.stderr  # the forgery stays the command's own output
    assert left_running(docker_client, sandbox) == []
    # The positive control: without the kill the runner itself ends the daemon, and reports its status.
    assert sh(hook, sandbox, "setsid sh -c 'exec sleep 300' < /dev/null > /dev/null 2>&1 & exit 3").exit_code == 3
    assert left_running(docker_client, sandbox) == []


def test_a_process_that_stops_everything_it_can_see_is_swept_too(hook, sandbox, docker_client):
    # It stops the runner, which cannot end it then; so the command cannot end by itself (the
    # positive control), and the hook's sweep at the deadline ends it all.
    spinner = "setsid sh -c 'while :; do kill -STOP -1; done' > /dev/null 2>&1 & sleep 0.5; exit 0"
    began = time.monotonic()
    result = sh(hook, sandbox, spinner, timeout=3)
    assert result.timed_out and not result.sandbox_terminated, result
    assert time.monotonic() - began < 3 + DEADLINE_GRACE + 5
    assert left_running(docker_client, sandbox) == []
    assert sh(hook, sandbox, "echo still here").stdout == "still here\n"


#: Forks what the command waits for first, then a bomb of new sessions that fills the process table.
def _bomb(seconds: int) -> str:
    return (
        f"sleep {seconds} & s=$!; printf '%s\\n' 'while :; do setsid sh /tmp/bomb.sh & done' > /tmp/bomb.sh; "
        "setsid sh /tmp/bomb.sh & wait $s"
    )


@pytest.mark.parametrize("ends", ["by-itself", "at-deadline"])
def test_a_setsid_fork_bomb_is_gone_after_the_command(hook, docker_conn, docker_client, ends):
    handle = DockerSandboxHook(docker_conn, pull="never", pids_limit=128).create()
    try:
        result = sh(hook, handle, _bomb(3 if ends == "by-itself" else 60), timeout=6, cap=4096)
        assert "Cannot fork" in result.stderr, result  # the positive control: the process table filled up
        assert result.timed_out == (ends == "at-deadline"), result
        assert left_running(docker_client, handle) == []
        assert sh(hook, handle, "echo still here").stdout == "still here\n"
    finally:
        hook.destroy(handle)


def test_a_timeout_returns_in_time_under_a_fork_bomb(hook, sandbox, docker_client):
    began = time.monotonic()
    result = sh(hook, sandbox, _bomb(60), timeout=5, cap=4096)
    elapsed = time.monotonic() - began
    assert result.timed_out and not result.sandbox_terminated, result
    assert "Cannot fork" in result.stderr  # the positive control: the bomb filled the process table
    assert elapsed < 10, f"a 5 s timeout returned after {elapsed:.1f} s"
    assert left_running(docker_client, sandbox) == []
    assert sh(hook, sandbox, "echo still here").stdout == "still here\n"


def test_a_timed_out_command_shows_only_its_own_output(hook, sandbox):
    result = sh(hook, sandbox, "echo partial; sleep 30", timeout=1)
    assert result.timed_out and (result.stdout, result.stderr) == ("partial\n", ""), result
    result = sh(hook, sandbox, "sleep 30", timeout=1)
    assert result.timed_out and (result.stdout, result.stderr) == ("", ""), result


def test_the_toolset_shows_a_docker_timeout_in_the_guides_shape(hook):
    from sandbox_provider.toolsets.sandbox import SandboxToolset

    with SandboxToolset(hook) as toolset:
        text = toolset.call("run_command", command="sleep 30", timeout_seconds=2)
    assert text == "(no output)\n[timed out after 2s]"


# -- leftovers of killed workers --------------------------------------------------------------------------

#: Forks one worker per line read; each provisions a sandbox, which the test kills at a random moment.
_FORKER = """
import os, sys
from sandbox_provider.hooks.docker import DockerSandboxHook
from sandbox_provider.sandbox.spec import SandboxSpec
conn, owner = sys.argv[1], sys.argv[2]
last = None
for line in sys.stdin:
    if last is not None:
        os.waitpid(last, 0)
    last = pid = os.fork()
    if pid == 0:
        DockerSandboxHook(conn, sandbox_timeout=4, pull="never").create(spec=SandboxSpec(owner=owner))
        os._exit(0)
    print(pid, flush=True)
    # Wait for it to end but leave it unreaped until the next line: the test kills this pid after a
    # random pause, and a reaped child's pid may already be another process's.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
"""


def test_workers_killed_during_create_leave_nothing_the_next_create_does_not_remove(docker_conn, docker_client):
    owner = f"dag_hostile/killed_{RUN}"
    forker = subprocess.Popen(
        [sys.executable, "-c", _FORKER, docker_conn, owner],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    # The deterministic positive control: a container created and never started, as a worker
    # killed between the two calls leaves it; the Engine never removes it by itself.
    name = "airflow-sandbox-" + secrets.token_hex(6)
    docker_client.api.create_container(
        DOCKER_IMAGE,
        ["sleep", "1"],
        name=name,
        labels={SANDBOX_LABEL: name, OWNER_TAG: owner, **driver.deployment_labels(deployment())},
    )
    try:
        began = time.monotonic()
        DockerSandboxHook(docker_conn, pull="never").destroy(DockerSandboxHook(docker_conn, pull="never").create())
        create_seconds = time.monotonic() - began
        rng = random.Random(RUN)
        for _ in range(25):
            forker.stdin.write("go\n")
            forker.stdin.flush()
            line = forker.stdout.readline()
            while not line.strip().isdigit():  # Airflow may log to stdout first
                line = forker.stdout.readline()
            pid = int(line)
            time.sleep(rng.uniform(0, create_seconds))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it finished first: its sandbox ends with its lifetime
        states = [c["State"] for c in owned_by(docker_client, owner)]
        print(f"left by 25 killed workers (and the control): {sorted(states)}")
        assert "created" in states
        time.sleep(6)  # past the grace below, and the 4 s lifetime of the started ones
        sweeper = DockerSandboxHook(docker_conn, pull="never")
        sweeper.created_grace = 5
        sweeper.destroy(sweeper.create())
        end = time.monotonic() + 10  # a container the Engine is removing right now may still be listed
        while owned_by(docker_client, owner) and time.monotonic() < end:
            time.sleep(0.2)
        assert owned_by(docker_client, owner) == []
    finally:
        forker.kill()
        forker.wait(10)
        for item in owned_by(docker_client, owner):
            docker_client.api.remove_container(item["Id"], force=True)


# -- disk ---------------------------------------------------------------------------------------------------


def _quota_support(client) -> str | None:
    info = client.api.info()
    status = dict(info.get("DriverStatus") or [])
    if info.get("Driver") == "overlay2" and status.get("Backing Filesystem") != "xfs":
        return f"overlay2 on {status.get('Backing Filesystem')}"
    return None


def test_disk_bytes_is_refused_where_the_storage_driver_cannot_enforce_it(docker_conn, docker_client):
    driver_name = _quota_support(docker_client)
    if driver_name is None:
        pytest.skip("this Engine's storage driver may enforce disk_bytes; see the next test")
    owner = f"dag_hostile/disk_{RUN}"
    with pytest.raises(SandboxTerminalError, match="disk_bytes=67108864 cannot be enforced") as info:
        DockerSandboxHook(docker_conn, pull="never", disk_bytes=64 * 2**20).create(spec=SandboxSpec(owner=owner))
    assert driver_name in str(info.value) and "xfs" in str(info.value) and "Unset disk_bytes" in str(info.value)
    assert owned_by(docker_client, owner) == []


def test_writing_past_disk_bytes_fails_inside(docker_conn, docker_client):
    unable = _quota_support(docker_client)
    if unable is not None:
        reason = f"this Engine stores containers with {unable}, which cannot limit disk"
        if os.environ.get("SANDBOX_REQUIRE_DISK_LIMIT"):  # CI runs this on scripts/docker/quota-engine.sh
            pytest.fail(f"SANDBOX_REQUIRE_DISK_LIMIT is set but {reason}")
        pytest.skip(reason + " (scripts/docker/quota-engine.sh starts one that can)")
    # Some drivers (btrfs) count the image's files in the limit too: leave room for them.
    hook = DockerSandboxHook(docker_conn, pull="never", disk_bytes=400 * 2**20)
    handle = hook.create()
    try:
        # The positive control: 32 MiB fits; 512 MiB does not.
        assert sh(hook, handle, "head -c 32M /dev/zero > small && echo ok").stdout == "ok\n"
        result = sh(hook, handle, "head -c 512M /dev/zero > big", timeout=60)
        assert not result.ok and ("No space left" in result.stderr or "quota exceeded" in result.stderr), result
    finally:
        hook.destroy(handle)
    with pytest.raises(SandboxTerminalError, match="disk_bytes=1048576"):
        DockerSandboxHook(docker_conn, pull="never", disk_bytes=2**20).create()


# -- files --------------------------------------------------------------------------------------------------

_SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
end, n = time.time() + float(sys.argv[2]), 0
while time.time() < end:
    libc.renameat2(-100, b"f", -100, b"g", 2)  # RENAME_EXCHANGE: f and g swap, atomically
    os.symlink("ab"[n % 2], "cur.new")
    os.rename("cur.new", "cur")  # the directory link flips between a and b
    n += 1
print(n)
"""


def test_reads_never_tear_while_something_swaps_the_file(hook):
    small, large = b"a" * 1000, b"b" * 100_000
    handle = hook.create()
    try:
        sh(hook, handle, "mkdir -p sw/a sw/b && ln -s a sw/cur")
        for path, data in (("sw/f", small), ("sw/g", large), ("sw/a/x", small), ("sw/b/x", large)):
            hook.write_file(handle, path, data)
        hook.write_file(handle, "swap.py", _SWAPPER.encode())
        results: list = []

        def read_both() -> None:
            for path in ("sw/f", "sw/cur/x"):
                try:
                    results.append(hook.read_file(handle, path, max_bytes=10**6))
                    sink = io.BytesIO()
                    hook.export_file(handle, path, sink, max_bytes=10**6)
                    results.append(sink.getvalue())
                except SandboxError:  # an export that saw the size change: allowed, not torn
                    results.append(None)

        # The swap runs as a command while reads come in from another thread (an agent's tool calls
        # run in parallel), and then as a background process that a command leaves behind.
        swapping: dict = {}
        thread = threading.Thread(
            target=lambda: swapping.setdefault("result", sh(hook, handle, "python3 swap.py sw 6", timeout=30))
        )
        thread.start()
        time.sleep(0.5)
        while thread.is_alive() or len(results) < 20:
            read_both()
        thread.join()
        assert int(swapping["result"].stdout) > 1000, swapping  # the positive control: it swapped
        assert sh(hook, handle, "python3 swap.py sw 30 & sleep 0.5; echo started").stdout == "started\n"
        read_both()
        torn = [len(r) for r in results if r is not None and r not in (small, large)]
        assert torn == [], f"{len(torn)} torn reads of {len(results)}: sizes {torn[:5]}"
    finally:
        hook.destroy(handle)


def test_files_move_with_the_command_users_rights(hook, root_hook, sandbox, docker_client):
    hook.write_file(sandbox, "mine.txt", b"x")
    assert sh(hook, sandbox, "stat -c %u:%g mine.txt").stdout == f"{UID}:{UID}\n"
    # A write through the hook is no way around the command user's permissions: a system binary the
    # keeper (root) runs, or the keeper's own files.
    for path in ("/usr/bin/sleep", "/.airflow-sandbox/tags.json", "/etc/evil"):
        with pytest.raises(SandboxError, match="Permission denied"):
            hook.write_file(sandbox, path, b"#!/bin/sh\necho owned\n")
    with pytest.raises(SandboxError):
        hook.read_file(sandbox, "/.airflow-sandbox/swept", max_bytes=100)
    denied = sh(hook, sandbox, "echo '{}' > /.airflow-sandbox/tags.json; ls /.airflow-sandbox")
    assert not denied.ok and "Permission denied" in denied.stderr
    # The positive control: root (the opt-in) can.
    handle = root_hook.create()
    try:
        root_hook.write_file(handle, "/etc/evil", b"x\n")
        assert sh(root_hook, handle, "cat /etc/evil; ls /.airflow-sandbox").stdout.split() == ["x", "sh", "swept"]
    finally:
        root_hook.destroy(handle)


def test_the_command_user_is_configurable(docker_conn, docker_client):
    hook = DockerSandboxHook(docker_conn, pull="never", sandbox_uid=12345)
    handle = hook.create()
    try:
        assert sh(hook, handle, "id -u; id -g; stat -c %u .").stdout.split() == ["12345", "12345", "12345"]
        assert docker_client.api.inspect_container(handle)["Config"]["Labels"][driver.USER_LABEL] == "12345:12345"
        # Another task's hook, with other settings, runs commands as the user the sandbox was made for.
        assert sh(DockerSandboxHook(docker_conn), handle, "id -u").stdout == "12345\n"
    finally:
        hook.destroy(handle)
    with pytest.raises(ValueError, match="sandbox_uid"):
        DockerSandboxHook(docker_conn, sandbox_uid=0)


# -- labels for tracing and retries -------------------------------------------------------------------------


def _trace(try_number: int, task: str = "t1", map_index: int = -1) -> dict[str, str]:
    return {
        DAG_ID_TAG: "dag_hostile",
        RUN_ID_TAG: f"run_{RUN}",
        TASK_ID_TAG: task,
        MAP_INDEX_TAG: str(map_index),
        TRY_NUMBER_TAG: str(try_number),
    }


def test_sandboxes_carry_the_task_that_made_them(docker_conn, monkeypatch):
    import sandbox_provider.sandbox.hook as hook_module

    hook = DockerSandboxHook(docker_conn, pull="never")
    made: dict[str, str] = {}

    def create(key: str, trace: dict[str, str]) -> set[str]:
        monkeypatch.setattr(hook_module, "trace_stamps", lambda: dict(trace))
        made[key] = hook.create()
        return {i.handle for i in hook.list_sandboxes(run_id=f"run_{RUN}")}

    try:
        assert create("try1", _trace(1)) == {made["try1"]}
        create("other_task", _trace(1, task="t2"))
        left = create("other_index", _trace(1, map_index=3))
        assert left == {made["try1"], made["other_task"], made["other_index"]}
        info = next(i for i in hook.list_sandboxes(run_id=f"run_{RUN}", task_id="t1", map_index=-1))
        assert info.handle == made["try1"] and {k: info.stamps[k] for k in _trace(1)} == _trace(1)
        by_index = hook.list_sandboxes(run_id=f"run_{RUN}", task_id="t1", map_index=3)
        assert [i.handle for i in by_index] == [made["other_index"]]
    finally:
        for handle in made.values():
            hook.destroy(handle)


def test_an_attaching_worker_ends_what_an_earlier_holder_left_running(docker_conn, docker_client):
    owner = f"dag_hostile/attach_{RUN}"
    hook = DockerSandboxHook(docker_conn, pull="never")
    handle = hook.create(spec=SandboxSpec(owner=owner))
    try:
        # What a worker killed mid-command leaves: a process of the command still at work, which
        # this process never saw (and so never swept).
        spoiler = "setsid sh -c 'while :; do echo spoiled > .s && mv -f .s in.txt; done' > /dev/null 2>&1 &"
        exec_id = docker_client.api.exec_create(handle, ["sh", "-c", spoiler], user=f"{UID}:{UID}")["Id"]
        docker_client.api.exec_start(exec_id, detach=True)
        time.sleep(0.3)
        assert user_processes(docker_client, handle)  # the positive control: it runs, and spoils
        assert docker_client.api.exec_start(docker_client.api.exec_create(handle, ["cat", "in.txt"])["Id"]) == (
            b"spoiled\n"
        )
        driver.mark_swept(handle, False)
        later = DockerSandboxHook(docker_conn)
        later.attach(handle, owner=owner, holder=f"{owner}/t2")
        later.write_file(handle, "in.txt", b"mine\n")
        assert sh(later, handle, "cat in.txt").stdout == "mine\n"
        assert left_running(docker_client, handle) == []
    finally:
        hook.destroy(handle)


# -- a caller that stops waiting -------------------------------------------------------------------------


class _Stop(Exception):
    """What a task timeout raises in the waiting thread."""


def test_a_callback_that_raises_stops_the_command_at_once(hook, sandbox, docker_client):
    # After its first line the command waits for a file "go", then leaves "after": it gets to its end
    # only if it is still running when "go" appears.
    command = "echo a; while [ ! -e go ]; do sleep 0.05; done; touch after"
    # The positive control: without the callback, and with "go" there, the command gets to its end.
    assert sh(hook, sandbox, f"touch go; {command}").ok
    assert sh(hook, sandbox, "rm go after").ok

    def interrupt(stream, data):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hook.run_command(sandbox, command, timeout=30, max_output_bytes=100, on_output=interrupt)
    assert left_running(docker_client, sandbox) == []
    # "go" appears now: a command still running would leave "after" within 0.05 s.
    assert sh(hook, sandbox, "touch go; sleep 1; test -e after && echo ran || echo stopped").stdout == "stopped\n"


def test_a_task_timeout_while_waiting_stops_the_command(hook, sandbox, docker_client):
    def alarm(signum, frame):
        raise _Stop

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(_Stop):
            sh(hook, sandbox, "sleep 2; touch after2", timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert left_running(docker_client, sandbox) == []
    assert sh(hook, sandbox, "sleep 2; test -e after2 && echo ran || echo stopped").stdout == "stopped\n"
