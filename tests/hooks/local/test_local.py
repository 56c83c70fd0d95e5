"""LocalSandboxHook against real bubblewrap: isolation, limits, lifetime, files and attach."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from conftest import requires_bwrap
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local.hook import wait_for_removals
from sandbox_provider.sandbox import SandboxError, SandboxFileTooLargeError, SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG, HOLDER_TAG

pytestmark = requires_bwrap


@pytest.fixture
def hook(tmp_path):
    return LocalSandboxHook(state_root=str(tmp_path / "state"))


@pytest.fixture
def sandbox(hook):
    handle = hook.create(spec=SandboxSpec())
    yield handle
    hook.destroy(handle)


def run(hook, handle, command, timeout=30, cap=64 * 1024):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=cap)


@pytest.fixture
def tcp_server():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    hits = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            hits.append(1)
            conn.sendall(b"hello-from-host\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1], hits
    srv.close()


PY_CONNECT = (
    'python3 -c "import socket,sys; s=socket.socket(); s.settimeout(3); '
    "print('rc', s.connect_ex(('127.0.0.1', {port})))\""
)


class TestNetwork:
    def test_host_loopback_unreachable_when_blocked(self, hook, sandbox, tcp_server):
        port, hits = tcp_server
        result = run(hook, sandbox, PY_CONNECT.format(port=port))
        assert result.exit_code == 0, result.stderr
        assert "rc 0" not in result.stdout
        assert hits == []

    def test_dns_fails_when_blocked(self, hook, sandbox):
        result = run(
            hook, sandbox, "python3 -c \"import socket; socket.getaddrinfo('localhost-does-not-matter.example', 80)\""
        )
        assert result.exit_code != 0
        assert "gaierror" in result.stderr

    def test_only_loopback_interface(self, hook, sandbox):
        result = run(hook, sandbox, "cat /proc/net/dev")
        names = {line.split(":")[0].strip() for line in result.stdout.splitlines()[2:]}
        assert names == {"lo"}

    def test_open_network_reaches_host(self, hook, tcp_server):
        port, hits = tcp_server
        handle = hook.create(spec=SandboxSpec(block_network=False))
        try:
            result = run(hook, handle, PY_CONNECT.format(port=port))
            assert "rc 0" in result.stdout
        finally:
            hook.destroy(handle)

    @pytest.mark.parametrize(
        "spec",
        [SandboxSpec(allow_egress_to=["pypi.org"]), SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"])],
    )
    def test_allowlists_refused_before_provisioning_without_the_gateway(self, hook, spec, monkeypatch):
        from sandbox_provider.hooks import egress

        monkeypatch.setattr(egress, "missing_tools", lambda **_: ["socat on the worker (apt-get install socat)"])
        with pytest.raises(SandboxTerminalError, match="through an egress gateway on the worker, which needs socat"):
            hook.create(spec=spec)
        assert not os.path.exists(hook.state_root) or os.listdir(hook.state_root) == []


class TestIsolation:
    def test_worker_environment_invisible(self, hook, monkeypatch):
        monkeypatch.setenv("SANDBOX_TEST_SECRET", "s3cr3t-value-123")
        handle = hook.create(spec=SandboxSpec(env={"GIVEN": "yes"}))
        try:
            result = run(hook, handle, "env; cat /proc/1/environ | tr '\\0' '\\n'")
            assert "s3cr3t-value-123" not in result.stdout
            assert "AIRFLOW" not in result.stdout
            assert "GIVEN=yes" in result.stdout
        finally:
            hook.destroy(handle)

    def test_host_files_outside_grants_invisible(self, hook, sandbox, tmp_path):
        secret = tmp_path / "host-secret.txt"
        secret.write_text("top secret")
        home = os.path.expanduser("~")
        result = run(
            hook,
            sandbox,
            f"cat {secret}; ls {home}; ls {os.environ['AIRFLOW_HOME']}; cat /etc/shadow; ls /root /home /var /sys; "
            "ls /tmp; echo done",
        )
        assert "top secret" not in result.stdout
        assert "done" in result.stdout
        assert result.stdout.strip() == "done"

    def test_only_own_processes_visible(self, hook, sandbox):
        result = run(hook, sandbox, "ls /proc | grep -c '^[0-9]'")
        assert int(result.stdout.strip()) <= 4

    def test_no_capabilities_and_readonly_system(self, hook, sandbox):
        result = run(hook, sandbox, "grep CapEff /proc/self/status; touch /usr/x 2>&1; touch /etc/x 2>&1; echo end")
        assert "CapEff:\t0000000000000000" in result.stdout
        assert "Read-only file system" in result.stdout

    def test_files_persist_between_commands_and_tmp_is_private(self, hook, sandbox, tmp_path):
        run(hook, sandbox, "echo kept > note.txt; echo t > /tmp/t.txt")
        result = run(hook, sandbox, "cat /workspace/note.txt /tmp/t.txt")
        assert result.stdout == "kept\nt\n"
        other = hook.create()
        try:
            assert run(hook, other, "ls /tmp /workspace").stdout.split() == ["/tmp:", "/workspace:"]
        finally:
            hook.destroy(other)


class TestCommands:
    def test_exit_code_and_streams(self, hook, sandbox):
        result = run(hook, sandbox, "echo out; echo err >&2; exit 7")
        assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
        assert not result.timed_out

    def test_timeout_kills_tree_that_ignores_sigterm(self, hook, sandbox):
        script = (
            "(trap '' TERM; sleep 3; echo survived > /workspace/child.txt) & "
            "sh -c \"trap '' TERM INT; sleep 3; echo survived > /workspace/grandchild.txt\" & "
            "sleep 30"
        )
        started = time.monotonic()
        result = run(hook, sandbox, script, timeout=1)
        assert result.timed_out
        assert time.monotonic() - started < 10
        time.sleep(3.5)
        listing = run(hook, sandbox, "ls /workspace; echo alive")
        assert listing.stdout.strip() == "alive"  # sandbox still usable, children died before writing

    @pytest.mark.parametrize(
        "escape",
        [
            "setsid sh -c 'sleep 5; echo escaped > /workspace/escaped.txt' > /dev/null 2>&1 &",
            "nohup sh -c 'sleep 5; echo escaped > /workspace/escaped.txt' > /dev/null 2>&1 &",
        ],
        ids=["setsid", "nohup"],
    )
    def test_nothing_a_command_started_outlives_it(self, hook, sandbox, escape):
        assert run(hook, sandbox, f"{escape} exit 0").exit_code == 0
        time.sleep(6)
        assert run(hook, sandbox, "ls /workspace").stdout == ""

    def test_output_flood_stays_bounded(self, hook, sandbox):
        result = run(hook, sandbox, "head -c 300000000 /dev/zero | tr '\\0' x; echo; echo tail-marker", cap=4096)
        assert result.exit_code == 0
        assert result.stdout_truncated
        assert len(result.stdout.encode()) <= 4096
        assert result.stdout.endswith("tail-marker\n")

    def test_bad_arguments(self, hook, sandbox):
        for bad in (0, -1, float("nan"), True):
            with pytest.raises(ValueError, match="timeout"):
                hook.run_command(sandbox, "true", timeout=bad, max_output_bytes=10)
        with pytest.raises(ValueError, match="not a sandbox handle"):
            hook.run_command("", "true", timeout=1, max_output_bytes=10)
        with pytest.raises(SandboxTerminalError, match="not a local sandbox handle"):
            hook.run_command("../../etc", "true", timeout=1, max_output_bytes=10)

    def test_missing_sandbox_is_terminal(self, hook):
        with pytest.raises(SandboxTerminalError, match="does not exist"):
            run(hook, "airflow-sandbox-000000000000", "true")

    def test_memory_limit(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), memory_bytes=256 * 1024 * 1024)
        if hook._cgroups() is None or "memory" not in hook._cgroups().parents:
            with pytest.raises(SandboxTerminalError, match="cannot enforce memory_bytes"):
                hook.create()
            return
        handle = hook.create()
        try:
            result = run(hook, handle, "python3 -c 'b = bytearray(600 * 1024 * 1024); print(len(b))'")
            assert result.exit_code != 0
            assert "reached its memory limit (memory_bytes=268435456)" in result.stderr
            assert run(hook, handle, "python3 -c 'b = bytearray(100 * 1024 * 1024); print(len(b))'").ok
        finally:
            hook.destroy(handle)

    def test_limits_a_worker_cannot_enforce_are_refused_before_anything_is_made(self, tmp_path, monkeypatch):
        from sandbox_provider.hooks.local import cgroups as _local_cgroups

        monkeypatch.setattr(LocalSandboxHook, "_cgroups", lambda self: None)
        for setting in ({"memory_bytes": 1 << 28}, {"cpu_limit": 0.5}):
            hook = LocalSandboxHook(state_root=str(tmp_path / "s"), **setting)
            with pytest.raises(SandboxTerminalError, match=f"cannot enforce {next(iter(setting))}"):
                hook.create()
        monkeypatch.setattr(LocalSandboxHook, "_drops_root", False)
        with pytest.raises(SandboxTerminalError, match="disk_bytes .*only a root worker"):
            LocalSandboxHook(state_root=str(tmp_path / "s"), disk_bytes=1 << 20).create()
        assert not (tmp_path / "s").exists() or os.listdir(tmp_path / "s") == []
        assert _local_cgroups  # the probe itself is covered in test_local_cgroups

    def test_cpu_limit(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), cpu_seconds=1)
        handle = hook.create()
        try:
            started = time.monotonic()
            result = run(hook, handle, "python3 -c 'while True: pass'", timeout=30)
            assert not result.timed_out
            assert result.exit_code != 0
            assert time.monotonic() - started < 15
        finally:
            hook.destroy(handle)

    def test_process_limit_stops_a_fork_bomb(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), max_processes=40)
        handle = hook.create()
        try:
            bomb = (
                "import os, time\n"
                "children = 0\n"
                "for _ in range(200):\n"
                "    try:\n"
                "        pid = os.fork()\n"
                "    except OSError:\n"
                "        break\n"
                "    if pid == 0:\n"
                "        time.sleep(3)\n"
                "        os._exit(0)\n"
                "    children += 1\n"
                "print(children)\n"
            )
            hook.write_file(handle, "bomb.py", bomb.encode())
            result = run(hook, handle, "python3 bomb.py", timeout=60)
            assert 0 < int(result.stdout) < 40, result
        finally:
            hook.destroy(handle)

    def test_default_process_limit_applies(self, hook, sandbox):
        cgroups = hook._cgroups()
        if cgroups is not None and "pids" in cgroups.parents:
            with open(os.path.join(cgroups.parents["pids"], sandbox, "pids.max")) as f:
                assert f.read().strip() == "1024"
        else:
            assert "Max processes             1024" in run(hook, sandbox, "cat /proc/self/limits").stdout

    def test_file_size_limit(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), max_file_bytes=1000)
        handle = hook.create()
        try:
            result = run(hook, handle, "head -c 1000 /dev/zero > ok; head -c 1001 /dev/zero > big; echo $?")
            assert result.stdout.strip() != "0"
            assert run(hook, handle, "wc -c < ok").stdout.strip() == "1000"
        finally:
            hook.destroy(handle)

    @pytest.mark.skipif(os.geteuid() != 0, reason="only a root worker hands sandboxes to another user")
    def test_root_worker_runs_sandboxes_unprivileged(self, hook, sandbox):
        assert run(hook, sandbox, "id -u; touch made-here").stdout.split()[0] == str(hook.uid_of(sandbox))
        made = os.stat(os.path.join(hook.state_root, sandbox, "workspace", "made-here"))
        assert made.st_uid == hook.uid_of(sandbox) >= 1_900_000_000

    def test_bwrap_starts_with_a_fixed_environment(self, hook, sandbox, monkeypatch):
        result = run(hook, sandbox, "tr '\\0' '\\n' < /proc/1/environ")
        assert result.stdout.split() == ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]

    def test_missing_bwrap_names_the_package(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), bwrap_path="bwrap-not-installed")
        with pytest.raises(SandboxTerminalError, match="'bubblewrap' package"):
            hook.create()

    def test_test_connection_runs_a_command(self, hook):
        ok, message = hook.test_connection()
        assert ok, message
        assert message.startswith("The local backend, tested by ") and "provisioned sandbox airflow-sandbox-" in message
        assert os.listdir(hook.state_root) == []


class TestFiles:
    def test_round_trip_and_listing(self, hook, sandbox):
        hook.write_file(sandbox, "dir/sub/data.bin", bytes(range(256)) * 10)
        assert hook.read_file(sandbox, "/workspace/dir/sub/data.bin", max_bytes=4096) == bytes(range(256)) * 10
        hook.write_file(sandbox, "/tmp/x.txt", b"")
        assert hook.read_file(sandbox, "/tmp/x.txt", max_bytes=1) == b""
        assert hook.list_directory(sandbox, "dir") == [("sub", True)]
        assert hook.list_directory(sandbox, "dir/sub") == [("data.bin", False)]

    def test_read_limits_and_errors(self, hook, sandbox):
        hook.write_file(sandbox, "big.txt", b"x" * 1000)
        with pytest.raises(SandboxFileTooLargeError) as info:
            hook.read_file(sandbox, "big.txt", max_bytes=999)
        assert (info.value.size_bytes, info.value.max_bytes) == (1000, 999)
        with pytest.raises(SandboxError, match="does not exist"):
            hook.read_file(sandbox, "nope.txt", max_bytes=10)
        with pytest.raises(SandboxError, match="is a directory"):
            hook.read_file(sandbox, "/workspace", max_bytes=10)
        with pytest.raises(SandboxError, match="not a regular file"):
            hook.read_file(sandbox, "/dev/zero", max_bytes=10)
        with pytest.raises(SandboxError, match="not a directory"):
            hook.list_directory(sandbox, "big.txt")
        run(hook, sandbox, "mkdir adir")
        with pytest.raises(SandboxError, match="Could not finish writing"):
            hook.write_file(sandbox, "adir", b"x")
        assert hook.list_directory(sandbox, "adir") == []

    def test_symlink_escapes_never_touch_host_files(self, hook, sandbox, tmp_path):
        secret_dir = tmp_path / "host"
        secret_dir.mkdir()
        secret = secret_dir / "secret.txt"
        secret.write_text("host secret")
        run(
            hook,
            sandbox,
            f"ln -s {secret} link-file; ln -s {secret_dir} link-dir; ln -s /proc/1/root/{secret} proc-link",
        )
        for link in ("link-file", "link-dir/secret.txt", "proc-link"):
            with pytest.raises(SandboxError):
                hook.read_file(sandbox, link, max_bytes=1000)
            with pytest.raises(SandboxError):
                hook.export_file(sandbox, link, open(os.devnull, "wb"), max_bytes=1000)
        with pytest.raises(SandboxError):
            hook.list_directory(sandbox, "link-dir")
        with pytest.raises(SandboxError):
            hook.write_file(sandbox, "link-dir/new.txt", b"pwned")
        hook.write_file(sandbox, "link-file", b"mine")  # replaces the link itself
        assert hook.read_file(sandbox, "link-file", max_bytes=10) == b"mine"
        assert run(hook, sandbox, "test -L link-file || echo regular").stdout == "regular\n"
        assert secret.read_text() == "host secret"
        assert sorted(os.listdir(secret_dir)) == ["secret.txt"]

    def test_export_streams_and_checks(self, hook, sandbox, tmp_path):
        run(hook, sandbox, "head -c 5000000 /dev/urandom > blob.bin")
        target = tmp_path / "out.bin"
        with open(target, "wb") as f:
            assert hook.export_file(sandbox, "blob.bin", f, max_bytes=10_000_000) == 5_000_000
        expected = run(hook, sandbox, "sha256sum blob.bin").stdout.split()[0]
        import hashlib

        assert hashlib.sha256(target.read_bytes()).hexdigest() == expected
        with pytest.raises(SandboxFileTooLargeError):
            hook.export_file(sandbox, "blob.bin", open(os.devnull, "wb"), max_bytes=4_999_999)


class TestLifetimeAndAttach:
    def test_lifetime_refuses_and_gc_removes(self, tmp_path, time_machine):
        time_machine.move_to("2026-06-01 12:00:00", tick=True)
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"), sandbox_timeout=60)
        handle = hook.create()
        kept = hook.create()
        hook.write_tags(kept, {**hook.read_tags(kept), EXPIRES_AT_TAG: str(int(time.time()) + 7200)})
        result = run(hook, handle, "true", timeout=600)
        assert result.applied_timeout is not None and result.applied_timeout <= 60
        time_machine.move_to("2026-06-01 12:05:00", tick=True)
        with pytest.raises(SandboxTerminalError, match="end of its lifetime"):
            run(hook, handle, "true")
        assert hook.gc_expired().removed == [handle]
        assert os.listdir(hook.state_root) == [kept]
        hook.destroy(kept)

    def test_next_create_sweeps_expired(self, tmp_path):
        hook = LocalSandboxHook(state_root=str(tmp_path / "s"))
        old = hook.create()
        hook.write_tags(old, {**hook.read_tags(old), EXPIRES_AT_TAG: str(int(time.time()) - 1)})
        new = hook.create()
        assert os.listdir(hook.state_root) == [new]
        hook.destroy(new)

    def test_attach_owner_and_holder(self, tmp_path):
        root = str(tmp_path / "s")
        provisioner = LocalSandboxHook(state_root=root)
        handle = provisioner.create(spec=SandboxSpec(owner="dag/run1"))
        provisioner.write_file(handle, "in.txt", b"data")
        other = LocalSandboxHook(state_root=root)  # another task on the same host
        with pytest.raises(SandboxTerminalError, match="not owned by 'dag/run2'"):
            other.attach(handle, owner="dag/run2", holder="dag/run2/t")
        attached = other.attach(handle, owner="dag/run1", holder="dag/run1/agent")
        assert attached.remaining_lifetime and attached.remaining_lifetime > 3500
        assert attached.network == SandboxSpec() and attached.workdir == "/workspace"
        assert other.read_file(handle, "in.txt", max_bytes=10) == b"data"
        assert other.attach(handle, owner="dag/run1", holder="dag/run1/agent").handle == handle  # a retry
        with pytest.raises(SandboxTerminalError, match="held by 'dag/run1/agent'"):
            other.attach(handle, owner="dag/run1", holder="dag/run1/other")
        other.release(handle, holder="dag/run1/other")  # not ours: left alone
        assert other.read_tags(handle)[HOLDER_TAG] == "dag/run1/agent"
        other.release(handle, holder="dag/run1/agent")
        other.release(handle, holder="dag/run1/agent")
        assert HOLDER_TAG not in other.read_tags(handle)
        other.attach(handle, owner="dag/run1", holder="dag/run1/other")
        other.destroy(handle)
        other.destroy(handle)
        with pytest.raises(SandboxTerminalError):
            other.attach(handle, owner="dag/run1", holder="dag/run1/agent")

    def test_concurrent_attach_admits_exactly_one(self, hook):
        from concurrent.futures import ThreadPoolExecutor

        for _ in range(10):
            handle = hook.create(spec=SandboxSpec(owner="d/r"))
            barrier = threading.Barrier(4)

            def claim(holder, barrier=barrier, handle=handle):
                other = LocalSandboxHook(state_root=hook.state_root)
                barrier.wait()
                try:
                    other.attach(handle, owner="d/r", holder=holder)
                    return holder
                except SandboxTerminalError:
                    return None

            with ThreadPoolExecutor(4) as pool:
                winners = [w for w in pool.map(claim, ["d/r/a", "d/r/b", "d/r/c", "d/r/d"]) if w]
            assert len(winners) == 1
            assert hook.read_tags(handle)[HOLDER_TAG] == winners[0]
            hook.destroy(handle)

    def test_unowned_sandbox_refuses_attach(self, hook, sandbox):
        with pytest.raises(SandboxTerminalError, match="carries no owner"):
            hook.attach(sandbox, owner="dag/run", holder="dag/run/t")

    def test_destroy_kills_running_command(self, hook):
        handle = hook.create()
        thread, results = _sleeping_command(hook, handle)
        LocalSandboxHook(state_root=hook.state_root).destroy(handle)  # another task's hook
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert results and results[0].sandbox_terminated

    def test_destroy_kills_running_command_without_cgroups(self, tmp_path, monkeypatch):
        monkeypatch.setattr(LocalSandboxHook, "_cgroups", lambda self: None)
        self.test_destroy_kills_running_command(LocalSandboxHook(state_root=str(tmp_path / "state")))

    @pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "no-cgroup"])
    def test_a_destroy_that_does_not_wait_ends_the_sandbox_before_it_returns(self, tmp_path, monkeypatch, cgroups):
        """
        ``destroy(wait=False)`` (a session's last step): when it returns, nothing of the sandbox runs and
        no caller reaches it; its files and user id go a moment later, in a thread of the worker.
        """
        if not cgroups:
            monkeypatch.setattr(LocalSandboxHook, "_cgroups", lambda self: None)
        hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
        handle = hook.create()
        uid = hook.uid_of(handle)
        thread, results = _sleeping_command(hook, handle)
        if os.geteuid() == 0:
            assert _pids_of_uid(uid)  # the control: its command runs as its own user
        LocalSandboxHook(state_root=hook.state_root).destroy(handle, wait=False)  # another task's hook
        with pytest.raises(SandboxTerminalError):
            hook.read_tags(handle)
        if os.geteuid() == 0:  # everything of it was killed before destroy returned: gone within moments
            deadline = time.monotonic() + 5
            while _pids_of_uid(uid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _pids_of_uid(uid) == []
        thread.join(timeout=20)
        assert results and results[0].sandbox_terminated
        assert wait_for_removals(30)
        assert os.listdir(hook.state_root) == []
        leases = hook._leases()
        assert leases is None or uid not in leases.leases()


class TestConnection:
    def test_extras_give_defaults(self, add_connection, tmp_path):
        add_connection("my_local", "sandbox_local", extra={"state_root": str(tmp_path / "c"), "sandbox_timeout": 120})
        hook = LocalSandboxHook(sandbox_conn_id="my_local")
        handle = hook.create()
        try:
            assert hook.state_root == str(tmp_path / "c")
            left = float(hook.read_tags(handle)[EXPIRES_AT_TAG]) - time.time()
            assert 100 < left <= 121
        finally:
            hook.destroy(handle)

    def test_bad_extra_names_the_connection(self, add_connection):
        add_connection("bad_local", "sandbox_local", extra={"sandbox_timeout": "soon"})
        with pytest.raises(SandboxTerminalError, match="bad_local"):
            LocalSandboxHook(sandbox_conn_id="bad_local").create()

    def test_constructor_checks(self):
        with pytest.raises(ValueError, match="sandbox_timeout"):
            LocalSandboxHook(sandbox_timeout=0)
        with pytest.raises(ValueError, match="memory_bytes"):
            LocalSandboxHook(memory_bytes=-5)
        for bad in ("relative", "/workspace/../tmp", "/usr/work", "/", "/etc"):
            with pytest.raises(ValueError, match="workdir"):
                LocalSandboxHook(workdir=bad)
        assert LocalSandboxHook(workdir="/work/./dir/").workdir == "/work/dir"

    def test_unusable_state_root_is_terminal(self):
        with pytest.raises(SandboxTerminalError, match="state_root"):
            LocalSandboxHook(state_root="/etc/passwd").create()


def _sleeping_command(hook, handle: str) -> tuple[threading.Thread, list]:
    """A command sleeping in the sandbox, in a thread, once it has started; its result goes into the list."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(run(hook, handle, "touch started; sleep 60", timeout=120)))
    thread.start()
    started = os.path.join(hook.state_root, handle, "workspace", "started")
    for _ in range(400):
        if os.path.exists(started):
            break
        time.sleep(0.05)
    return thread, results


def _pids_of_uid(uid: int) -> list[int]:
    """The processes whose real user id is ``uid``, but for zombies (ended, waiting to be reaped)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(pid))
    return found
