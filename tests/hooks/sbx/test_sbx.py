"""
SbxSandboxHook against the stand-in sbx CLI, whose sandboxes are real containers on the local Docker
Engine: the guide's network table, the environment profile, CLI failures (missing, failing,
hanging), and sweeping by name.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest
from sbx_fixtures import sbx_standin

from conftest import DOCKER_IMAGE
from sandbox_provider.hooks.sbx import SbxSandboxBackend, SbxSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

pytestmark = pytest.mark.docker


@pytest.fixture
def standin(docker_client, tmp_path):
    with sbx_standin(tmp_path / "sbx", DOCKER_IMAGE) as standin:
        yield standin


def make(standin, **kwargs):
    kwargs.setdefault("host_network_policy", "deny-all")
    return SbxSandboxHook(sbx_path=standin.path, memory="1g", cli_grace=2.0, **kwargs)


def run(hook, handle, command, timeout=60, **kwargs):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=1 << 20, **kwargs)


def creates(standin):
    return [call for call in standin.calls() if call.startswith("create")]


class TestConstruction:
    def test_alias_and_no_cli_call_at_construction(self, tmp_path):
        assert SbxSandboxBackend is SbxSandboxHook
        SbxSandboxHook(sbx_path=str(tmp_path / "no-such-sbx"), host_network_policy="deny-all")

    @pytest.mark.parametrize(
        ("kwargs", "says"),
        [
            ({"memory": "512m"}, "at least 1 GiB"),
            ({"memory": "lots"}, "memory must be a size"),
            ({"host_network_policy": "balanced"}, "host_network_policy must be one of"),
            ({"cpus": 0}, "cpus"),
            ({"cli_grace": -1}, "cli_grace"),
        ],
    )
    def test_bad_arguments(self, kwargs, says):
        with pytest.raises(ValueError, match=says):
            SbxSandboxHook(**kwargs)


class TestNetworkTable:
    """The guide's row for sbx: default and hostnames need a deny-all host; no CIDRs; open always works."""

    @pytest.mark.parametrize("policy", [None, "unknown", "allow-all"])
    @pytest.mark.parametrize("spec", [SandboxSpec(), SandboxSpec(allow_egress_to=["pypi.org"])])
    def test_a_blocked_network_needs_a_declared_deny_all_host(self, standin, policy, spec):
        hook = SbxSandboxHook(sbx_path=standin.path, **({"host_network_policy": policy} if policy else {}))
        with pytest.raises(SandboxTerminalError) as caught:
            hook.create(spec=spec)
        message = str(caught.value)
        assert "'sbx policy init deny-all'" in message and "host_network_policy='deny-all'" in message
        assert "SandboxSpec(block_network=False)" in message
        assert creates(standin) == []

    def test_the_guides_message_for_a_bare_spec(self, standin):
        with pytest.raises(SandboxTerminalError, match="no network egress.*host-wide policy.*not been declared"):
            SbxSandboxHook(sbx_path=standin.path).create(spec=SandboxSpec())

    def test_the_host_policy_can_come_from_the_connection(self, standin, add_connection):
        conn = add_connection(
            "sbx_deny", "sandbox_sbx", extra={"host_network_policy": "deny-all", "sbx_path": standin.path}
        )
        hook = SbxSandboxHook(conn, memory="1g")
        handle = hook.create(spec=SandboxSpec())
        hook.destroy(handle)

    @pytest.mark.parametrize("policy", ["unknown", "allow-all", "deny-all"])
    def test_an_open_network_is_always_accepted(self, standin, policy):
        hook = make(standin, host_network_policy=policy)
        handle = hook.create(spec=SandboxSpec(block_network=False))
        try:
            assert run(hook, handle, "echo open").stdout == "open\n"
        finally:
            hook.destroy(handle)

    def test_deny_all_host_keeps_the_sandbox_offline(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        try:
            interfaces = run(hook, handle, "ls /sys/class/net").stdout.split()
            assert interfaces == ["lo"]
        finally:
            hook.destroy(handle)

    def test_hostnames_become_rules_scoped_to_the_sandbox(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec(allow_egress_to=["PyPI.org", "files.pythonhosted.org"]))
        try:
            assert standin.rules() == [
                f"sandbox:{handle} allow pypi.org",
                f"sandbox:{handle} allow files.pythonhosted.org",
            ]
        finally:
            hook.destroy(handle)
        assert standin.rules() == []

    @pytest.mark.parametrize(
        ("spec", "says"),
        [
            (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "address-range"),
            (SandboxSpec(owner="dag/run"), "owner"),
        ],
    )
    def test_cidrs_and_owner_are_refused_before_create(self, standin, spec, says):
        with pytest.raises(SandboxTerminalError, match=says):
            make(standin).create(spec=spec)
        assert creates(standin) == []


class TestSandbox:
    def test_create_flags_and_read_only_empty_workspace(self, standin):
        hook = make(standin, cpus=1, image="python:3.12-slim")
        handle = hook.create(spec=SandboxSpec())
        try:
            (call,) = creates(standin)
            assert f"--name {handle}" in call and "--memory 1g" in call and "--cpus 1" in call
            assert "--template python:3.12-slim" in call and ":ro" in call
            (workspace,) = glob.glob(os.path.join(tempfile.gettempdir(), handle + "-*"))
            assert os.listdir(workspace) == []
            assert run(hook, handle, "pwd").stdout == "/workspace\n"
        finally:
            hook.destroy(handle)
        assert glob.glob(os.path.join(tempfile.gettempdir(), handle + "-*")) == []
        assert standin.containers() == []

    def test_env_goes_through_the_profile_not_a_command_line(self, standin):
        hook = make(standin)
        secret = "s3cret value with 'quotes' and $dollars"
        handle = hook.create(spec=SandboxSpec(env={"API_TOKEN": secret}))
        try:
            assert run(hook, handle, 'printf %s "$API_TOKEN"').stdout == secret
            assert all(secret not in call and "s3cret" not in call for call in standin.calls())
        finally:
            hook.destroy(handle)

    def test_timeout_in_the_guest_keeps_the_sandbox(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        try:
            result = run(hook, handle, "sleep 300 & sleep 300", timeout=1)
            assert result.timed_out and not result.sandbox_terminated
            leftovers = run(hook, handle, "ps -eo args | grep -c '^sleep 300$' || true").stdout.strip()
            assert leftovers == "0"
        finally:
            hook.destroy(handle)

    def test_a_gone_sandbox_is_terminal(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        import subprocess

        subprocess.run([standin.path, "rm", "--force", handle], check=True, timeout=60)
        with pytest.raises(SandboxTerminalError, match="gone"):
            run(hook, handle, "true")
        hook.destroy(handle)

    def test_a_command_failing_with_1_is_just_its_status(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        try:
            assert run(hook, handle, "exit 1").exit_code == 1
        finally:
            hook.destroy(handle)


class TestCliFailures:
    def test_missing_binary(self, tmp_path):
        hook = SbxSandboxHook(sbx_path=str(tmp_path / "sbx"), host_network_policy="deny-all")
        with pytest.raises(SandboxTerminalError, match="was not found on this worker"):
            hook.create(spec=SandboxSpec())

    def test_non_zero_create_is_terminal_and_cleans_up(self, standin):
        standin.fail("create")
        with pytest.raises(SandboxTerminalError, match=r"'sbx create' failed \(exit 1\): ERROR: create failed"):
            make(standin).create(spec=SandboxSpec())
        assert standin.containers() == []

    def test_a_create_that_hangs_is_cut_off(self, standin):
        standin.hang("create")
        started = time.monotonic()
        with pytest.raises(SandboxTerminalError, match="did not finish within 1 seconds"):
            make(standin, create_timeout=1).create(spec=SandboxSpec())
        assert time.monotonic() - started < 60

    def test_a_host_without_a_chosen_policy_fails_create(self, docker_client, tmp_path):
        with sbx_standin(tmp_path / "fresh", DOCKER_IMAGE, policy=None) as fresh:
            with pytest.raises(SandboxTerminalError, match="sbx policy init"):
                make(fresh).create(spec=SandboxSpec())

    def test_a_hung_exec_destroys_the_sandbox_and_says_so(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        standin.hang("exec")
        result = run(hook, handle, "echo never", timeout=0.5)
        assert result.timed_out and result.sandbox_terminated
        assert standin.containers() == []

    def test_a_failing_rm_of_a_live_sandbox_is_reported(self, standin):
        hook = make(standin)
        handle = hook.create(spec=SandboxSpec())
        standin.fail("rm")
        with pytest.raises(SandboxTerminalError, match="'sbx rm' failed"):
            hook.destroy(handle)
        standin.heal()
        hook.destroy(handle)


class TestSweep:
    def test_list_and_remove_expired_by_name(self, standin):
        hook = make(standin, sandbox_timeout=600)
        first, second = hook.create(spec=SandboxSpec()), hook.create(spec=SandboxSpec())
        listed = {info.handle: info for info in hook.list_sandboxes()}
        assert set(listed) == {first, second}
        assert all(time.time() + 500 < info.expires_at <= time.time() + 600 for info in listed.values())
        assert hook.remove_expired() == []
        assert sorted(hook.remove_expired(now=time.time() + 601)) == sorted([first, second])
        assert standin.containers() == []


def test_file_write_failure_is_recoverable(standin):
    hook = make(standin)
    handle = hook.create(spec=SandboxSpec())
    try:
        run(hook, handle, "mkdir d")
        with pytest.raises(SandboxError) as caught:
            hook.write_file(handle, "d", b"into a directory")
        assert not isinstance(caught.value, SandboxTerminalError)
    finally:
        hook.destroy(handle)


def test_the_toolset_notes_say_what_the_host_policy_means():
    hook = SbxSandboxHook(host_network_policy="deny-all")
    assert "whatever this machine's sbx policy allows" in hook.describe_network(SandboxSpec(block_network=False))
    assert "only pypi.org, over HTTP or HTTPS" in hook.describe_network(SandboxSpec(allow_egress_to=["pypi.org"]))
    assert hook.describe_network(SandboxSpec()) is None


def test_too_little_memory_in_the_connection_fails_before_create(standin, add_connection):
    conn = add_connection("sbx_small", "sandbox_sbx", extra={"memory": "512m", "host_network_policy": "deny-all"})
    with pytest.raises(SandboxTerminalError, match="at least 1 GiB"):
        SbxSandboxHook(conn, sbx_path=standin.path).create(spec=SandboxSpec())
    assert creates(standin) == []
