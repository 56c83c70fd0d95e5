"""
OpenSandboxHook over the real ``opensandbox`` SDK, with the SDK's HTTP transport replaced by
``FakeOpenSandbox`` (``fake_opensandbox.py``): the lifecycle API, execd's event stream and the egress
sidecar in their wire formats. No server, no network. The real server tier is ``test_opensandbox_server.py``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("opensandbox")

import fake_opensandbox as fake_server

from sandbox_provider.hooks.opensandbox import OpenSandboxBackend, OpenSandboxHook, driver  # noqa: E402
from sandbox_provider.hooks.opensandbox import hook as module  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError  # noqa: E402
from sandbox_provider.sandbox.spec import HOLDER_TAG, NETWORK_TAG, OWNER_TAG, decode_network_policy  # noqa: E402

OPEN = SandboxSpec(block_network=False)
CONN_ID = "opensandbox_test"


@pytest.fixture
def fake():
    server = fake_server.FakeOpenSandbox()
    yield server
    server.release.set()


@pytest.fixture
def conn(add_connection):
    return add_connection(
        CONN_ID, "sandbox_opensandbox", host="os.example.invalid", port=8443, schema="https", password="key-1"
    )


@pytest.fixture
def hook(fake, conn):
    return OpenSandboxHook(conn, transport=fake.transport, image="airflow-sandbox-python:bookworm")


@pytest.fixture
def handle(hook):
    return hook.create(spec=OPEN)


def _run(hook, handle, command="true", **kwargs):
    kwargs.setdefault("timeout", 30)
    kwargs.setdefault("max_output_bytes", 4096)
    return hook.run_command(handle, command, **kwargs)


# -- construction and connection ------------------------------------------------------------------------


def test_constructor_touches_nothing(fake, monkeypatch):
    from airflow.sdk import BaseHook

    def no_lookup(*args, **kwargs):
        raise AssertionError("the constructor looked up a connection")

    monkeypatch.setattr(BaseHook, "get_connection", no_lookup)
    OpenSandboxHook("anything", transport=fake.transport, sandbox_timeout=120, cpu="2")
    assert fake.requests == []
    assert OpenSandboxBackend is OpenSandboxHook


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sandbox_timeout": 30}, "at least 60"),
        ({"cpu": ""}, "cpu must be a non-empty string"),
        ({"use_server_proxy": "yes"}, "use_server_proxy"),
        ({"opensandbox_conn_id": ""}, "opensandbox_conn_id"),
    ],
)
def test_bad_arguments_fail_when_the_hook_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OpenSandboxHook(**kwargs)


def test_the_connection_gives_server_protocol_and_api_key(hook, fake):
    hook.create(spec=OPEN)
    create = next(r for r in fake.requests if r.url.path == "/v1/sandboxes")
    assert str(create.url).startswith("https://os.example.invalid:8443/v1/")
    assert create.headers["open-sandbox-api-key"] == "key-1"
    # Direct mode: the key never travels to the sandbox's own daemon.
    assert all(
        "open-sandbox-api-key" not in r.headers
        for r in fake.requests
        if r.url.host.endswith(".invalid") and "sandbox-" in r.url.host
    )


def test_no_connection_uses_the_sdks_environment(fake, monkeypatch):
    monkeypatch.setenv("OPEN_SANDBOX_DOMAIN", "env-server.invalid:9000")
    monkeypatch.setenv("OPEN_SANDBOX_API_KEY", "env-key")
    OpenSandboxHook(None, transport=fake.transport).create(spec=OPEN)
    assert fake.requests[0].url.host == "env-server.invalid"
    assert fake.requests[0].headers["open-sandbox-api-key"] == "env-key"


def test_connection_problems_are_terminal_and_say_what_to_fix(fake, add_connection):
    add_connection("no_host", "sandbox_opensandbox", password="k")
    with pytest.raises(SandboxTerminalError, match="has no host"):
        OpenSandboxHook("no_host", transport=fake.transport).create(spec=OPEN)
    with pytest.raises(SandboxTerminalError, match="does not exist"):
        OpenSandboxHook("never_defined", transport=fake.transport).create(spec=OPEN)
    add_connection("short", "sandbox_opensandbox", host="h.invalid", extra={"sandbox_timeout": 30})
    with pytest.raises(SandboxTerminalError, match="at least 60"):
        OpenSandboxHook("short", transport=fake.transport).create(spec=OPEN)
    assert fake.requests == []


def test_a_refused_api_key_is_terminal(hook, fake):
    fake.create_error = (401, {"code": "UNAUTHORIZED", "message": "bad key"})
    with pytest.raises(SandboxTerminalError, match="refused the API key"):
        hook.create(spec=OPEN)


# -- the daemon's access token ----------------------------------------------------------------------------


def _execd_requests(fake, handle):
    return [r for r in fake.requests if r.url.host == f"sandbox-{handle}.invalid" and "/proxy/44772/" in r.url.path]


def test_each_sandbox_gets_its_own_token_and_every_daemon_request_carries_it(hook, fake):
    first, second = hook.create(spec=OPEN), hook.create(spec=OPEN)
    hook.write_file(first, "f.txt", b"x")
    _run(hook, first)
    tokens = {handle: fake.sandboxes[handle].token for handle in (first, second)}
    assert tokens[first] and tokens[second] and tokens[first] != tokens[second]
    requests = _execd_requests(fake, first)
    assert {"/proxy/44772/ping", "/proxy/44772/command", "/proxy/44772/files/upload"} <= {r.url.path for r in requests}
    assert all(r.headers[driver.TOKEN_HEADER] == tokens[first] for r in requests)


def test_a_request_without_the_token_is_refused_by_the_fake_as_by_the_daemon(hook, fake, handle):
    """The fake's own check, so the tests above would see a hook that forgot the token."""
    url = f"http://sandbox-{handle}.invalid/proxy/44772/ping"
    with httpx.Client(transport=fake.transport) as client:
        assert client.get(url).status_code == 401
        assert client.get(url, headers={driver.TOKEN_HEADER: fake.sandboxes[handle].token}).status_code == 200


def test_another_worker_reads_the_token_from_the_metadata(fake, conn):
    existing = fake.add(token="t-from-elsewhere")
    later = OpenSandboxHook(conn, transport=fake.transport)
    assert _run(later, existing.id).ok
    assert all(r.headers[driver.TOKEN_HEADER] == "t-from-elsewhere" for r in _execd_requests(fake, existing.id))


def test_a_token_the_daemon_refuses_is_terminal_and_says_why(fake, conn):
    existing = fake.add(token="right")
    existing.metadata[driver.TOKEN_KEY] = "changed"
    with pytest.raises(SandboxTerminalError, match=f"refused the access token .*HTTP 401.*{driver.TOKEN_KEY}"):
        _run(OpenSandboxHook(conn, transport=fake.transport), existing.id)


def test_the_token_variable_cannot_be_set_in_the_spec(hook, fake):
    with pytest.raises(SandboxTerminalError, match="EXECD_ACCESS_TOKEN, which the OpenSandbox backend sets itself"):
        hook.create(spec=SandboxSpec(block_network=False, env={"EXECD_ACCESS_TOKEN": "mine"}))
    assert fake.requests == []


# -- create --------------------------------------------------------------------------------------------


def test_create_sends_lifetime_resources_env_and_label_safe_stamps(hook, fake):
    owner = "dag_run:etl/manual__2024-01-01T00:00:00+00:00 with a long tail " + "x" * 80
    handle = hook.create(spec=SandboxSpec(block_network=False, env={"A": "1"}, owner=owner))
    body = json.loads(next(r for r in fake.requests if r.url.path == "/v1/sandboxes").content)
    assert body["image"] == {"uri": "airflow-sandbox-python:bookworm"}
    assert body["timeout"] == 3600 and body["resourceLimits"] == {"cpu": "1", "memory": "2Gi"}
    token = body["env"].pop(driver.TOKEN_ENV)
    assert body["env"] == {"A": "1"} and len(token) == 48
    assert "networkPolicy" not in body  # an open network starts no egress sidecar
    metadata = body["metadata"]
    assert metadata[driver.TOKEN_KEY] == token
    assert metadata[driver.NAME_KEY].startswith("airflow-sandbox-")
    assert all(len(v) <= 63 and fake_server._LABEL_VALUE.fullmatch(v) for v in metadata.values())
    assert hook.read_tags(handle)[OWNER_TAG] == owner
    assert decode_network_policy(hook.read_tags(handle)[NETWORK_TAG]) == OPEN
    assert "/workspace" in fake.sandboxes[handle].dirs


def test_a_blocked_network_is_accepted_only_when_the_sidecar_reports_dns_nft(hook, fake):
    spec = SandboxSpec(allow_egress_to=["pypi.org"], allow_egress_to_cidrs=["203.0.113.0/24"])
    handle = hook.create(spec=spec)
    body = json.loads(fake.requests[0].content)
    assert body["networkPolicy"] == {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": "pypi.org"}, {"action": "allow", "target": "203.0.113.0/24"}],
    }
    assert "/proxy/18080/policy" in fake.paths("GET")
    assert handle in fake.sandboxes


def test_a_guarded_block_named_on_its_own_is_sent_as_given(hook, fake):
    """The positive control of the catch-all refusals below: naming the block itself passes."""
    cidrs = ["169.254.169.254/32", "127.0.0.0/8", "::ffff:127.0.0.0/104", "198.51.100.0/24"]
    hook.create(spec=SandboxSpec(allow_egress_to_cidrs=cidrs))
    sent = json.loads(fake.requests[0].content)["networkPolicy"]["egress"]
    assert [rule["target"] for rule in sent] == cidrs


@pytest.mark.parametrize(
    ("mode", "reported", "found"),
    [
        ("dns", None, "enforcement mode 'dns'"),
        ("dns+nft", {"defaultAction": "allow"}, "default action 'allow'"),
        ("dns+nft", {"defaultAction": "deny", "egress": [{"action": "allow", "target": "evil.example"}]}, "rules"),
    ],
    ids=["dns-mode", "allow-default", "other-rules"],
)
def test_an_unproven_policy_destroys_the_sandbox_and_says_what_to_change(hook, fake, mode, reported, found):
    fake.egress_mode, fake.reported_policy = mode, reported
    with pytest.raises(SandboxTerminalError, match=found) as err:
        hook.create()
    assert 'mode = "dns+nft"' in str(err.value) and "block_network=False" in str(err.value)
    assert fake.sandboxes == {}
    assert "DELETE" in [r.method for r in fake.requests]


def test_a_server_that_cannot_start_the_sidecar_says_so(hook, fake):
    fake.create_error = (500, {"code": "DOCKER::SANDBOX_IMAGE_PULL_FAILED", "message": "Failed to pull image egress"})
    with pytest.raises(SandboxTerminalError, match="needs the server's egress sidecar"):
        hook.create()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SandboxSpec(allow_egress_to=["https://pypi.org/simple"]), "is not a hostname"),
        (SandboxSpec(allow_egress_to=["203.0.113.9"]), "is not a hostname"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.7/24"]), "is not an address range"),
        (SandboxSpec(allow_egress_to_cidrs=["not-a-range"]), "is not an address range"),
        # A catch-all would open the server host's metadata address (and loopback, unspecified) too,
        # which the sidecar cannot carve out; each IPv4 block also counts in its mapped and NAT64 forms.
        (SandboxSpec(allow_egress_to_cidrs=["0.0.0.0/0"]), r"covers 127\.0\.0\.0/8 \(loopback\) without naming"),
        (SandboxSpec(allow_egress_to_cidrs=["128.0.0.0/1"]), r"covers 169\.254\.0\.0/16 \(link-local"),
        (SandboxSpec(allow_egress_to_cidrs=["::/0"]), r"covers ::1/128 \(loopback\)"),
        (SandboxSpec(allow_egress_to_cidrs=["::ffff:0:0/96"]), r"covers 127\.0\.0\.0/8"),
        (SandboxSpec(allow_egress_to_cidrs=["64:ff9b::/96"]), r"covers 127\.0\.0\.0/8"),
        (SandboxSpec(allow_egress_to_cidrs=["fd00::/8"]), r"covers fd00:ec2::254/128 \(a cloud metadata address\)"),
        (SandboxSpec(block_network=False, env={"BIG": "x" * 200_000}), "more than the OpenSandbox backend can pass"),
    ],
)
def test_refusals_happen_before_any_request(hook, fake, spec, message):
    with pytest.raises(SandboxTerminalError, match=message):
        hook.create(spec=spec)
    assert fake.requests == []


# -- commands: the exit-code matrix ---------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3, 124])
def test_exit_codes_pass_through(hook, fake, handle, code):
    fake.on_command(lambda command, body: [fake_server.stdout("hi"), fake_server.exits(code)])
    result = _run(hook, handle)
    assert (result.exit_code, result.timed_out, result.stdout) == (code, False, "hi\n")


def test_the_wire_carries_sh_the_workdir_and_the_timeout_in_milliseconds(hook, fake, handle):
    _run(hook, handle, "echo 'a b' | wc -c", timeout=2.5)
    body = fake.commands[-1]
    assert body["command"] == "sh -c 'echo '\"'\"'a b'\"'\"' | wc -c'"
    assert body["timeout"] == 2500 and body["cwd"] == "/workspace"


def test_minus_one_at_the_deadline_is_a_timeout_and_keeps_the_sandbox(hook, fake, handle):
    def late(command, body):
        time.sleep(body["timeout"] / 1000 + 0.05)
        return [fake_server.failed("-1", "signal: killed")]

    fake.on_command(late)
    result = _run(hook, handle, "sleep 60", timeout=0.2)
    assert result.timed_out and not result.sandbox_terminated and result.applied_timeout == 0.2
    assert handle in fake.sandboxes and "DELETE" not in [r.method for r in fake.requests if "/v1/" in r.url.path]


@pytest.mark.parametrize(("trace", "code"), [("signal: killed", 137), ("signal: terminated", 143)])
def test_minus_one_before_the_deadline_is_a_signal_death(hook, fake, handle, trace, code):
    fake.on_command(lambda command, body: [fake_server.failed("-1", trace)])
    result = _run(hook, handle, "kill -9 $$", timeout=30)
    assert (result.exit_code, result.timed_out) == (code, False)


def test_a_command_that_could_not_start_exits_1_with_the_reason(hook, fake, handle):
    fake.on_command(lambda command, body: [fake_server.failed("fork/exec: no such file", "fork/exec: no such file")])
    result = _run(hook, handle)
    assert result.exit_code == 1 and "no such file" in result.stderr


def test_output_streams_with_newlines_and_keeps_bounded_tails(hook, fake, handle):
    lines = [fake_server.stdout(f"line {n}") for n in range(2000)]
    fake.on_command(lambda command, body: [*lines, fake_server.stderr("oops"), fake_server.complete()])
    seen = []
    result = _run(hook, handle, max_output_bytes=100, on_output=lambda stream, data: seen.append((stream, data)))
    assert seen[0] == ("stdout", b"line 0\n") and ("stderr", b"oops\n") in seen
    assert len(result.stdout.encode()) <= 100 and result.stdout_truncated and result.stdout.endswith("line 1999\n")


def test_output_is_byte_for_byte_from_the_spool_and_the_spool_is_removed(hook, fake, handle):
    """Blank lines, CRLF, lone CRs and an unended last line: the live stream has the lines, the result the bytes."""
    data = b"x\n\ny\r\nz"
    fake.on_command(
        lambda command, body: [
            fake_server.printed("stdout", data),
            fake_server.printed("stderr", b"e\r"),
            fake_server.complete(),
        ]
    )
    seen = []
    result = _run(hook, handle, on_output=lambda stream, chunk: seen.append((stream, chunk)))
    assert (result.stdout, result.stderr) == ("x\n\ny\r\nz", "e\r")
    assert (result.stdout_totals.bytes, result.stdout_totals.lines) == (len(data), 4)
    assert b"".join(chunk for stream, chunk in seen if stream == "stdout") == b"x\n\ny\nz\n"  # the events' lines
    assert not [path for path in fake.sandboxes[handle].files if path.startswith("/tmp/")]


def test_the_spool_gives_the_exact_tail_of_a_long_output(hook, fake, handle):
    data = b"".join(b"line %d\r\n" % n for n in range(3000)) + b"end"
    fake.on_command(lambda command, body: [fake_server.printed("stdout", data), fake_server.complete()])
    result = _run(hook, handle, max_output_bytes=50)
    assert result.stdout.encode() == data[-50:] and result.stdout_truncated
    assert (result.stdout_totals.bytes, result.stdout_totals.lines) == (len(data), 3001)
    assert result.stdout_totals.tail_at_line_start is (data[-51:-50] == b"\n")
    download = [r for r in fake.requests if r.url.path.endswith("/files/download")][-1]
    assert download.headers["range"] == f"bytes={len(data) - 51}-{len(data) - 1}"


def test_without_spool_files_the_lines_stand(hook, fake, handle):
    """A daemon that removes its output files itself: blank lines still exact, what ended each line lost."""
    fake.spool = False
    fake.on_command(lambda command, body: [fake_server.printed("stdout", b"a\n\nb\r\nc"), fake_server.complete()])
    assert _run(hook, handle).stdout == "a\n\nb\nc\n"
    assert not any(r.url.path.endswith("/files/download") for r in fake.requests)


def test_a_signal_death_just_before_the_deadline_is_not_taken_for_the_timeout(hook, fake, handle):
    """execd waits after each command; its own clock, not the worker's, says when the command ended."""

    def dies_then_waits(command, body):
        yield fake_server.failed("-1", "signal: killed")
        time.sleep(body["timeout"] / 1000 + 0.1)  # the daemon's wait after the command, past the deadline

    fake.on_command(dies_then_waits)
    result = _run(hook, handle, "kill -9 $$", timeout=0.5)
    assert (result.exit_code, result.timed_out) == (137, False)


# -- commands: lost sandboxes, reconnects and stalls ---------------------------------------------------------


def test_a_sandbox_gone_before_the_command_is_terminal(hook, fake, handle):
    del fake.sandboxes[handle]
    with pytest.raises(SandboxTerminalError, match="ended while the command ran|does not exist"):
        _run(hook, handle)


def test_a_container_lost_mid_command_is_terminal_and_says_so(hook, fake, handle):
    def lost(command, body):
        yield fake_server.stdout("started")
        del fake.sandboxes[handle]
        yield httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    fake.on_command(lost)
    with pytest.raises(SandboxTerminalError, match="ended while the command ran"):
        _run(hook, handle)


def test_a_broken_stream_while_the_sandbox_lives_is_retryable(hook, fake, handle):
    fake.on_command(
        lambda command, body: [fake_server.stdout("a"), httpx.RemoteProtocolError("incomplete chunked read")]
    )
    with pytest.raises(SandboxError, match="still runs") as err:
        _run(hook, handle)
    assert not isinstance(err.value, SandboxTerminalError)
    fake.on_command(lambda command, body: [fake_server.complete()])
    assert _run(hook, handle).ok  # reconnected


def test_reconnect_by_id_is_not_charged_to_the_command(fake, conn):
    existing = fake.add()
    fake.ping_delay = 0.3
    later = OpenSandboxHook(conn, transport=fake.transport)
    result = _run(later, existing.id, timeout=0.5)
    assert result.ok and result.applied_timeout == 0.5
    assert fake.commands[-1]["timeout"] == 500
    paths = fake.paths()
    assert paths.index("/proxy/44772/ping") < paths.index("/proxy/44772/command")


def test_a_stalled_stream_destroys_the_sandbox(hook, fake, handle, monkeypatch):
    monkeypatch.setattr(module, "STREAM_GRACE", 0.2)
    fake.on_command(lambda command, body: [fake_server.stdout("working"), "stall"])
    result = _run(hook, handle, timeout=0.3)
    assert result.timed_out and result.sandbox_terminated and result.stdout == "working\n"
    assert handle not in fake.sandboxes


# -- destroy and files -----------------------------------------------------------------------------------


def test_destroy_is_idempotent_and_other_failures_are_terminal(hook, fake, handle):
    hook.destroy(handle)
    hook.destroy(handle)  # the server answers 404: already gone
    other = hook.create(spec=OPEN)
    fake.create_error = None
    original = fake._lifecycle

    def failing(request, path):
        if request.method == "DELETE":
            return httpx.Response(500, json={"code": "DOCKER::ERROR", "message": "engine down"})
        return original(request, path)

    fake._lifecycle = failing
    with pytest.raises(SandboxTerminalError, match="engine down"):
        hook.destroy(other)


def test_files_round_trip_with_a_size_check_before_the_ranged_download(hook, fake, handle):
    hook.write_file(handle, "d/a.bin", b"0123456789")
    assert fake.sandboxes[handle].files["/workspace/d/a.bin"] == b"0123456789"
    assert hook.read_file(handle, "d/a.bin", max_bytes=10) == b"0123456789"
    download = [r for r in fake.requests if r.url.path.endswith("/files/download")][-1]
    assert download.headers["range"] == "bytes=0-10"
    before = len(fake.requests)
    with pytest.raises(SandboxFileTooLargeError) as err:
        hook.read_file(handle, "d/a.bin", max_bytes=9)
    assert (err.value.size_bytes, err.value.max_bytes) == (10, 9)
    assert not any(r.url.path.endswith("/files/download") for r in fake.requests[before:])


def test_file_errors_and_listing(hook, fake, handle):
    with pytest.raises(SandboxError, match="does not exist"):
        hook.read_file(handle, "missing", max_bytes=10)
    fake.sandboxes[handle].dirs.add("/workspace/sub")
    with pytest.raises(SandboxError, match="is a directory"):
        hook.read_file(handle, "sub", max_bytes=10)
    hook.write_file(handle, "b.txt", b"b")
    assert hook.list_directory(handle) == [("b.txt", False), ("sub", True)]
    with pytest.raises(SandboxError, match="not a directory"):
        hook.list_directory(handle, "nowhere")
    assert hook.read_file(handle, "/workspace/b.txt", max_bytes=1) == b"b"
    hook.write_file(handle, "empty", b"")
    assert hook.read_file(handle, "empty", max_bytes=5) == b""


# -- attach ----------------------------------------------------------------------------------------------


def test_attach_claims_through_metadata_and_release_clears_it(hook, fake, conn):
    handle = hook.create(spec=SandboxSpec(block_network=False, owner="dag_run:d/r1"))
    later = OpenSandboxHook(conn, transport=fake.transport)
    attached = later.attach(handle, owner="dag_run:d/r1", holder="d/r1/collect")
    assert attached.tags[HOLDER_TAG] == "d/r1/collect" and attached.network == OPEN
    assert attached.remaining_lifetime is not None and 3500 < attached.remaining_lifetime <= 3600
    with pytest.raises(SandboxTerminalError, match="is held by"):
        OpenSandboxHook(conn, transport=fake.transport).attach(handle, owner="dag_run:d/r1", holder="d/r1/other")
    with pytest.raises(SandboxTerminalError, match="not owned by"):
        later.attach(handle, owner="dag_run:d/r2", holder="d/r2/t")
    later.release(handle, holder="d/r1/collect")
    assert HOLDER_TAG not in later.read_tags(handle)
    assert not any(key.startswith(HOLDER_TAG) for key in fake.sandboxes[handle].metadata)


def test_stamps_survive_any_text_as_label_values():
    stamps = {OWNER_TAG: "ünïcode / spaces : + = ", HOLDER_TAG: "", "airflow_x": "y" * 500}
    metadata = driver.encode_stamps(stamps)
    assert all(len(v) <= 63 and fake_server._LABEL_VALUE.fullmatch(v) for v in metadata.values())
    assert all(len(k) <= 63 and fake_server._LABEL_NAME.fullmatch(k) for k in metadata)
    assert driver.decode_stamps({**metadata, "unrelated": "kept-out"}) == stamps
    patch = driver.stamps_patch(metadata, {OWNER_TAG: "short"})
    assert patch[f"{OWNER_TAG}.0"] == driver.encode_stamps({OWNER_TAG: "short"})[f"{OWNER_TAG}.0"]
    assert patch["airflow_x.7"] is None and "unrelated" not in patch


def test_the_toolset_says_what_each_network_mode_lets_through(hook):
    from sandbox_provider.toolsets import SandboxToolset

    cases = {
        OPEN: "no egress policy",
        SandboxSpec(): "drops every connection and resolves no name",
        SandboxSpec(allow_egress_to=["pypi.org"], allow_egress_to_cidrs=["203.0.113.0/24"]): (
            "pypi.org (DNS answers only these names; their addresses, any port) and the address ranges "
            "203.0.113.0/24 (any port)"
        ),
    }
    for spec, words in cases.items():
        assert words in SandboxToolset(hook, spec=spec)._run_command_description()
