"""
ModalSandboxHook through the real ``modal`` SDK, talking gRPC to the Modal stand-in of
``modal_server.py`` (beside this file) on loopback: commands really run (in bubblewrap), files really
move, and what the hook asked Modal for is read from the stand-in's records.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
import threading
import time

import pytest
import time_machine
from grpclib import Status
from modal_server import TOKEN, ModalServer, NetworkPolicy, modal_server_fixture, sandbox_rpc  # noqa: F401
from modal_worker import FS_TOOLS_PATH

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

modal_module = importlib.import_module("sandbox_provider.hooks.modal.hook")
ModalSandboxHook = modal_module.ModalSandboxHook

NOW = 1_900_000_000.0
CREATES = ("SandboxCreate", "SandboxCreateV2")


class Clock:
    """A monotonic clock that moves only when the hook sleeps or a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_hook(modal_server, clock):
    """Hooks on the worker's Modal configuration (the stand-in's token pair), sleeping on ``clock``."""

    def _make(**kwargs):
        kwargs.setdefault("modal_conn_id", None)
        hook = ModalSandboxHook(**kwargs)
        hook._monotonic = clock
        hook._sleep = clock.sleep
        return hook

    return _make


def execs(server: ModalServer) -> list:
    """The TaskExecStart requests so far: what each command asked for."""
    return server.requests("TaskExecStart")


def helper_calls(server: ModalServer, operation: str) -> list[str]:
    """The paths given to the sandbox's filesystem helper for ``operation``."""
    import json

    found = []
    for request in execs(server):
        args = list(request.command_args)
        if args[:1] == [FS_TOOLS_PATH] and operation in json.loads(args[1]):
            found.append(json.loads(args[1])[operation]["path"])
    return found


# -- construction --------------------------------------------------------------------------------------


class TestConstruction:
    def test_guide_name_is_the_hook(self):
        assert modal_module.ModalSandboxBackend is ModalSandboxHook
        assert ModalSandboxHook.name == "modal"
        assert ModalSandboxHook.attachable is True
        assert ModalSandboxHook.conn_name_attr == "modal_conn_id"
        assert ModalSandboxHook.default_conn_name == "modal_default"
        assert ModalSandboxHook.conn_type == "modal"

    def test_defaults(self):
        hook = ModalSandboxHook()
        assert hook.modal_conn_id == "modal_default"
        assert hook.image == "python:3.12-slim"
        assert hook.sandbox_timeout == 3600
        assert hook.idle_timeout is None
        assert hook.workdir == "/workspace"
        assert hook.egress_enforcement == "strict"

    def test_constructing_makes_no_modal_call(self, modal_server):
        ModalSandboxHook(modal_conn_id="not_defined_anywhere", cpu=2, tags={"dag_id": "d"})
        assert modal_server.calls == []

    def test_constructing_without_the_extra(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "modal", None)  # makes "import modal" fail
        hook = ModalSandboxHook(image="python:3.13-slim")
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        with pytest.raises(AirflowOptionalProviderFeatureException, match=r"'\.\[modal\]' in a clone"):
            hook.create(spec=SandboxSpec())

    def test_accepts_a_modal_image(self, make_hook, modal_server):
        import modal

        image = modal.Image.from_registry("python:3.11-slim")
        hook = make_hook(image=image)
        assert hook.image is image
        handle = hook.create(spec=SandboxSpec())
        assert modal_server.sandbox(handle).image_tag == "python:3.11-slim"

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"image": ""}, "image"),
            ({"image": 3}, "image"),
            ({"app_name": "has space"}, "app_name"),
            ({"create_app_if_missing": "yes"}, "create_app_if_missing"),
            ({"sandbox_timeout": 0}, "sandbox_timeout"),
            ({"sandbox_timeout": 60}, "sandbox_timeout"),
            ({"sandbox_timeout": 90000}, "sandbox_timeout"),
            ({"sandbox_timeout": 600.5}, "sandbox_timeout"),
            ({"sandbox_timeout": True}, "sandbox_timeout"),
            ({"idle_timeout": 0}, "idle_timeout"),
            ({"idle_timeout": 7200}, "idle_timeout"),
            ({"workdir": "relative/dir"}, "workdir"),
            ({"workdir": None}, "workdir"),
            ({"cpu": 0}, "cpu"),
            ({"cpu": "2"}, "cpu"),
            ({"memory": 1.5}, "memory"),
            ({"memory": -1}, "memory"),
            ({"gpu": ""}, "gpu"),
            ({"region": []}, "region"),
            ({"region": 5}, "region"),
            ({"cloud": 1}, "cloud"),
            ({"tags": {"dag_id": 1}}, "tags"),
            ({"tags": ["a"]}, "tags"),
            ({"tags": {"airflow_owner": "me"}}, "airflow_"),
            ({"egress_enforcement": "loose"}, "egress_enforcement"),
            ({"modal_conn_id": ""}, "modal_conn_id"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            ModalSandboxHook(**kwargs)


# -- provisioning and the network ----------------------------------------------------------------------


class TestCreate:
    @time_machine.travel(NOW, tick=False)
    def test_create_passes_settings_and_stamps(self, make_hook, modal_server):
        hook = make_hook(
            sandbox_timeout=1800,
            cpu=2.0,
            memory=4096,
            gpu="T4",
            region=["us-east", "us-west"],
            cloud="aws",
            tags={"dag_id": "etl"},
            app_name="my-app",
        )
        handle = hook.create(spec=SandboxSpec(env={"MODE": "test"}, owner="etl/run1"))
        record = modal_server.sandbox(handle)
        definition = record.definition
        assert handle.startswith("sb-") and record.version == 1  # a GPU sandbox is a V1 sandbox
        assert record.name.startswith("airflow-sandbox-") and len(record.name) == len("airflow-sandbox-") + 12
        assert definition.timeout_secs == 1800
        assert definition.workdir == "/workspace"
        assert record.env == {"MODE": "test"}
        assert (definition.resources.milli_cpu, definition.resources.memory_mb) == (2000, 4096)
        assert definition.resources.gpu_config.gpu_type == "T4"
        assert definition.cloud_provider_str == "aws"
        assert list(definition.scheduler_placement.regions) == ["us-east", "us-west"]
        assert not definition.HasField("idle_timeout_secs")
        assert record.image_tag == "python:3.12-slim"
        assert [app.name for app in modal_server.apps.values()] == ["my-app"]  # created: create_app_if_missing
        tags = record.tags
        assert tags["airflow_sandbox"] == "true"
        assert tags["dag_id"] == "etl"
        assert tags[OWNER_TAG] == "etl/run1"
        assert tags[EXPIRES_AT_TAG] == str(int(NOW + 1800))
        assert tags[WORKDIR_TAG] == "/workspace"
        assert decode_network_policy(tags[NETWORK_TAG]) == SandboxSpec()

    def test_env_reaches_commands_over_a_bare_environment(self, make_hook, monkeypatch):
        monkeypatch.setenv("WORKER_SECRET", "must-not-leak")
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(env={"MODE": "test"}))
        result = hook.run_command(handle, "env | sort", timeout=10, max_output_bytes=10_000)
        names = {line.split("=", 1)[0] for line in result.stdout.splitlines()}
        assert "MODE=test" in result.stdout.splitlines()
        assert "WORKER_SECRET" not in names and "AIRFLOW_HOME" not in names
        assert names <= {"MODE", "PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}

    def test_idle_timeout_is_passed_without_owner(self, make_hook, modal_server):
        handle = make_hook(idle_timeout=300).create(spec=SandboxSpec())
        record = modal_server.sandbox(handle)
        assert record.definition.idle_timeout_secs == 300

    def test_app_not_created_when_told_not_to(self, make_hook, modal_server):
        with pytest.raises(SandboxTerminalError, match="could not find"):
            make_hook(create_app_if_missing=False).create(spec=SandboxSpec())
        assert modal_server.count(*CREATES) == 0

    @pytest.mark.parametrize("spec", [None, SandboxSpec(), SandboxSpec(block_network=True)])
    def test_default_blocks_everything(self, make_hook, modal_server, spec):
        handle = make_hook().create(spec=spec)
        assert modal_server.sandbox(handle).network == NetworkPolicy(
            blocked=True, allowlist=False, cidrs=[], domains=[]
        )

    def test_open_network_passes_no_flag(self, make_hook, modal_server):
        handle = make_hook().create(spec=SandboxSpec(block_network=False))
        assert modal_server.sandbox(handle).network == NetworkPolicy(
            blocked=False, allowlist=False, cidrs=[], domains=[]
        )

    def test_hostnames_refused_under_strict(self, make_hook, modal_server):
        with pytest.raises(SandboxTerminalError) as info:
            make_hook().create(spec=SandboxSpec(allow_egress_to=["pypi.org"]))
        message = str(info.value)
        for part in ("TLS", "443", "DNS", "egress_enforcement='sni'", "allow_egress_to_cidrs"):
            assert part in message
        assert modal_server.calls == []

    def test_hostnames_under_sni(self, make_hook, modal_server):
        hook = make_hook(egress_enforcement="sni")
        handle = hook.create(spec=SandboxSpec(allow_egress_to=["PyPI.org", "*.pythonhosted.org", "pypi.org"]))
        network = modal_server.sandbox(handle).network
        assert network == NetworkPolicy(
            blocked=False, allowlist=True, cidrs=[], domains=["pypi.org", "*.pythonhosted.org"]
        )

    @pytest.mark.parametrize(
        "host",
        ["https://pypi.org", "pypi.org:443", "pypi.org/simple", "localhost", "*.com", "*", "1.2.3.4", "a..b"],
    )
    def test_bad_hostnames_refused(self, make_hook, modal_server, host):
        with pytest.raises(SandboxTerminalError, match="not a hostname"):
            make_hook(egress_enforcement="sni").create(spec=SandboxSpec(allow_egress_to=[host]))
        assert modal_server.calls == []

    def test_cidrs(self, make_hook, modal_server):
        spec = SandboxSpec(allow_egress_to_cidrs=["203.0.113.10/32", "198.51.100.0/24", "8.8.8.8"])
        handle = make_hook().create(spec=spec)
        assert modal_server.sandbox(handle).network == NetworkPolicy(
            blocked=False, allowlist=True, cidrs=["203.0.113.10/32", "198.51.100.0/24", "8.8.8.8/32"], domains=[]
        )

    @pytest.mark.parametrize(
        ("cidr", "match"),
        [
            ("10.0.0.0/8", "private"),
            ("192.168.1.0/24", "private"),
            ("169.254.169.254/32", "link-local"),
            ("127.0.0.1", "loopback"),
            ("8.0.0.0/6", "overlaps"),
            ("2001:db8::/32", "IPv6"),
            ("203.0.113.5/24", "host bits"),
            ("0.0.0.0/0", "every address"),
            # Modal's "public ranges only" keeps every catch-all away from loopback and metadata, as
            # the gateway's guarded blocks do on local and Docker: no /1 half, no IPv6 or mapped form.
            ("0.0.0.0/1", "overlaps 0.0.0.0/8"),
            ("128.0.0.0/1", "overlaps 169.254.0.0/16"),
            ("::/0", "IPv6"),
            ("::ffff:127.0.0.1/128", "IPv6"),
            ("64:ff9b::/96", "IPv6"),
            ("example.com", "not an IPv4"),
        ],
    )
    def test_bad_cidrs_refused(self, make_hook, modal_server, cidr, match):
        with pytest.raises(SandboxTerminalError, match=match):
            make_hook().create(spec=SandboxSpec(allow_egress_to_cidrs=[cidr]))
        assert modal_server.calls == []

    def test_both_lists_warn(self, make_hook, modal_server, caplog):
        spec = SandboxSpec(allow_egress_to=["api.example.com"], allow_egress_to_cidrs=["203.0.113.0/24"])
        with caplog.at_level(logging.WARNING):
            handle = make_hook(egress_enforcement="sni").create(spec=spec)
        network = modal_server.sandbox(handle).network
        assert (network.domains, network.cidrs) == (["api.example.com"], ["203.0.113.0/24"])
        assert "port 443" in caplog.text

    def test_env_must_be_strings_even_if_the_spec_was_bypassed(self, make_hook, modal_server):
        spec = SandboxSpec()
        object.__setattr__(spec, "env", {"PORT": 8080, "OK": "x"})
        with pytest.raises(SandboxTerminalError, match=r"\['PORT'\].*str\(port\)"):
            make_hook().create(spec=spec)
        assert modal_server.count(*CREATES) == 0

    def test_owner_with_idle_timeout_refused(self, make_hook, modal_server):
        with pytest.raises(SandboxTerminalError, match="idle_timeout=300"):
            make_hook(idle_timeout=300).create(spec=SandboxSpec(owner="d/r"))
        assert modal_server.calls == []

    def test_create_failure_is_terminal(self, make_hook, modal_server):
        modal_server.fail_next(sandbox_rpc("SandboxCreate"), Status.INVALID_ARGUMENT, "bad gpu")
        with pytest.raises(SandboxTerminalError, match="bad gpu"):
            make_hook().create(spec=SandboxSpec())


# -- credentials ---------------------------------------------------------------------------------------


def token_ids(server: ModalServer, rpc: str) -> set[str | None]:
    return {call.token_id for call in server.calls if call.rpc == rpc}


class TestCredentials:
    def test_connection_credentials_and_environment(self, make_hook, modal_server, add_connection):
        modal_server.tokens.add(("ak-abc", "as-def"))
        add_connection("team_modal", "modal", login="ak-abc", password="as-def", extra={"environment": "dev"})
        make_hook(modal_conn_id="team_modal").create(spec=SandboxSpec())
        assert (
            token_ids(modal_server, sandbox_rpc("SandboxCreate"))
            == token_ids(modal_server, "AppGetOrCreate")
            == {"ak-abc"}
        )
        (lookup,) = modal_server.requests("AppGetOrCreate")
        assert lookup.environment_name == "dev"

    def test_no_connection_uses_worker_config(self, make_hook, modal_server):
        make_hook(modal_conn_id=None).create(spec=SandboxSpec())
        assert token_ids(modal_server, sandbox_rpc("SandboxCreate")) == {TOKEN[0]}

    def test_missing_default_connection_falls_back_to_worker_config(self, make_hook, modal_server):
        make_hook(modal_conn_id="modal_default").create(spec=SandboxSpec())
        assert token_ids(modal_server, sandbox_rpc("SandboxCreate")) == {TOKEN[0]}

    def test_missing_named_connection(self, make_hook, modal_server):
        with pytest.raises(SandboxTerminalError, match="'absent_conn' is not defined.*modal_conn_id=None"):
            make_hook(modal_conn_id="absent_conn").create(spec=SandboxSpec())
        assert modal_server.calls == []

    def test_half_filled_connection(self, make_hook, modal_server, add_connection):
        add_connection("half", "modal", login="ak-abc")
        with pytest.raises(SandboxTerminalError, match="half"):
            make_hook(modal_conn_id="half").create(spec=SandboxSpec())
        assert modal_server.calls == []

    def test_rejected_credentials_name_the_connection(self, make_hook, modal_server, add_connection):
        add_connection("team_modal", "modal", login="ak-abc", password="as-wrong")
        with pytest.raises(SandboxTerminalError, match="rejected the credentials from Airflow connection 'team_modal'"):
            make_hook(modal_conn_id="team_modal").create(spec=SandboxSpec())
        assert modal_server.count(*CREATES) == 0

    def test_rejected_worker_credentials(self, make_hook, modal_server, monkeypatch):
        monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-revoked")
        with pytest.raises(SandboxTerminalError, match="worker's Modal configuration"):
            make_hook(modal_conn_id=None).create(spec=SandboxSpec())
        assert modal_server.count(*CREATES) == 0

    def test_permission_denied_is_terminal(self, make_hook, modal_server):
        modal_server.fail_next(sandbox_rpc("SandboxCreate"), Status.PERMISSION_DENIED, "nope")
        with pytest.raises(SandboxTerminalError, match="may not do this"):
            make_hook().create(spec=SandboxSpec())


# -- transient errors ----------------------------------------------------------------------------------


class TestRetries:
    def test_transient_create_error_is_retried(self, make_hook, modal_server, clock):
        modal_server.fail_next(sandbox_rpc("SandboxCreate"), Status.RESOURCE_EXHAUSTED, "no capacity", times=2)
        handle = make_hook().create(spec=SandboxSpec())
        assert modal_server.count(sandbox_rpc("SandboxCreate")) == 3
        assert list(modal_server.sandboxes) == [handle]
        assert clock.sleeps == [0.5, 1.0]

    def test_an_error_the_sdk_gave_up_retrying_is_retried_by_the_hook(self, make_hook, modal_server, clock):
        from modal._utils.grpc_utils import DEFAULT_MAX_RETRIES

        modal_server.fail_next(sandbox_rpc("SandboxCreate"), Status.INTERNAL, "hiccup", times=DEFAULT_MAX_RETRIES + 1)
        handle = make_hook().create(spec=SandboxSpec())
        assert modal_server.count(sandbox_rpc("SandboxCreate")) == DEFAULT_MAX_RETRIES + 2
        assert list(modal_server.sandboxes) == [handle]
        assert clock.sleeps == [0.5]

    @pytest.mark.parametrize("status", [Status.RESOURCE_EXHAUSTED, Status.UNAVAILABLE])
    def test_a_create_that_reached_modal_is_not_made_twice(self, make_hook, modal_server, status):
        """The reply is lost after the sandbox was made; whoever retries (the hook or the SDK) finds the name taken."""
        modal_server.fail_next(sandbox_rpc("SandboxCreate"), status, "reply lost", after=True)
        handle = make_hook().create(spec=SandboxSpec())
        assert list(modal_server.sandboxes) == [handle]
        first, second = modal_server.requests(sandbox_rpc("SandboxCreate"))[:2]
        assert first.definition.name == second.definition.name == modal_server.sandbox(handle).name

    def test_gives_up_within_the_budget(self, make_hook, modal_server, clock):
        modal_server.fail_next(sandbox_rpc("SandboxCreate"), Status.RESOURCE_EXHAUSTED, "down", times=100)
        start = clock.now
        with pytest.raises(SandboxTerminalError, match="kept failing while creating a sandbox"):
            make_hook().create(spec=SandboxSpec())
        assert clock.now - start <= modal_module.CREATE_BUDGET
        assert max(clock.sleeps) <= modal_module.MAX_BACKOFF

    def test_transient_tag_error_is_retried(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="d/r"))
        modal_server.fail_next(sandbox_rpc("SandboxTagsGet"), Status.RESOURCE_EXHAUSTED, "rate limited")
        assert hook.read_tags(handle)[OWNER_TAG] == "d/r"
        assert modal_server.count(sandbox_rpc("SandboxTagsGet")) == 2

    def test_commands_are_not_retried(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        modal_server.fail_next("TaskExecStart", Status.RESOURCE_EXHAUSTED, "busy")
        with pytest.raises(SandboxTerminalError, match="kept failing"):
            hook.run_command(handle, "echo once", timeout=10, max_output_bytes=100)
        assert modal_server.count("TaskExecStart") == 1


# -- commands ------------------------------------------------------------------------------------------


class TestRunCommand:
    def test_runs_through_sh_in_the_workdir(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        command = "printf part; printf 'ial\\n'; pwd >&2; exit 3"
        result = hook.run_command(handle, command, timeout=2.2, max_output_bytes=1000)
        (request,) = execs(modal_server)
        assert list(request.command_args) == ["sh", "-c", command]
        assert (request.timeout_secs, request.workdir) == (3, "/workspace")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "partial\n", "/workspace\n")
        assert not result.timed_out and not result.sandbox_terminated
        assert result.applied_timeout == 3.0

    def test_output_is_capped_per_stream(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        command = "i=0; while [ $i -lt 1000 ]; do printf 'line %04d\\n' $i; i=$((i+1)); done; printf short >&2"
        result = hook.run_command(handle, command, timeout=30, max_output_bytes=100)
        assert result.stdout_truncated and not result.stderr_truncated
        assert len(result.stdout.encode()) <= 100
        assert result.stdout.endswith("line 0999\n")
        assert result.stdout.startswith("line ")  # the partial first line was dropped
        assert result.stderr == "short"

    def test_timeout_keeps_the_sandbox_and_kills_what_the_command_started(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "kept.txt", b"kept across calls\n")
        command = "(sleep 5; echo late > late.txt) & echo partial; sleep 60"
        result = hook.run_command(handle, command, timeout=2, max_output_bytes=1000)
        assert result.timed_out and not result.sandbox_terminated
        assert (result.exit_code, result.applied_timeout, result.stdout) == (-1, 2.0, "partial\n")
        assert hook.read_file(handle, "kept.txt", max_bytes=100) == b"kept across calls\n"
        time.sleep(4)
        assert not modal_server.sandbox(handle).path("/workspace/late.txt").exists()  # the background job died too

    @pytest.mark.parametrize(("elapsed", "timed_out"), [(5.0, True), (4.2, False)])
    def test_137_past_the_deadline_is_a_timeout(self, elapsed, timed_out):
        """
        Modal may report a command it killed at its deadline as SIGKILL rather than -1. The installed
        SDK's own deadline always answers first (-1, as the stand-in shows), so the rule is checked
        on its own.
        """
        from sandbox_provider.hooks.modal import driver

        never = lambda: pytest.fail("the sandbox was polled")  # noqa: E731
        outcome = driver.classify_run(None, 137, elapsed=elapsed, seconds=5, ended=never, translate=never)
        assert outcome == (timed_out, False)

    def test_137_before_the_deadline_is_an_exit_status(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        result = hook.run_command(handle, "kill -9 $$", timeout=5, max_output_bytes=100)
        assert result.exit_code == 137 and not result.timed_out and not result.sandbox_terminated

    def test_deadline_is_cut_to_the_remaining_lifetime(self, make_hook, modal_server):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(500)
            result = hook.run_command(handle, "echo done", timeout=300, max_output_bytes=100)
            assert result.applied_timeout == 100.0 and result.stdout == "done\n"
            (request,) = execs(modal_server)
            assert request.timeout_secs == 100

    def test_timeout_at_the_end_of_life_reports_the_sandbox_ended(self, make_hook):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(597)
            result = hook.run_command(handle, "sleep 100", timeout=100, max_output_bytes=100)
            assert result.timed_out and result.sandbox_terminated and result.applied_timeout == 3.0

    def test_past_its_lifetime_is_terminal(self, make_hook, modal_server):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(601)
            with pytest.raises(SandboxTerminalError, match="end of its lifetime"):
                hook.run_command(handle, "true", timeout=10, max_output_bytes=100)
            assert execs(modal_server) == []

    @pytest.mark.parametrize("how", ["terminate", "expire"])
    def test_sandbox_ending_mid_command(self, make_hook, modal_server, how):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        ender = threading.Timer(1.5, getattr(modal_server, how), [handle])
        ender.start()
        try:
            result = hook.run_command(handle, "echo started; sleep 30", timeout=20, max_output_bytes=100)
        finally:
            ender.cancel()
        assert result.sandbox_terminated and result.stdout == "started\n" and not result.ok

    def test_gone_before_the_command(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        modal_server.terminate(handle)  # ended behind the hook's back
        # The SDK either starts the command on the sandbox's task (gone) or asks for the task first (finished).
        with pytest.raises(SandboxTerminalError, match="is gone|is shutting down"):
            hook.run_command(handle, "true", timeout=10, max_output_bytes=100)
        assert [r.task_id for r in execs(modal_server)] in ([], [modal_server.sandbox(handle).task_id])

    @pytest.mark.parametrize("handle", [None, "", "None"])
    def test_not_a_handle(self, make_hook, handle):
        with pytest.raises(ValueError, match="not a sandbox handle"):
            make_hook().run_command(handle, "true", timeout=1, max_output_bytes=1)

    def test_not_a_modal_id(self, make_hook, modal_server):
        with pytest.raises(SandboxTerminalError, match="start with 'sb-'"):
            make_hook().run_command("container-1", "true", timeout=1, max_output_bytes=1)
        assert modal_server.calls == []

    def test_unknown_sandbox(self, make_hook):
        missing = "sb-" + "0" * 22  # shaped like a real id, which some SDK releases check before asking Modal
        with pytest.raises(SandboxTerminalError, match=f"'{missing}' is gone"):
            make_hook().run_command(missing, "true", timeout=1, max_output_bytes=1)

    @pytest.mark.parametrize("kwargs", [{"timeout": 0, "max_output_bytes": 1}, {"timeout": 1, "max_output_bytes": 0}])
    def test_bad_limits(self, make_hook, kwargs):
        with pytest.raises(ValueError):
            make_hook().run_command("sb-x", "true", **kwargs)


# -- files ---------------------------------------------------------------------------------------------


class TestFiles:
    def test_write_then_read(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "sub/dir/data.bin", b"\x00\x01binary\xff")
        target = "/workspace/sub/dir/data.bin"
        assert helper_calls(modal_server, "WriteFile") == [target]  # the native API got an absolute path
        assert modal_server.sandbox(handle).path(target).read_bytes() == b"\x00\x01binary\xff"
        assert hook.read_file(handle, target, max_bytes=100) == b"\x00\x01binary\xff"
        assert hook.read_file(handle, "sub/dir/data.bin", max_bytes=11) == b"\x00\x01binary\xff"

    def test_read_over_the_cap(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "big.txt", b"x" * 5000)
        with pytest.raises(SandboxFileTooLargeError) as info:
            hook.read_file(handle, "big.txt", max_bytes=4999)
        assert (info.value.size_bytes, info.value.max_bytes) == (5000, 4999)

    def test_read_never_takes_more_than_the_cap(self, make_hook, modal_server):
        """A file whose size reads 0 yet holds more (as a file growing after the check would): max_bytes + 1 cross."""
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        with pytest.raises(SandboxFileTooLargeError):
            hook.read_file(handle, "/proc/self/status", max_bytes=100)
        (copy,) = list(modal_server.sandbox(handle).execs.values())
        assert copy.argv[2].endswith(" 100 head") and 'head -c "$((max + 1))"' in copy.argv[2]
        assert len(copy.output[1]) == 101

    @pytest.mark.parametrize(
        ("setup", "match"),
        [
            (None, "does not exist"),
            ("dir", "is a directory"),
            ("fifo", "not a regular file"),
        ],
    )
    def test_read_errors_are_recoverable(self, make_hook, modal_server, setup, match):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        path = modal_server.sandbox(handle).path("/workspace/thing")
        if setup == "dir":
            path.mkdir()
        elif setup == "fifo":
            os.mkfifo(path)
        with pytest.raises(SandboxError, match=match) as info:
            hook.read_file(handle, "thing", max_bytes=10)
        assert not isinstance(info.value, SandboxTerminalError)

    def test_import_streams_through_a_spool(self, make_hook, modal_server, monkeypatch):
        monkeypatch.setattr(modal_module, "STREAM_CHUNK_BYTES", 1000)
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())

        class Source(io.RawIOBase):
            def __init__(self):
                self.left = 10_500
                self.sizes: list[int] = []

            def read(self, n=-1):
                self.sizes.append(n)
                take = min(n, self.left)
                self.left -= take
                return b"z" * take

        source = Source()
        assert hook.import_file(handle, "in/data.csv", source) == 10_500
        assert max(source.sizes) == 1000
        assert modal_server.sandbox(handle).path("/workspace/in/data.csv").read_bytes() == b"z" * 10_500
        assert helper_calls(modal_server, "WriteFile") == ["/workspace/in/data.csv"]

    def test_export_streams_raw_bytes(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        payload = bytes(range(256)) * 2000
        hook.write_file(handle, "out.bin", payload)
        sink = io.BytesIO()
        assert hook.export_file(handle, "out.bin", sink, max_bytes=len(payload)) == len(payload)
        assert sink.getvalue() == payload
        with pytest.raises(SandboxFileTooLargeError):
            hook.export_file(handle, "out.bin", io.BytesIO(), max_bytes=len(payload) - 1)

    def test_export_of_a_file_that_changed(self, make_hook):
        """The size the guest reported is not what it sent (0 for a /proc file): the export is refused."""
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        with pytest.raises(SandboxError, match="changed while it was exported"):
            hook.export_file(handle, "/proc/self/status", io.BytesIO(), max_bytes=100_000)

    def test_file_op_when_the_sandbox_ended(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        modal_server.terminate(handle)
        with pytest.raises(SandboxTerminalError, match="is gone|is shutting down"):
            hook.read_file(handle, "f", max_bytes=100)  # the hook still holds the sandbox: its exec is refused
        with pytest.raises(SandboxTerminalError, match="has ended"):
            hook.write_file(handle, "f", b"x")  # looked up again: Modal says it has finished
        with pytest.raises(SandboxTerminalError, match="has ended"):
            hook.list_directory(handle)

    def test_list_directory(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "b.txt", b"1")
        hook.write_file(handle, "a/inner.txt", b"2")
        hook.run_command(handle, "ln -s /workspace/a link", timeout=10, max_output_bytes=100)
        assert hook.list_directory(handle) == [("a", True), ("b.txt", False), ("link", False)]
        assert hook.list_directory(handle, "a") == [("inner.txt", False)]
        assert helper_calls(modal_server, "ListFiles") == ["/workspace", "/workspace/a"]
        with pytest.raises(SandboxError, match="Listing 'nope'.*does not exist") as info:
            hook.list_directory(handle, "nope")
        assert not isinstance(info.value, SandboxTerminalError)

    def test_filesystem_errors_are_recoverable(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        with pytest.raises(SandboxError, match="permission denied") as info:
            hook.write_file(handle, "/usr/x", b"1")  # the image's /usr is read-only in the stand-in
        assert not isinstance(info.value, SandboxTerminalError)
        with pytest.raises(SandboxError, match="is a directory"):
            hook.write_file(handle, "/workspace", b"1")


# -- attaching from another task -----------------------------------------------------------------------


class TestAttach:
    def test_provision_then_attach_from_another_hook(self, make_hook, modal_server):
        with time_machine.travel(NOW, tick=False) as traveller:
            provisioner = make_hook(sandbox_timeout=1800, workdir="/data")
            handle = provisioner.create(spec=SandboxSpec(owner="dag/run"))
            traveller.shift(5)
            worker = make_hook()  # another task: knows nothing but the handle
            attached = worker.attach(handle, owner="dag/run", holder="dag/run/analyse")
            assert [r.sandbox_id for r in modal_server.requests(sandbox_rpc("SandboxWait"))][:1] == [handle]
            assert attached.remaining_lifetime == pytest.approx(1795)
            assert attached.workdir == "/data"
            assert attached.network == SandboxSpec()
            record = modal_server.sandbox(handle)
            assert record.tags[HOLDER_TAG] == "dag/run/analyse"
            assert worker.run_command(handle, "pwd", timeout=10, max_output_bytes=100).stdout == "/data\n"
            assert execs(modal_server)[-1].workdir == "/data"
            worker.release(handle, holder="dag/run/analyse")
            assert HOLDER_TAG not in record.tags
            assert record.result is None

    def test_wrong_owner_and_other_holder(self, make_hook):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        with pytest.raises(SandboxTerminalError, match="not owned by 'dag/other'"):
            make_hook().attach(handle, owner="dag/other", holder="h1")
        make_hook().attach(handle, owner="dag/run", holder="h1")
        make_hook().attach(handle, owner="dag/run", holder="h1")  # a retry of the same task
        with pytest.raises(SandboxTerminalError, match="held by 'h1'"):
            make_hook().attach(handle, owner="dag/run", holder="h2")

    def test_ended_sandbox_cannot_be_attached(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        modal_server.expire(handle)
        with pytest.raises(SandboxTerminalError, match="has ended"):
            make_hook().attach(handle, owner="dag/run", holder="h")

    def test_vanished_sandbox_is_terminal(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        modal_server.vanish(handle)
        with pytest.raises(SandboxTerminalError, match="is gone"):
            hook.read_tags(handle)

    def test_list_sandboxes_by_tags(self, make_hook, modal_server):
        etl = make_hook(tags={"dag_id": "etl"})
        mine = [etl.create(spec=SandboxSpec()) for _ in range(4)]  # more than one page of Modal's listing
        other = make_hook(tags={"dag_id": "other"}).create(spec=SandboxSpec())
        assert sorted(etl.list_sandboxes({"dag_id": "etl"})) == sorted(mine)
        assert sorted(etl.list_sandboxes()) == sorted([*mine, other])
        first = modal_server.requests(sandbox_rpc("SandboxList"))[0]
        assert {t.tag_name: t.tag_value for t in first.tags} == {"dag_id": "etl", "airflow_sandbox": "true"}
        etl.destroy(mine[0])
        assert sorted(etl.list_sandboxes({"dag_id": "etl"})) == sorted(mine[1:])


# -- teardown ------------------------------------------------------------------------------------------


class TestDestroy:
    def test_terminates_without_waiting(self, make_hook, modal_server):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.destroy(handle)
        assert [r.sandbox_id for r in modal_server.requests(sandbox_rpc("SandboxTerminate"))] == [handle]
        assert modal_server.calls[-1].rpc == sandbox_rpc("SandboxTerminate")  # no wait for it to stop
        assert modal_server.sandbox(handle).result.exitcode == 137

    def test_from_another_task_and_idempotent(self, make_hook, modal_server):
        handle = make_hook().create(spec=SandboxSpec())
        other = make_hook()
        other.destroy(handle)
        other.destroy(handle)
        modal_server.vanish(handle)
        other.destroy(handle)
        make_hook().destroy("sb-never-existed")

    def test_failure_is_logged_not_raised(self, make_hook, modal_server, caplog):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        modal_server.fail_next(sandbox_rpc("SandboxTerminate"), Status.INVALID_ARGUMENT, "boom")
        with caplog.at_level(logging.WARNING):
            hook.destroy(handle)
        assert handle in caplog.text and "boom" in caplog.text

    def test_not_a_handle(self, make_hook):
        with pytest.raises(ValueError):
            make_hook().destroy(None)


def test_test_connection_round_trip(make_hook, modal_server):
    ok, message = make_hook().test_connection()
    assert ok, message
    assert modal_server.sandbox().result is not None


def test_monotonic_clock_is_untouched_by_time_machine():
    hook = ModalSandboxHook()
    assert hook._monotonic is time.monotonic


def test_example_dags_parse_without_modal_or_a_connection(monkeypatch):
    import runpy

    from airflow.sdk import BaseHook

    def no_lookup(cls, *args, **kwargs):
        raise AssertionError("a connection was read while parsing the example Dags")

    def no_modal(self):
        raise AssertionError("Modal was contacted while parsing the example Dags")

    monkeypatch.setitem(sys.modules, "modal", None)  # "import modal" would fail
    monkeypatch.setattr(BaseHook, "get_connection", classmethod(no_lookup))
    monkeypatch.setattr(ModalSandboxHook, "get_conn", no_modal)
    path = os.path.join(os.path.dirname(modal_module.__file__), "..", "..", "example_dags", "example_sandbox_modal.py")
    found = runpy.run_path(path, run_name="example_sandbox_modal")
    artifact, attach = found["artifact_dag"], found["attach_dag"]
    assert artifact.dag_id == "example_sandbox_modal_artifact"
    assert set(artifact.task_dict) == {"summarise"}
    assert attach.dag_id == "example_sandbox_modal_attach"
    assert set(attach.task_dict) == {"provision", "analyse", "collect"}
    assert attach.task_dict["collect"].upstream_task_ids == {"analyse"}
    for task_id in ("provision", "analyse", "collect"):
        assert isinstance(attach.task_dict[task_id].backend, ModalSandboxHook)


def test_session_engine_provision_attach_export(make_hook, modal_server, tmp_path):
    """The guide's attach pattern through SandboxSession: provision, attach from a new hook, export, destroy."""
    from sandbox_provider.engine.session import SandboxSession

    with SandboxSession(
        make_hook(), spec=SandboxSpec(owner="dag/run"), files={"data/in.txt": "hello\n"}, keep=True
    ) as first:
        handle = first.ensure()
        assert first.run("cat data/in.txt > data/out.txt", timeout=30, max_output_bytes=1000).ok
    record = modal_server.sandbox(handle)
    assert record.result is None

    target = tmp_path / "exported" / "out.txt"
    with SandboxSession(
        make_hook(),
        attach_to=handle,
        owner="dag/run",
        holder="dag/run/collect",
        exports={"data/out.txt": target.as_uri()},
        keep=False,
    ) as second:
        assert second.ensure() == handle
        assert second.read_file("data/out.txt", max_bytes=100) == b"hello\n"
    assert target.read_bytes() == b"hello\n"
    assert record.result is not None
