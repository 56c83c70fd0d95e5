"""
OpenShellSandboxHook with the real ``openshell`` SDK against the in-process gateway double, whose
commands really run (bubblewrap): lifecycle, the policy readback around every command, gRPC
failures, binary-safe files, refusals before create, sweeping and the connection.
"""

from __future__ import annotations

import io
import json
import time

import grpc
import pytest

from conftest import requires_bwrap

pytest.importorskip("openshell")

from openshell._proto import openshell_pb2, sandbox_pb2  # noqa: E402
from openshell_gateway import FakeGateway, NoExit, Stall, Unavailable  # noqa: E402

from sandbox_provider.hooks.openshell import OpenShellSandboxBackend, OpenShellSandboxHook  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError  # noqa: E402

pytestmark = requires_bwrap

CONN = "openshell_test"


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch):
    monkeypatch.setattr(OpenShellSandboxHook, "poll_interval", 0.01)


@pytest.fixture
def gateway(tmp_path):
    gateway = FakeGateway(tmp_path / "gateway").start()
    yield gateway
    gateway.stop()


@pytest.fixture
def connection(gateway, add_connection):
    host, port = gateway.endpoint.split(":")
    return add_connection(CONN, "sandbox_openshell", host=host, port=int(port), extra={"ready_timeout": 20})


@pytest.fixture
def hook(connection):
    hook = OpenShellSandboxHook(connection, relay_grace=1.0, request_timeout=10.0)
    yield hook
    hook.close()


@pytest.fixture
def sandbox(hook):
    handle = hook.create(spec=SandboxSpec())
    yield handle
    hook.destroy(handle)


def run(hook, handle, command, timeout=30, **kwargs):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=1 << 20, **kwargs)


def created(gateway):
    return [request for rpc, request in gateway.calls if rpc == "CreateSandbox"]


class TestLifecycle:
    def test_alias(self):
        assert OpenShellSandboxBackend is OpenShellSandboxHook

    def test_constructor_touches_no_connection(self, monkeypatch):
        def boom(*args, **kwargs):
            raise AssertionError("the constructor read a connection")

        monkeypatch.setattr(OpenShellSandboxHook, "get_connection", boom)
        OpenShellSandboxHook("no_such_connection", image="img:1")

    def test_bad_arguments_fail_at_construction(self):
        with pytest.raises(ValueError, match="relay_grace"):
            OpenShellSandboxHook(relay_grace=0)
        with pytest.raises(ValueError, match="openshell_conn_id"):
            OpenShellSandboxHook("")

    def test_create_names_labels_and_deny_all_policy(self, hook, gateway):
        handle = hook.create(spec=SandboxSpec(env={"GREETING": "hello there"}))
        try:
            assert hook.handle_pattern.fullmatch(handle) and len(handle) <= 19
            (request,) = created(gateway)
            assert request.workspace_scope.workspace == "default"
            assert request.labels["managed-by"] == "airflow-sandbox"
            assert float(request.labels["airflow-expires-at"]) > time.time() + 3000
            policy = request.spec.policy
            assert not policy.network_policies and policy.landlock.compatibility == "hard_requirement"
            assert dict(request.spec.environment) == {"GREETING": "hello there"}
            assert request.spec.template.image == "python:3.12-slim"
            result = run(hook, handle, 'echo "$GREETING from $(pwd)"; echo err >&2; exit 3')
            assert (result.exit_code, result.stdout, result.stderr) == (3, "hello there from /sandbox\n", "err\n")
            assert not result.timed_out and not result.sandbox_terminated
        finally:
            hook.destroy(handle)
        assert gateway.sandboxes == {}
        hook.destroy(handle)  # gone is fine

    def test_hostnames_become_port_443_rules_and_pass_the_readback(self, hook, gateway):
        handle = hook.create(spec=SandboxSpec(allow_egress_to=["PyPI.org.", "files.pythonhosted.org", "pypi.org"]))
        try:
            rule = created(gateway)[0].spec.policy.network_policies["airflow-egress"]
            assert [(e.host, e.port) for e in rule.endpoints] == [("pypi.org", 443), ("files.pythonhosted.org", 443)]
            assert [b.path for b in rule.binaries] == ["/**"]
            assert run(hook, handle, "echo ok").stdout == "ok\n"
        finally:
            hook.destroy(handle)

    def test_timeout_kills_the_whole_session_and_keeps_the_sandbox(self, hook, gateway, sandbox):
        run(hook, sandbox, "echo kept > note")
        result = run(hook, sandbox, "sleep 300 & echo started; sleep 300", timeout=0.5)
        assert result.timed_out and not result.sandbox_terminated
        assert result.stdout == "started\n"
        assert gateway.processes_of(gateway.sandbox(sandbox)) == []
        assert run(hook, sandbox, "cat note").stdout == "kept\n"

    def test_a_command_exiting_124_by_itself_is_not_a_timeout(self, hook, sandbox):
        result = run(hook, sandbox, "exit 124")
        assert result.exit_code == 124 and not result.timed_out

    def test_output_streams_live(self, hook, sandbox):
        seen = []
        run(hook, sandbox, "echo one; sleep 0.2; echo two >&2", on_output=lambda s, b: seen.append((s, b)))
        assert seen == [("stdout", b"one\n"), ("stderr", b"two\n")]

    def test_a_flood_keeps_only_the_tail(self, hook, sandbox):
        result = hook.run_command(
            sandbox, "head -c 5000000 /dev/zero | tr '\\0' x; echo end", timeout=60, max_output_bytes=1000
        )
        assert result.stdout_truncated and result.stdout.endswith("xend\n") and len(result.stdout) <= 1000

    def test_not_ready_at_first_is_waited_for_and_retried(self, hook, gateway, sandbox):
        gateway.fail_next("ExecSandbox", grpc.StatusCode.FAILED_PRECONDITION, "not ready")
        assert run(hook, sandbox, "echo ok").stdout == "ok\n"

    def test_transient_errors_while_waiting_for_ready_are_ridden_out(self, hook, gateway):
        gateway.ready_after = 3
        gateway.fail_next("GetSandbox", grpc.StatusCode.UNAVAILABLE, times=2)
        handle = hook.create(spec=SandboxSpec())
        hook.destroy(handle)

    def test_an_error_phase_fails_create_and_deletes(self, hook, gateway):
        gateway.on_create.append(lambda s: setattr(s, "phase", openshell_pb2.SANDBOX_PHASE_ERROR))
        with pytest.raises(SandboxTerminalError, match="phase ERROR"):
            hook.create(spec=SandboxSpec())
        assert gateway.sandboxes == {}


class TestPolicyReadback:
    @pytest.mark.parametrize(
        ("change", "says"),
        [
            (lambda c: setattr(c, "policy_source", sandbox_pb2.POLICY_SOURCE_GLOBAL), "gateway-wide"),
            (lambda c: setattr(c, "configuration_admitted", False), "not admitted"),
            (lambda c: setattr(c.policy.landlock, "compatibility", "best_effort"), "best_effort"),
            (lambda c: c.policy.network_policies["extra"].endpoints.add(host="evil.example", port=443), "evil"),
        ],
    )
    def test_a_different_policy_at_create_destroys_and_fails(self, hook, gateway, change, says):
        gateway.on_create.append(lambda sandbox: change(sandbox.config))
        with pytest.raises(SandboxTerminalError, match=says) as caught:
            hook.create(spec=SandboxSpec())
        assert "destroyed" in str(caught.value)
        assert gateway.sandboxes == {}
        assert not [r for rpc, r in gateway.calls if rpc == "ExecSandbox"]

    def test_drift_between_commands_is_caught_before_the_next_one_runs(self, hook, gateway, sandbox):
        assert run(hook, sandbox, "echo first").ok
        gateway.drift(sandbox, lambda c: c.policy.network_policies["x"].endpoints.add(host="a.example", port=80))
        execs = len(gateway.sandbox(sandbox).execs)
        with pytest.raises(SandboxTerminalError, match="a.example:80"):
            run(hook, sandbox, "echo second")
        assert gateway.sandboxes == {}
        assert execs == 1

    def test_drift_while_a_command_runs_is_caught_after_it(self, hook, gateway, sandbox):
        def widen(fake):
            gateway.drift(
                fake.name, lambda c: c.policy.network_middlewares["m"].CopyFrom(sandbox_pb2.NetworkMiddlewareConfig())
            )

        gateway.on_exec.append(widen)
        with pytest.raises(SandboxTerminalError, match="after a command.*middlewares"):
            run(hook, sandbox, "echo hi")
        assert gateway.sandboxes == {}

    def test_an_unreachable_readback_runs_nothing_and_can_be_retried(self, hook, gateway, sandbox):
        gateway.fail_next("GetSandboxConfig", grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(SandboxError, match="nothing was run") as caught:
            run(hook, sandbox, "echo hi")
        assert not isinstance(caught.value, SandboxTerminalError)
        assert run(hook, sandbox, "echo hi").stdout == "hi\n"

    def test_a_second_hook_object_checks_against_the_sandboxs_own_spec(self, connection, gateway):
        first = OpenShellSandboxHook(connection)
        handle = first.create(spec=SandboxSpec(allow_egress_to=["pypi.org"]))
        try:
            second = OpenShellSandboxHook(connection)
            assert run(second, handle, "echo ok").stdout == "ok\n"
            gateway.drift(
                handle, lambda c: c.policy.network_policies["airflow-egress"].endpoints.add(host="b.example", port=443)
            )
            with pytest.raises(SandboxTerminalError, match="b.example"):
                run(second, handle, "echo no")
        finally:
            first.destroy(handle)


class TestGatewayFailures:
    def test_a_gateway_that_stops_relaying_ends_the_sandbox(self, hook, gateway, sandbox):
        gateway.exec_faults.append(Stall(after=1))
        result = run(hook, sandbox, "echo partial; sleep 300", timeout=0.5)
        assert result.timed_out and result.sandbox_terminated
        assert result.stdout == "partial\n"
        assert gateway.sandboxes == {}

    def test_unavailable_mid_stream_may_or_may_not_have_run(self, hook, gateway, sandbox):
        gateway.exec_faults.append(Unavailable(after=1))
        with pytest.raises(SandboxError, match="may or may not have run") as caught:
            run(hook, sandbox, "echo a; sleep 0.3; echo b")
        assert not isinstance(caught.value, SandboxTerminalError)
        assert run(hook, sandbox, "echo still here").stdout == "still here\n"

    def test_a_stream_without_exit_status(self, hook, gateway, sandbox):
        gateway.exec_faults.append(NoExit())
        with pytest.raises(SandboxError, match="may or may not have run"):
            run(hook, sandbox, "echo a")

    def test_a_vanished_sandbox_is_gone(self, hook, gateway, sandbox):
        gateway.vanish(sandbox)
        with pytest.raises(SandboxTerminalError, match="gone"):
            run(hook, sandbox, "echo a")

    def test_create_failure_is_terminal(self, hook, gateway):
        gateway.fail_next("CreateSandbox", grpc.StatusCode.INTERNAL, "driver exploded")
        with pytest.raises(SandboxTerminalError, match="driver exploded"):
            hook.create(spec=SandboxSpec())


class TestFiles:
    def test_binary_round_trip_is_exact(self, hook, sandbox):
        data = bytes(range(256)) * 9000  # 2.3 MB: several 768 KiB pieces
        hook.write_file(sandbox, "dir/blob.bin", data)
        assert hook.read_file(sandbox, "dir/blob.bin", max_bytes=len(data)) == data
        out = io.BytesIO()
        assert hook.export_file(sandbox, "/sandbox/dir/blob.bin", out, max_bytes=len(data)) == len(data)
        assert out.getvalue() == data
        assert run(hook, sandbox, "ls -a dir").stdout.split() == [".", "..", "blob.bin"]

    def test_read_limits_and_errors(self, hook, sandbox):
        hook.write_file(sandbox, "f", b"x" * 100)
        with pytest.raises(SandboxFileTooLargeError):
            hook.read_file(sandbox, "f", max_bytes=99)
        with pytest.raises(SandboxError, match="does not exist"):
            hook.read_file(sandbox, "missing", max_bytes=10)
        with pytest.raises(SandboxError, match="directory"):
            hook.read_file(sandbox, "/sandbox", max_bytes=10)

    def test_list_directory(self, hook, sandbox):
        hook.write_file(sandbox, "a/b", b"1")
        hook.write_file(sandbox, "c", b"2")
        assert hook.list_directory(sandbox, ".") == [("a", True), ("c", False)]


class TestRefusedBeforeCreate:
    @pytest.mark.parametrize(
        ("spec", "says"),
        [
            (SandboxSpec(block_network=False), "cannot enforce an open network"),
            (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "address ranges"),
            (SandboxSpec(owner="dag/run"), "owner"),
            (SandboxSpec(allow_egress_to=["https://pypi.org/simple"]), "not a hostname"),
            (SandboxSpec(allow_egress_to=["10.0.0.1"]), "not a hostname"),
            (SandboxSpec(env={"HTTPS_PROXY": "http://x"}), "supervisor"),
            (SandboxSpec(env={"OPENSHELL_TOKEN": "t"}), "supervisor"),
        ],
    )
    def test_refusal_names_what_to_change(self, hook, gateway, spec, says):
        with pytest.raises(SandboxTerminalError, match=says) as caught:
            hook.create(spec=spec)
        assert any(word in str(caught.value) for word in ("Keep", "Give", "Rename", "Drop"))
        assert created(gateway) == []


class TestSweep:
    def test_list_and_remove_expired(self, hook, gateway):
        first = hook.create(spec=SandboxSpec())
        second = hook.create(spec=SandboxSpec())
        listed = {info.handle: info for info in hook.list_sandboxes()}
        assert set(listed) == {first, second}
        assert all(info.phase == "READY" and not info.expired() for info in listed.values())
        assert hook.remove_expired() == []
        assert sorted(hook.remove_expired(now=time.time() + 7200)) == sorted([first, second])
        assert gateway.sandboxes == {}


class TestConnection:
    def test_bearer_token_from_the_connection(self, tmp_path, add_connection):
        gateway = FakeGateway(tmp_path / "gw", token="s3cret").start()
        try:
            host, port = gateway.endpoint.split(":")
            good = add_connection("os_good", "sandbox_openshell", host=host, port=int(port), password="s3cret")
            bad = add_connection("os_bad", "sandbox_openshell", host=f"http://{host}:{port}", password="wrong")
            handle = OpenShellSandboxHook(good).create(spec=SandboxSpec())
            OpenShellSandboxHook(good).destroy(handle)
            with pytest.raises(SandboxTerminalError, match="refused the credentials"):
                OpenShellSandboxHook(bad).create(spec=SandboxSpec())
        finally:
            gateway.stop()

    def test_tls_with_the_connections_ca_file(self, tmp_path, add_connection):
        key, cert = _self_signed_for_loopback()
        (tmp_path / "ca.pem").write_bytes(cert)
        gateway = FakeGateway(tmp_path / "gw").start(tls=(key, cert))
        try:
            port = int(gateway.endpoint.split(":")[1])
            extra = {"tls_ca_cert": str(tmp_path / "ca.pem")}
            conn = add_connection("os_tls", "sandbox_openshell", host="127.0.0.1", port=port, extra=extra)
            hook = OpenShellSandboxHook(conn)
            handle = hook.create(spec=SandboxSpec())
            assert run(hook, handle, "echo over tls").stdout == "over tls\n"
            hook.destroy(handle)
            plain = add_connection(
                "os_plain", "sandbox_openshell", host="127.0.0.1", port=port, extra={"ready_timeout": 2}
            )
            with pytest.raises(SandboxTerminalError):
                OpenShellSandboxHook(plain, request_timeout=2.0).create(spec=SandboxSpec())
            missing = add_connection(
                "os_missing", "sandbox_openshell", host="127.0.0.1", extra={"tls_ca_cert": "/nope.pem"}
            )
            with pytest.raises(SandboxTerminalError, match="do not exist on this worker"):
                OpenShellSandboxHook(missing).create(spec=SandboxSpec())
        finally:
            gateway.stop()

    def test_without_a_connection_the_cli_registration_is_used(self, gateway, tmp_path, monkeypatch):
        registry = tmp_path / "xdg" / "openshell"
        (registry / "gateways" / "local").mkdir(parents=True)
        (registry / "gateways" / "local" / "metadata.json").write_text(
            json.dumps({"gateway_endpoint": f"http://{gateway.endpoint}"})
        )
        (registry / "active_gateway").write_text("local\n")
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
        monkeypatch.delenv("OPENSHELL_GATEWAY", raising=False)
        hook = OpenShellSandboxHook()
        handle = hook.create(spec=SandboxSpec())
        assert run(hook, handle, "echo via cli").stdout == "via cli\n"
        hook.destroy(handle)

    def test_no_gateway_at_all_says_what_to_do(self, tmp_path, monkeypatch):
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "empty"))
        monkeypatch.delenv("OPENSHELL_GATEWAY", raising=False)
        with pytest.raises(SandboxTerminalError, match="register a gateway"):
            OpenShellSandboxHook().create(spec=SandboxSpec())

    def test_a_missing_named_connection(self):
        with pytest.raises(SandboxTerminalError, match="does not exist"):
            OpenShellSandboxHook("not_defined").create(spec=SandboxSpec())

    def test_a_bad_extra_names_the_connection(self, add_connection):
        conn = add_connection(
            "os_bad_extra", "sandbox_openshell", host="127.0.0.1", port=1, extra={"ready_timeout": "soon"}
        )
        with pytest.raises(SandboxTerminalError, match="os_bad_extra"):
            OpenShellSandboxHook(conn).create(spec=SandboxSpec())


def test_the_toolset_note_names_port_443_for_a_host_list():
    hook = OpenShellSandboxHook()
    note = hook.describe_network(SandboxSpec(allow_egress_to=["PyPI.org"]))
    assert "only pypi.org" in note and "port 443" in note
    offline = hook.describe_network(SandboxSpec())
    assert "no network access" in offline and "DNS" not in offline


def _self_signed_for_loopback() -> tuple[bytes, bytes]:
    """A key and a self-signed certificate for 127.0.0.1, PEM."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-openshell-gateway")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem_key, cert.public_bytes(serialization.Encoding.PEM)


def test_close_releases_the_channel_and_a_later_call_opens_another(hook, sandbox):
    first = hook.get_conn()
    hook.close()
    assert hook.get_conn() is not first
    assert run(hook, sandbox, "echo again").stdout == "again\n"
