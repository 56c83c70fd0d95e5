"""
Hostname and address allowlists on the local backend, through the egress gateway, against servers
this module starts on loopback addresses (the gateway is given pins from the test names to them).
Positive controls first (the listed name is reached), then every refusal.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time

import egress_servers
import pytest
from egress_servers import LISTED, UNLISTED, WHEEL_VALUE, assert_battery, egress_world, run, tls_env

from conftest import requires_bwrap
from sandbox_provider.hooks import egress
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local import state as _local_state
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.errors import SandboxTerminalError

pytestmark = [
    requires_bwrap,
    pytest.mark.skipif(
        bool(egress.missing_tools()) and not os.environ.get("SANDBOX_REQUIRE_BWRAP"),
        reason="the egress gateway needs proxy.py and socat on the worker",
    ),
]


@pytest.fixture(scope="module")
def world():
    with egress_world() as made:
        yield made


@pytest.fixture
def make_hook(tmp_path, world):
    made = []

    def make(**settings):
        settings.setdefault("egress_pins", world.pins)
        settings.setdefault("egress_ports", world.ports)
        hook = LocalSandboxHook(state_root=str(tmp_path / "state"), uid_lease_dir=str(tmp_path / "ids"), **settings)
        made.append(hook)
        return hook

    yield make
    for hook in made[:1]:
        for kind, handle, _ in _local_state.classify(hook.state_root):
            if kind == "sandbox":
                hook.destroy(handle)


def gateway_dir(hook, handle):
    return egress.local_gateway_dir(os.path.join(hook.state_root, handle))


def test_listed_hosts_and_ranges_pass_and_nothing_else(make_hook, world):
    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(env=tls_env(), **world.spec_lists))
    assert_battery(hook, handle, world)
    # curl, through the same variables: reached, then refused.
    curl = run(hook, handle, f"curl -sS {shlex.quote(world.url(LISTED))}; curl -sS {shlex.quote(world.url(UNLISTED))}")
    assert curl.stdout == "reached tls\n", curl
    assert "403" in curl.stderr
    # Another TCP protocol to a listed range: only tunnelled through the gateway with CONNECT (socat's
    # PROXY address here), on a port no hostname rule allows; the same bytes without the tunnel fail.
    # The client keeps its side open until the server closes (a half-close ends the tunnel early).
    request = "(printf 'GET / HTTP/1.0\\r\\n\\r\\n'; sleep 2)"
    tunnel = f"PROXY:127.0.0.1:{world.plain_address}:{world.plain_port},proxyport=3128"
    tunnelled = run(hook, handle, f"{request} | socat -t 2 - {tunnel}")
    assert tunnelled.stdout.endswith("reached plain\n"), tunnelled
    direct = run(hook, handle, f"{request} | socat - TCP:{world.plain_address}:{world.plain_port}")
    assert direct.exit_code != 0 and "reached" not in direct.stdout
    # Every attempt is in the gateway's log, with the handle.
    with open(os.path.join(gateway_dir(hook, handle), egress.LOG), encoding="utf-8") as f:
        logged = f.read()
    assert f"sandbox {handle} egress allowed CONNECT {LISTED}:{world.tls_port}" in logged
    assert f"sandbox {handle} egress refused CONNECT {UNLISTED}:{world.tls_port}" in logged
    assert f"sandbox {handle} egress refused GET 127.0.0.1:{world.host_port}" in logged


def test_catch_all_ranges_never_reach_the_worker_itself(make_hook, world):
    hook = make_hook()
    egress_servers.assert_catch_alls_stay_off_the_worker(hook, lambda spec: hook.create(spec=spec), world)
    handle = hook.create(spec=SandboxSpec(allow_egress_to_cidrs=["0.0.0.0/0"]))
    run(hook, handle, "curl -sS -o /dev/null --max-time 10 http://169.254.169.254/latest/meta-data/")
    with open(os.path.join(gateway_dir(hook, handle), egress.LOG), encoding="utf-8") as f:
        assert "169.254.169.254 is link-local (cloud metadata) (169.254.0.0/16)" in f.read()


#: Connections the flood opens: more than the sandbox's process limit below, and than the cap.
FLOOD_SIZE = 400


@pytest.mark.parametrize(("cap", "held"), [(16, 16), (1024, FLOOD_SIZE)], ids=["capped", "cap-above-the-flood"])
def test_a_flood_of_connections_stays_within_the_gateway_s_bounds(make_hook, cap, held):
    """
    The sandbox opens 400 connections straight to the gateway's socket (its process limit is 64) and
    asks each for a tunnel: the gateway holds ``cap`` of them and answers the rest 503, with one
    event loop (two processes, at most four threads) however many come. The positive control, a cap
    above the flood, shows every connection really is held (twice as many descriptors as
    connections in the gateway), still in those four threads.
    """
    hook = make_hook(max_processes=64, egress_max_connections=cap)
    with egress_servers.held_sink() as (address, port):
        handle = hook.create(spec=SandboxSpec(allow_egress_to_cidrs=[f"{address}/32"]))
        directory = gateway_dir(hook, handle)
        with egress_servers.TreePeak(egress._gateway_pid(directory)) as peak:
            got = egress_servers.flood(
                hook, handle, egress.SANDBOX_SOCKET, FLOOD_SIZE, f"{address}:{port}", limit=60, quiet=3
            )
    assert got == {"held": held, "refused": FLOOD_SIZE - held, "other": 0, "waiting": 0}
    assert (peak.processes, peak.threads <= 4) == (2, True), (peak.processes, peak.threads)
    if held < FLOOD_SIZE:
        assert refusals_logged(directory, cap) == FLOOD_SIZE - held
    else:
        assert peak.files >= 2 * FLOOD_SIZE and refusals_logged(directory, cap) == 0


def test_the_gateway_holds_neither_direction_back_in_memory(make_hook):
    hook = make_hook()
    peak = egress_servers.assert_flow_controlled(
        hook,
        lambda spec: hook.create(spec=spec),
        egress.SANDBOX_SOCKET,
        lambda handle: egress._gateway_pid(gateway_dir(hook, handle)),
    )
    assert peak.rss < 128 << 20, peak.rss_at


def test_plain_http_bodies_are_held_to_the_gateway_s_budget(make_hook, world, monkeypatch):
    """
    proxy.py keeps a plain http:// body whole while it passes, so what the gateway's connections
    hold together is capped (HOLD_BYTES, 8 MiB here): a 32 MiB body is cut off, logged. Positive
    control: a 4 MiB one, under the cap, comes whole.
    """
    monkeypatch.setattr(egress, "HOLD_BYTES", 8 << 20)
    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(allow_egress_to_cidrs=[f"{world.plain_address}/32"]))

    def fetch(size: int) -> str:
        url = f"http://{world.plain_address}:{world.plain_port}/bytes/{size}"
        return run(hook, handle, f"python3 -c {shlex.quote(egress_servers.SIZE)} {url}").stdout.strip()

    assert fetch(4 << 20) == str(4 << 20)
    assert fetch(32 << 20) in ("IncompleteRead", "RemoteDisconnected", "ConnectionResetError")
    with open(os.path.join(gateway_dir(hook, handle), egress.LOG), encoding="utf-8") as f:
        assert "more than the 8388608 they may hold together, and this one held the most" in f.read()


def refusals_logged(directory: str, cap: int) -> int:
    """The refusals past ``cap`` the gateway of ``directory`` logged, once its tally (a second late) is in."""
    return egress_servers.refusals_logged(os.path.join(directory, egress.LOG), cap)


def test_code_inside_cannot_see_or_change_the_allowlist(make_hook, world):
    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(env=tls_env(), allow_egress_to=[LISTED]))
    directory = gateway_dir(hook, handle)
    attack = run(
        hook,
        handle,
        f"ls -A /run/airflow-sandbox; test -e {shlex.quote(directory)} && echo config-visible; "
        "find / -xdev -name 'gateway.json' 2>/dev/null; "
        # Reconfiguration attempts at the only thing it can reach: the proxy's socket.
        "printf 'POST /policy HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nContent-Length: 2\\r\\n\\r\\n{}' | "
        "socat - TCP:127.0.0.1:3128 | head -n1; "
        f"curl -sS -o /dev/null -w '%{{http_code}}\\n' {shlex.quote(world.url(UNLISTED))} 2>/dev/null",
    )
    assert attack.stdout.splitlines()[0] == "egress.sock", attack
    assert "config-visible" not in attack.stdout and "gateway.json" not in attack.stdout
    assert "HTTP/1.1 4" in attack.stdout
    assert attack.stdout.splitlines()[-1] == "000", attack  # the tunnel was refused: no HTTP status from the server
    with open(os.path.join(directory, egress.CONFIG), encoding="utf-8") as f:
        assert f'"hosts": ["{LISTED}"]' in f.read()


def test_pip_installs_from_a_listed_index_and_not_without_it(make_hook, world):
    if not os.path.exists("/usr/lib/python3/dist-packages/pip") and not shutil.which("pip3"):
        pytest.fail("the host's python3 has no pip (apt-get install python3-pip)")
    hook = make_hook()
    pip = (
        "python3 -m pip install --disable-pip-version-check --no-cache-dir --target /workspace/site "
        f"--index-url {shlex.quote(world.url(LISTED, path='/simple/'))} tinypkg"
    )
    listed = hook.create(spec=SandboxSpec(env=tls_env(), allow_egress_to=[LISTED]))
    hook.write_file(listed, "ca.pem", world.ca.ca_pem)
    installed = run(
        hook, listed, f"{pip} && PYTHONPATH=/workspace/site python3 -c 'import tinypkg; print(tinypkg.VALUE)'"
    )
    assert installed.exit_code == 0, installed.stderr
    assert installed.stdout.splitlines()[-1] == WHEEL_VALUE
    unlisted = hook.create(spec=SandboxSpec(env=tls_env(), allow_egress_to=["elsewhere.egress.test"]))
    hook.write_file(unlisted, "ca.pem", world.ca.ca_pem)
    refused = run(hook, unlisted, f"{pip} --retries 0 --timeout 10")
    assert refused.exit_code != 0
    assert run(hook, unlisted, "test -e /workspace/site/tinypkg").exit_code != 0


def test_the_gateway_ends_with_its_sandbox(make_hook, world):
    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    pid = egress._gateway_pid(gateway_dir(hook, handle))
    assert pid is not None and os.path.exists(f"/proc/{pid}")
    hook.destroy(handle)
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    # A worker killed before destroying: the sandbox's directory goes (the next sweep removes it),
    # and its gateway ends by itself.
    other = hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    directory = os.path.join(hook.state_root, other)
    pid = egress._gateway_pid(gateway_dir(hook, other))
    moved = directory + "-gone"
    os.rename(directory, moved)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and not _zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    os.rename(moved, directory)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_missing_tools_are_refused_before_anything_is_made(make_hook, monkeypatch):
    hook = make_hook()
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "socat" else real_which(name, *a, **k))
    with pytest.raises(SandboxTerminalError, match=r"apt-get install socat"):
        hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    assert not os.path.exists(hook.state_root) or not os.listdir(hook.state_root)


def test_bad_allowlists_are_refused_before_anything_is_made(make_hook):
    hook = make_hook()
    with pytest.raises(SandboxTerminalError, match="not a hostname"):
        hook.create(spec=SandboxSpec(allow_egress_to=["https://pypi.org/simple"]))
    with pytest.raises(SandboxTerminalError, match="no host bits"):
        hook.create(spec=SandboxSpec(allow_egress_to_cidrs=["10.0.0.1/8"]))
    with pytest.raises(ValueError, match="TCP port"):
        LocalSandboxHook(egress_ports=[0])


def test_the_gateway_settings_come_from_the_connection(add_connection, tmp_path):
    with egress_world() as world:
        check_settings_from_connection(add_connection, world, tmp_path)


def check_settings_from_connection(add_connection, world, tmp_path):
    # The Dag names only the connection: its extras give the gateway its pins and ports, as the form stores them.
    def hook_of(conn_id, **extra):
        paths = {"state_root": str(tmp_path / conn_id / "state"), "uid_lease_dir": str(tmp_path / conn_id / "ids")}
        return LocalSandboxHook(add_connection(conn_id, "sandbox_local", extra={**paths, **extra}))

    pinned = hook_of("egress_extras", egress_pins=world.pins, egress_ports=world.ports, egress_max_connections=9)
    assert (pinned.egress_ports, pinned.egress_max_connections) == (tuple(world.ports), 9)
    handle = pinned.create(spec=SandboxSpec(env=tls_env(), **world.spec_lists))
    try:
        assert_battery(pinned, handle, world)
        with open(os.path.join(gateway_dir(pinned, handle), egress.CONFIG)) as f:
            config = json.load(f)
        assert (config["max_connections"], config["policy"]["ports"]) == (9, world.ports)
    finally:
        pinned.destroy(handle)
    # Control: the same connection without the pins resolves the test names, which lead nowhere: refused.
    unpinned = hook_of("egress_no_pins", egress_ports=world.ports)
    handle = unpinned.create(spec=SandboxSpec(env=tls_env(), allow_egress_to=[LISTED]))
    try:
        assert run(unpinned, handle, f"curl -sS {shlex.quote(world.url(LISTED))}").stdout != "reached tls\n"
    finally:
        unpinned.destroy(handle)
    # A value the gateway cannot use fails the create before anything is made, naming the connection and extra.
    bad = hook_of("egress_bad_pin", egress_pins={LISTED: "not-an-address"})
    with pytest.raises(SandboxTerminalError, match=r"Connection 'egress_bad_pin' extra 'egress_pins'.*IP address"):
        bad.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    assert not (tmp_path / "egress_bad_pin" / "state").exists()
    # An argument wins over the extra.
    assert LocalSandboxHook("egress_extras", egress_ports=[8443]).egress_ports == (8443,)


def test_the_tool_description_says_what_passes(make_hook):
    text = make_hook(egress_ports=[443, 8443]).network_description(SandboxSpec(allow_egress_to=["pypi.org"]))
    assert "pypi.org" in text and "ports 443, 8443" in text and "DNS does not answer" in text
    assert "127.0.0.1:3128" in text


#: Refused attempts the log test makes: their lines take far more than the small budget it sets.
LOG_ATTEMPTS = 120


def _refused_attempts(hook, handle, world) -> tuple[str, str]:
    """Make :data:`LOG_ATTEMPTS` refused requests from ``handle``; their 403 count and its gateway's log."""
    url = shlex.quote(world.url(UNLISTED))
    loop = f"for i in $(seq {LOG_ATTEMPTS}); do curl -s -o /dev/null -w '%{{http_connect}}\\n' {url}; done"
    codes = run(hook, handle, loop, timeout=240).stdout
    with open(os.path.join(gateway_dir(hook, handle), egress.LOG), encoding="utf-8") as f:
        return codes, f.read()


def test_the_gateways_log_stops_growing_at_its_budget(make_hook, world, monkeypatch):
    refused = f"egress refused CONNECT {UNLISTED}:{world.tls_port}"
    # Control: at the default budget every attempt is a line, together far past the budget set below.
    hook = make_hook()
    codes, logged = _refused_attempts(hook, hook.create(spec=SandboxSpec(**world.spec_lists)), world)
    assert codes.split() == ["403"] * LOG_ATTEMPTS
    assert logged.count(refused) == LOG_ATTEMPTS and len(logged.encode()) > 4 * 4096
    # A budget of 4 KiB: the first lines are written, then one line says the limit was reached; every
    # later attempt is still refused.
    monkeypatch.setattr(egress, "LOG_BYTES", 4096)
    hook = make_hook()
    codes, logged = _refused_attempts(hook, hook.create(spec=SandboxSpec(**world.spec_lists)), world)
    assert codes.split() == ["403"] * LOG_ATTEMPTS
    assert 0 < logged.count(refused) < LOG_ATTEMPTS // 4
    assert "the egress log reached its limit of 4096 bytes" in logged
    assert len(logged.encode()) <= 4096 + 2 * 200


def test_the_gateway_parses_within_its_bounds(make_hook):
    """An endless request head is cut off at 64 KiB (proxy.py's own parser held all of it, with work growing as
    its square: 12 s of the worker's CPU for 32 MiB), and plain downloads pass whole (64 MiB took 37 s)."""
    hook = make_hook()
    egress_servers.assert_gateway_parses_within_bounds(
        hook,
        lambda spec: hook.create(spec=spec),
        lambda handle: os.path.join(gateway_dir(hook, handle), egress.LOG),
    )


FORGE = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", 3128), timeout=30)
sock.sendall(b"CONNECT evil\n" + sys.argv[1].encode() + b"\x1b[2J:443 HTTP/1.1\r\n\r\n")
print(sock.recv(4096).split(b"\r\n")[0].decode())
"""


def test_a_name_the_sandbox_asks_for_cannot_forge_lines_of_the_logs(make_hook, tmp_path, caplog):
    import logging

    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(allow_egress_to_cidrs=["127.0.0.9/32"]))
    # A request line is split at spaces, so the forged line has tabs, which look the same in a log.
    forged = f"sandbox\t{handle}\tegress\tallowed\tCONNECT\tpypi.org\tlisted\thost"
    # Positive control: the handler as it was (a plain file handler) writes the forged text as a line of its own.
    plain = logging.FileHandler(tmp_path / "plain.log")
    plain.emit(logging.LogRecord("egress", logging.INFO, "", 0, "refused CONNECT %s", (f"evil\n{forged}",), None))
    plain.close()
    assert forged in (tmp_path / "plain.log").read_text().splitlines()
    caplog.set_level(logging.INFO)
    asked = run(hook, handle, f"python3 -c {shlex.quote(FORGE)} {shlex.quote(forged)}")
    assert asked.stdout.startswith("HTTP/1.1 403"), asked
    with open(os.path.join(gateway_dir(hook, handle), egress.LOG), encoding="utf-8") as f:
        lines = f.read().splitlines()
    attempt = [line for line in lines if "egress refused CONNECT evil" in line]
    shown = forged.replace("\t", "\\x09")
    assert len(attempt) == 1 and f"evil\\x0a{shown}\\x1b[2J:443" in attempt[0], lines
    assert not [line for line in lines if "egress allowed" in line]
    relayed = [record.getMessage() for record in caplog.records if "egress" in record.getMessage()]
    assert attempt[0] in relayed and not [m for m in relayed if "\n" in m or "\x1b" in m or "\t" in m]
