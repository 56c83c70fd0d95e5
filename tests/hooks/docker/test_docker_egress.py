"""
Hostname and address allowlists on the Docker backend, through the egress gateway, against servers
this module starts on loopback addresses (the gateway is given pins from the test names to them).
Positive controls first (the listed name is reached), then every refusal.
"""

from __future__ import annotations

import os
import shutil

import egress_servers
import pytest
from egress_servers import LISTED, UNLISTED, assert_battery, egress_world, probe, run, tls_env

from sandbox_provider.hooks import egress
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.errors import SandboxTerminalError

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="the Docker egress forwarder needs a root worker"),
]


@pytest.fixture(scope="module")
def world():
    with egress_world() as made:
        yield made


@pytest.fixture
def make_hook(docker_conn, world):
    from sandbox_provider.hooks.docker import DockerSandboxHook

    made = []

    def make(**settings):
        hook = DockerSandboxHook(
            docker_conn, pull="never", egress_pins=world.pins, egress_ports=world.ports, **settings
        )
        made.append(hook)
        return hook

    yield make
    while handles:
        hook, handle = handles.pop()
        hook.destroy(handle)


handles: list = []


def create(hook, spec):
    handle = hook.create(spec=spec)
    handles.append((hook, handle))
    return handle


def test_listed_hosts_and_ranges_pass_and_nothing_else(make_hook, world, docker_client):
    hook = make_hook()
    handle = create(hook, SandboxSpec(env=tls_env(), **world.spec_lists))
    assert docker_client.api.inspect_container(handle)["HostConfig"]["NetworkMode"] == "none"
    assert_battery(hook, handle, world)
    with open(os.path.join(egress.docker_gateway_dir(handle), egress.LOG), encoding="utf-8") as f:
        logged = f.read()
    assert f"sandbox {handle} egress allowed CONNECT {LISTED}:{world.tls_port}" in logged
    assert f"sandbox {handle} egress refused CONNECT {UNLISTED}:{world.tls_port}" in logged


def test_catch_all_ranges_never_reach_the_worker_itself(make_hook, world):
    hook = make_hook()
    egress_servers.assert_catch_alls_stay_off_the_worker(hook, lambda spec: create(hook, spec), world)


#: Connections the flood opens: more than the container's process limit below, and than the cap.
FLOOD_SIZE = 200


@pytest.mark.parametrize("cap", [16, 1024], ids=["capped", "cap-above-the-flood"])
def test_a_flood_of_connections_stays_within_the_forwarder_s_bounds(make_hook, cap):
    """
    The sandbox (at most 64 processes) opens 200 connections to the forwarder and asks each for a
    tunnel. The forwarder runs on the worker, outside the container's limits, one socat per
    connection: with the cap, the worker holds at most the cap plus FORWARD_SPARE of them, the
    gateway holds ``cap`` tunnels and refuses the spare ones (503, logged), the rest wait. The
    positive control, a cap above the flood, shows the worker's processes really do follow the
    connections past the container's own limit without it.
    """
    hook = make_hook(pids_limit=64, egress_max_connections=cap)
    with egress_servers.held_sink() as (address, port):
        handle = create(hook, SandboxSpec(allow_egress_to_cidrs=[f"{address}/32"]))
        directory = egress.docker_gateway_dir(handle)
        with egress_servers.TreePeak(egress._gateway_pid(directory)) as peak:
            got = egress_servers.flood(
                hook, handle, "127.0.0.1:3128", FLOOD_SIZE, f"{address}:{port}", limit=40, quiet=4
            )
    assert sum(got.values()) == FLOOD_SIZE and got["other"] == 0, got
    if cap < FLOOD_SIZE:
        bound = 2 + 1 + cap + egress.FORWARD_SPARE  # the gateway's two, socat's listener, its children
        assert got["held"] == cap and got["refused"] >= egress.FORWARD_SPARE, got
        assert peak.processes <= bound and peak.threads <= bound + 2, (peak.processes, peak.threads)
        assert egress_servers.refusals_logged(os.path.join(directory, egress.LOG), cap) == got["refused"]
    else:
        assert got["held"] > 64 and peak.processes > 64 + 3, (got, peak.processes)


def test_the_gateway_holds_neither_direction_back_in_memory(make_hook):
    hook = make_hook()
    peak = egress_servers.assert_flow_controlled(
        hook,
        lambda spec: create(hook, spec),
        f"127.0.0.1:{egress.FORWARD_PORT}",
        lambda handle: egress._gateway_pid(egress.docker_gateway_dir(handle)),
    )
    assert peak.rss < 128 << 20, peak.rss_at


def test_the_gateway_parses_within_its_bounds(make_hook):
    hook = make_hook()
    egress_servers.assert_gateway_parses_within_bounds(
        hook,
        lambda spec: create(hook, spec),
        lambda handle: os.path.join(egress.docker_gateway_dir(handle), egress.LOG),
    )


def test_root_in_the_container_cannot_stop_or_replace_the_forwarder(make_hook, world):
    hook = make_hook(run_as_root=True)
    handle = create(hook, SandboxSpec(env=tls_env(), allow_egress_to=[LISTED]))
    hook.write_file(handle, "ca.pem", world.ca.ca_pem)
    assert probe(hook, handle, world.url(LISTED)) == {"status": 200, "body": "reached tls\n"}
    # Root kills every process it can see and tries to take the port over: the forwarder is not
    # among them (it runs outside the container), so the port stays the gateway's.
    attack = run(
        hook,
        handle,
        'python3 -c "import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); '
        "s.bind(('127.0.0.1', 3128))\" 2>&1 | tail -n1; ls /proc | grep -c '^[0-9]'",
    )
    assert "Address already in use" in attack.stdout, attack
    run(hook, handle, "kill -9 -1")
    got = probe(hook, handle, world.url(UNLISTED))
    assert "body" not in got and "403" in (got.get("error", "") + str(got.get("status", "")))
    assert probe(hook, handle, world.url(LISTED)) == {"status": 200, "body": "reached tls\n"}


def test_the_gateway_ends_with_its_sandbox(make_hook):
    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    directory = egress.docker_gateway_dir(handle)
    pid = egress._gateway_pid(directory)
    assert pid is not None
    hook.destroy(handle)
    assert egress._gateway_pid(directory) is None and not os.path.exists(directory)


def test_missing_tools_are_refused_before_anything_is_made(make_hook, monkeypatch):
    hook = make_hook()
    made = []
    monkeypatch.setattr(hook, "_create_container", lambda kwargs, disk: made.append(kwargs) or "never")
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "nsenter" else real_which(name, *a, **k))
    with pytest.raises(SandboxTerminalError, match=r"apt-get install util-linux"):
        hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    assert made == []


def test_a_killed_workers_gateway_ends_with_the_container_and_the_next_create_removes_it(make_hook, docker_client):
    """The worker dies without destroying; the container ends (its lifetime, or removed by hand)."""
    import time

    hook = make_hook()
    handle = hook.create(spec=SandboxSpec(allow_egress_to=[LISTED]))
    directory = egress.docker_gateway_dir(handle)
    pid = egress._gateway_pid(directory)
    assert pid is not None
    docker_client.api.remove_container(handle, force=True)  # behind the hook's back, as its end would
    deadline = time.monotonic() + 15
    while egress._gateway_pid(directory) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert egress._gateway_pid(directory) is None
    assert os.path.isdir(directory)  # what a killed worker leaves
    create(hook, SandboxSpec())  # every create sweeps
    assert not os.path.exists(directory)
