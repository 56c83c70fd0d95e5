"""ModalSandboxHook against the fake ``modal`` module of ``fake_modal.py``: no network, no account."""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
import time

import fake_modal
import pytest
import time_machine

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
def fake(monkeypatch):
    """Install a fresh fake ``modal`` for the hook and for the Modal provider's ModalHook."""
    mod = fake_modal.build()
    monkeypatch.setitem(sys.modules, "modal", mod)
    monkeypatch.setitem(sys.modules, "modal.exception", mod.exception)
    provider = importlib.import_module("airflow.providers.modal.hooks.modal")
    monkeypatch.setattr(provider, "modal", mod)
    return mod


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_hook(fake, clock, tmp_path):
    def _make(**kwargs):
        kwargs.setdefault("modal_conn_id", None)
        kwargs.setdefault("workdir", str(tmp_path / "workspace"))
        hook = ModalSandboxHook(**kwargs)
        hook._monotonic = clock
        hook._sleep = clock.sleep
        return hook

    return _make


@pytest.fixture
def on_host(fake):
    """Run sandbox commands through the host's sh, so the hook's guest scripts run for real."""
    fake.Sandbox.run_on_host = True
    return fake


def only_sandbox(fake):
    (sandbox,) = fake.Sandbox.by_id.values()
    return sandbox


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

    def test_constructing_makes_no_modal_call(self, fake):
        ModalSandboxHook(modal_conn_id="not_defined_anywhere", cpu=2, tags={"dag_id": "d"})
        assert fake.Sandbox.create_calls == []
        assert fake.Sandbox.from_id_calls == []
        assert fake.Client.built == []
        assert fake.App.registry == {}

    def test_constructing_without_the_extra(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "modal", None)  # makes "import modal" fail
        hook = ModalSandboxHook(image="python:3.13-slim")
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        with pytest.raises(AirflowOptionalProviderFeatureException, match=r"airflow-provider-sandbox\[modal\]"):
            hook.create(spec=SandboxSpec())

    def test_accepts_a_modal_image(self, fake):
        image = fake.Image.from_registry("python:3.12-slim")
        assert ModalSandboxHook(image=image).image is image

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
    def test_create_passes_settings_and_stamps(self, make_hook, fake, tmp_path):
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
        sandbox = fake.Sandbox.by_id[handle]
        kwargs = sandbox.create_kwargs
        assert handle.startswith("sb-")
        assert kwargs["name"].startswith("airflow-sandbox-") and len(kwargs["name"]) == len("airflow-sandbox-") + 12
        assert kwargs["timeout"] == 1800
        assert kwargs["workdir"] == str(tmp_path / "workspace")
        assert kwargs["env"] == {"MODE": "test"}
        assert (kwargs["cpu"], kwargs["memory"], kwargs["gpu"], kwargs["cloud"]) == (2.0, 4096, "T4", "aws")
        assert kwargs["region"] == ["us-east", "us-west"]
        assert "idle_timeout" not in kwargs
        assert kwargs["image"].tag == "python:3.12-slim"
        assert kwargs["app"].name == "my-app"
        assert fake.App.registry["my-app"].lookups  # looked up, created because create_app_if_missing
        tags = kwargs["tags"]
        assert tags["airflow_sandbox"] == "true"
        assert tags["dag_id"] == "etl"
        assert tags[OWNER_TAG] == "etl/run1"
        assert tags[EXPIRES_AT_TAG] == str(int(NOW + 1800))
        assert tags[WORKDIR_TAG] == str(tmp_path / "workspace")
        assert decode_network_policy(tags[NETWORK_TAG]) == SandboxSpec()

    def test_idle_timeout_is_passed_without_owner(self, make_hook, fake):
        handle = make_hook(idle_timeout=300).create(spec=SandboxSpec())
        assert fake.Sandbox.by_id[handle].create_kwargs["idle_timeout"] == 300

    def test_app_not_created_when_told_not_to(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError, match="could not find"):
            make_hook(create_app_if_missing=False).create(spec=SandboxSpec())
        assert fake.Sandbox.create_calls == []

    @pytest.mark.parametrize("spec", [None, SandboxSpec(), SandboxSpec(block_network=True)])
    def test_default_blocks_everything(self, make_hook, fake, spec):
        handle = make_hook().create(spec=spec)
        kwargs = fake.Sandbox.by_id[handle].create_kwargs
        assert kwargs["block_network"] is True
        assert "outbound_cidr_allowlist" not in kwargs and "outbound_domain_allowlist" not in kwargs

    def test_open_network_passes_no_flag(self, make_hook, fake):
        handle = make_hook().create(spec=SandboxSpec(block_network=False))
        kwargs = fake.Sandbox.by_id[handle].create_kwargs
        assert not {"block_network", "outbound_cidr_allowlist", "outbound_domain_allowlist"} & set(kwargs)

    def test_hostnames_refused_under_strict(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError) as info:
            make_hook().create(spec=SandboxSpec(allow_egress_to=["pypi.org"]))
        message = str(info.value)
        for part in ("TLS", "443", "DNS", "egress_enforcement='sni'", "allow_egress_to_cidrs"):
            assert part in message
        assert fake.Sandbox.create_calls == []
        assert fake.Client.built == []

    def test_hostnames_under_sni(self, make_hook, fake):
        hook = make_hook(egress_enforcement="sni")
        handle = hook.create(spec=SandboxSpec(allow_egress_to=["PyPI.org", "*.pythonhosted.org", "pypi.org"]))
        kwargs = fake.Sandbox.by_id[handle].create_kwargs
        assert kwargs["outbound_domain_allowlist"] == ["pypi.org", "*.pythonhosted.org"]
        assert "block_network" not in kwargs

    @pytest.mark.parametrize(
        "host",
        ["https://pypi.org", "pypi.org:443", "pypi.org/simple", "localhost", "*.com", "*", "1.2.3.4", "a..b"],
    )
    def test_bad_hostnames_refused(self, make_hook, fake, host):
        with pytest.raises(SandboxTerminalError, match="not a hostname"):
            make_hook(egress_enforcement="sni").create(spec=SandboxSpec(allow_egress_to=[host]))
        assert fake.Sandbox.create_calls == []

    def test_cidrs(self, make_hook, fake):
        spec = SandboxSpec(allow_egress_to_cidrs=["203.0.113.10/32", "198.51.100.0/24", "8.8.8.8"])
        handle = make_hook().create(spec=spec)
        kwargs = fake.Sandbox.by_id[handle].create_kwargs
        assert kwargs["outbound_cidr_allowlist"] == ["203.0.113.10/32", "198.51.100.0/24", "8.8.8.8/32"]
        assert "block_network" not in kwargs and "outbound_domain_allowlist" not in kwargs

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
            ("example.com", "not an IPv4"),
        ],
    )
    def test_bad_cidrs_refused(self, make_hook, fake, cidr, match):
        with pytest.raises(SandboxTerminalError, match=match):
            make_hook().create(spec=SandboxSpec(allow_egress_to_cidrs=[cidr]))
        assert fake.Sandbox.create_calls == []

    def test_both_lists_warn(self, make_hook, fake, caplog):
        spec = SandboxSpec(allow_egress_to=["api.example.com"], allow_egress_to_cidrs=["203.0.113.0/24"])
        with caplog.at_level(logging.WARNING):
            handle = make_hook(egress_enforcement="sni").create(spec=spec)
        kwargs = fake.Sandbox.by_id[handle].create_kwargs
        assert kwargs["outbound_domain_allowlist"] == ["api.example.com"]
        assert kwargs["outbound_cidr_allowlist"] == ["203.0.113.0/24"]
        assert "port 443" in caplog.text

    def test_env_must_be_strings_even_if_the_spec_was_bypassed(self, make_hook, fake):
        spec = SandboxSpec()
        object.__setattr__(spec, "env", {"PORT": 8080, "OK": "x"})
        with pytest.raises(SandboxTerminalError, match=r"\['PORT'\].*str\(port\)"):
            make_hook().create(spec=spec)
        assert fake.Sandbox.create_calls == []

    def test_owner_with_idle_timeout_refused(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError, match="idle_timeout=300"):
            make_hook(idle_timeout=300).create(spec=SandboxSpec(owner="d/r"))
        assert fake.Sandbox.create_calls == []

    def test_create_failure_is_terminal(self, make_hook, fake):
        fake.Sandbox.create_errors.append(fake.exception.InvalidError("bad gpu"))
        with pytest.raises(SandboxTerminalError, match="bad gpu"):
            make_hook().create(spec=SandboxSpec())


# -- credentials ---------------------------------------------------------------------------------------


class TestCredentials:
    def test_connection_credentials_and_environment(self, make_hook, fake, add_connection):
        add_connection("team_modal", "modal", login="ak-abc", password="as-def", extra={"environment": "dev"})
        handle = make_hook(modal_conn_id="team_modal").create(spec=SandboxSpec())
        client = fake.Sandbox.by_id[handle].create_kwargs["client"]
        assert client.credentials == ("ak-abc", "as-def")
        assert fake.App.registry["airflow-sandbox"].lookups[0] == {
            "client": client,
            "environment_name": "dev",
        }

    def test_no_connection_uses_worker_config(self, make_hook, fake):
        handle = make_hook(modal_conn_id=None).create(spec=SandboxSpec())
        assert fake.Sandbox.by_id[handle].create_kwargs["client"].credentials is None

    def test_missing_default_connection_falls_back_to_worker_config(self, make_hook, fake):
        handle = make_hook(modal_conn_id="modal_default").create(spec=SandboxSpec())
        assert fake.Sandbox.by_id[handle].create_kwargs["client"].credentials is None

    def test_missing_named_connection(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError, match="'absent_conn' is not defined.*modal_conn_id=None"):
            make_hook(modal_conn_id="absent_conn").create(spec=SandboxSpec())
        assert fake.Sandbox.create_calls == []

    def test_half_filled_connection(self, make_hook, fake, add_connection):
        add_connection("half", "modal", login="ak-abc")
        with pytest.raises(SandboxTerminalError, match="half"):
            make_hook(modal_conn_id="half").create(spec=SandboxSpec())
        assert fake.Sandbox.create_calls == []

    def test_rejected_credentials_name_the_connection(self, make_hook, fake, add_connection):
        add_connection("team_modal", "modal", login="ak-abc", password="as-wrong")
        fake.Sandbox.create_errors.append(fake.exception.AuthError("token rejected"))
        with pytest.raises(SandboxTerminalError, match="rejected the credentials from Airflow connection 'team_modal'"):
            make_hook(modal_conn_id="team_modal").create(spec=SandboxSpec())

    def test_rejected_worker_credentials(self, make_hook, fake):
        fake.Client.errors.append(fake.exception.AuthError("no token"))
        with pytest.raises(SandboxTerminalError, match="worker's Modal configuration"):
            make_hook(modal_conn_id=None).create(spec=SandboxSpec())
        assert fake.Sandbox.create_calls == []

    def test_permission_denied_is_terminal(self, make_hook, fake):
        fake.Sandbox.create_errors.append(fake.exception.PermissionDeniedError("nope"))
        with pytest.raises(SandboxTerminalError, match="may not do this"):
            make_hook().create(spec=SandboxSpec())


# -- transient errors ----------------------------------------------------------------------------------


class TestRetries:
    def test_transient_create_error_is_retried(self, make_hook, fake, clock):
        fake.Sandbox.create_errors.extend([fake.exception.ConnectionError("reset"), fake.exception.InternalError("x")])
        handle = make_hook().create(spec=SandboxSpec())
        assert len(fake.Sandbox.create_calls) == 3
        assert handle in fake.Sandbox.by_id
        assert clock.sleeps == [0.5, 1.0]

    def test_a_create_that_reached_modal_is_not_made_twice(self, make_hook, fake):
        lost = fake.exception.ConnectionError("reply lost")
        lost.after_create = True
        name_taken = fake.exception.AlreadyExistsError("name taken")
        fake.Sandbox.create_errors.extend([lost, name_taken])
        handle = make_hook().create(spec=SandboxSpec())
        assert list(fake.Sandbox.by_id) == [handle]
        assert fake.Sandbox.by_id[handle].create_kwargs["name"] == fake.Sandbox.create_calls[1]["name"]

    def test_gives_up_within_the_budget(self, make_hook, fake, clock):
        fake.Sandbox.create_errors.extend(fake.exception.ServiceError("down") for _ in range(100))
        start = clock.now
        with pytest.raises(SandboxTerminalError, match="kept failing while creating a sandbox"):
            make_hook().create(spec=SandboxSpec())
        assert clock.now - start <= modal_module.CREATE_BUDGET
        assert max(clock.sleeps) <= modal_module.MAX_BACKOFF

    def test_transient_tag_error_is_retried(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="d/r"))
        fake.Sandbox.by_id[handle].tag_errors.append(fake.exception.ResourceExhaustedError("rate limited"))
        assert hook.read_tags(handle)[OWNER_TAG] == "d/r"

    def test_commands_are_not_retried(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.exec_errors.append(fake.exception.ConnectionError("reset"))
        with pytest.raises(SandboxTerminalError, match="kept failing"):
            hook.run_command(handle, "echo once", timeout=10, max_output_bytes=100)
        assert [c for c in sandbox.calls if c[0] == "exec"].__len__() == 1


# -- commands ------------------------------------------------------------------------------------------


class TestRunCommand:
    def test_runs_through_sh_in_the_workdir(self, make_hook, fake, tmp_path):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.processes.append(fake_modal.FakeProcess(3, [b"part", b"ial\n"], b"oops\n"))
        result = hook.run_command(handle, "echo partial; exit 3", timeout=2.2, max_output_bytes=1000)
        _name, args, kwargs = next(c for c in sandbox.calls if c[0] == "exec")
        assert args == ("sh", "-c", "echo partial; exit 3")
        assert kwargs == {"timeout": 3, "workdir": str(tmp_path / "workspace"), "text": False}
        assert (result.exit_code, result.stdout, result.stderr) == (3, "partial\n", "oops\n")
        assert not result.timed_out and not result.sandbox_terminated
        assert result.applied_timeout == 3.0

    def test_output_is_capped_per_stream(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        lines = [f"line {i:04d}\n".encode() for i in range(1000)]
        fake.Sandbox.by_id[handle].processes.append(fake_modal.FakeProcess(0, lines, b"short"))
        result = hook.run_command(handle, "seq", timeout=10, max_output_bytes=100)
        assert result.stdout_truncated and not result.stderr_truncated
        assert len(result.stdout.encode()) <= 100
        assert result.stdout.endswith("line 0999\n")
        assert result.stdout.startswith("line ")  # the partial first line was dropped
        assert result.stderr == "short"

    def test_timeout_keeps_the_sandbox(self, make_hook, on_host, tmp_path):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "kept.txt", b"kept across calls\n")
        sandbox = only_sandbox(on_host)
        sandbox.processes.append(fake_modal.FakeProcess(-1, [b"partial\n"]))
        result = hook.run_command(handle, "echo partial; sleep 60", timeout=2, max_output_bytes=1000)
        assert result.timed_out and not result.sandbox_terminated
        assert result.applied_timeout == 2.0
        assert result.stdout == "partial\n"
        assert hook.read_file(handle, "kept.txt", max_bytes=100) == b"kept across calls\n"

    def test_137_past_the_deadline_is_a_timeout(self, make_hook, fake, clock):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]

        class Slow(fake_modal.FakeProcess):
            def wait(self):
                clock.now += 5
                return 137

        sandbox.processes.append(Slow())
        result = hook.run_command(handle, "sleep 60", timeout=5, max_output_bytes=100)
        assert result.timed_out and not result.sandbox_terminated

    def test_137_before_the_deadline_is_an_exit_status(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        fake.Sandbox.by_id[handle].processes.append(fake_modal.FakeProcess(137))
        result = hook.run_command(handle, "kill -9 $$", timeout=5, max_output_bytes=100)
        assert result.exit_code == 137 and not result.timed_out and not result.sandbox_terminated

    def test_deadline_is_cut_to_the_remaining_lifetime(self, make_hook, fake):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(500)
            sandbox = fake.Sandbox.by_id[handle]
            sandbox.processes.append(fake_modal.FakeProcess(0, b"done"))
            result = hook.run_command(handle, "work", timeout=300, max_output_bytes=100)
            assert result.applied_timeout == 100.0
            assert [c for c in sandbox.calls if c[0] == "exec"][0][2]["timeout"] == 100

    def test_timeout_at_the_end_of_life_reports_the_sandbox_ended(self, make_hook, fake):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(550)
            fake.Sandbox.by_id[handle].processes.append(fake_modal.FakeProcess(-1))
            result = hook.run_command(handle, "sleep 100", timeout=100, max_output_bytes=100)
            assert result.timed_out and result.sandbox_terminated and result.applied_timeout == 50.0

    def test_past_its_lifetime_is_terminal(self, make_hook, fake):
        with time_machine.travel(NOW, tick=False) as traveller:
            hook = make_hook(sandbox_timeout=600)
            handle = hook.create(spec=SandboxSpec())
            traveller.shift(601)
            with pytest.raises(SandboxTerminalError, match="end of its lifetime"):
                hook.run_command(handle, "true", timeout=10, max_output_bytes=100)
            assert not [c for c in fake.Sandbox.by_id[handle].calls if c[0] == "exec"]

    def test_sandbox_dying_mid_command(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.processes.append(
            fake_modal.FakeProcess(0, [b"started\n"], wait_error=fake.exception.SandboxTerminatedError("gone"))
        )
        result = hook.run_command(handle, "work", timeout=10, max_output_bytes=100)
        assert result.sandbox_terminated and result.stdout == "started\n" and not result.ok

    def test_stream_breaking_with_the_sandbox_gone(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.processes.append(
            fake_modal.FakeProcess(-1, [b"a"], stdout_error=fake.exception.ServiceError("stream closed"))
        )
        sandbox.poll_result = 0
        result = hook.run_command(handle, "work", timeout=10, max_output_bytes=100)
        assert result.sandbox_terminated

    def test_killed_by_a_signal_with_the_sandbox_ended(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.processes.append(fake_modal.FakeProcess(137))
        sandbox.poll_result = 137
        result = hook.run_command(handle, "work", timeout=10, max_output_bytes=100)
        assert result.sandbox_terminated

    def test_gone_before_the_command(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        fake.Sandbox.by_id[handle].exec_errors.append(fake.exception.NotFoundError("no such sandbox"))
        with pytest.raises(SandboxTerminalError, match="is gone"):
            hook.run_command(handle, "true", timeout=10, max_output_bytes=100)

    @pytest.mark.parametrize("handle", [None, "", "None"])
    def test_not_a_handle(self, make_hook, handle):
        with pytest.raises(ValueError, match="not a sandbox handle"):
            make_hook().run_command(handle, "true", timeout=1, max_output_bytes=1)

    def test_not_a_modal_id(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError, match="start with 'sb-'"):
            make_hook().run_command("container-1", "true", timeout=1, max_output_bytes=1)
        assert fake.Sandbox.from_id_calls == []

    def test_unknown_sandbox(self, make_hook, fake):
        with pytest.raises(SandboxTerminalError, match="'sb-missing' is gone"):
            make_hook().run_command("sb-missing", "true", timeout=1, max_output_bytes=1)

    @pytest.mark.parametrize("kwargs", [{"timeout": 0, "max_output_bytes": 1}, {"timeout": 1, "max_output_bytes": 0}])
    def test_bad_limits(self, make_hook, kwargs):
        with pytest.raises(ValueError):
            make_hook().run_command("sb-x", "true", **kwargs)


# -- files ---------------------------------------------------------------------------------------------


class TestFiles:
    def test_write_then_read(self, make_hook, on_host, tmp_path):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "sub/dir/data.bin", b"\x00\x01binary\xff")
        target = str(tmp_path / "workspace" / "sub" / "dir" / "data.bin")
        calls = [c for c in only_sandbox(on_host).calls if c[0] == "filesystem.write_bytes"]
        assert calls[0][1][1] == target  # the native API got an absolute path
        assert hook.read_file(handle, target, max_bytes=100) == b"\x00\x01binary\xff"
        assert hook.read_file(handle, "sub/dir/data.bin", max_bytes=11) == b"\x00\x01binary\xff"

    def test_read_over_the_cap(self, make_hook, on_host):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "big.txt", b"x" * 5000)
        with pytest.raises(SandboxFileTooLargeError) as info:
            hook.read_file(handle, "big.txt", max_bytes=4999)
        assert (info.value.size_bytes, info.value.max_bytes) == (5000, 4999)

    def test_read_never_takes_more_than_the_cap(self, make_hook, fake):
        """A file that grows after its size was checked: the hook stops at max_bytes + 1."""
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        chunks = [b"y" * 64 for _ in range(100)]
        process = fake_modal.FakeProcess(0, chunks, b"sandbox-size:10\n")
        sandbox.processes.append(process)
        with pytest.raises(SandboxFileTooLargeError):
            hook.read_file(handle, "growing.log", max_bytes=100)
        script = [c for c in sandbox.calls if c[0] == "exec"][0][1][2]
        # the guest sends at most the cap plus one byte
        assert script.endswith(" 100 head") and 'head -c "$((max + 1))"' in script
        assert process.stdout.chunks_read == 2  # 128 bytes seen, nothing read after the cap was passed

    @pytest.mark.parametrize(
        ("setup", "match"),
        [
            (None, "does not exist"),
            ("dir", "is a directory"),
            ("fifo", "not a regular file"),
        ],
    )
    def test_read_errors_are_recoverable(self, make_hook, on_host, tmp_path, setup, match):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "anchor", b"")
        path = tmp_path / "workspace" / "thing"
        if setup == "dir":
            path.mkdir()
        elif setup == "fifo":
            os.mkfifo(path)
        with pytest.raises(SandboxError, match=match) as info:
            hook.read_file(handle, "thing", max_bytes=10)
        assert not isinstance(info.value, SandboxTerminalError)

    def test_import_streams_through_a_spool(self, make_hook, on_host, tmp_path, monkeypatch):
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
        assert (tmp_path / "workspace" / "in" / "data.csv").read_bytes() == b"z" * 10_500
        assert [c[0] for c in only_sandbox(on_host).calls].count("filesystem.copy_from_local") == 1

    def test_export_streams_raw_bytes(self, make_hook, on_host):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        payload = bytes(range(256)) * 200
        hook.write_file(handle, "out.bin", payload)
        sink = io.BytesIO()
        assert hook.export_file(handle, "out.bin", sink, max_bytes=len(payload)) == len(payload)
        assert sink.getvalue() == payload
        with pytest.raises(SandboxFileTooLargeError):
            hook.export_file(handle, "out.bin", io.BytesIO(), max_bytes=len(payload) - 1)

    def test_export_of_a_file_that_changed(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        fake.Sandbox.by_id[handle].processes.append(fake_modal.FakeProcess(0, b"abc", b"sandbox-size:10\n"))
        with pytest.raises(SandboxError, match="changed while it was exported"):
            hook.export_file(handle, "f", io.BytesIO(), max_bytes=100)

    def test_file_op_when_the_sandbox_ended(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        sandbox = fake.Sandbox.by_id[handle]
        sandbox.processes.append(fake_modal.FakeProcess(137))
        sandbox.poll_result = 137
        with pytest.raises(SandboxTerminalError, match="ended while reading"):
            hook.read_file(handle, "f", max_bytes=100)

    def test_list_directory(self, make_hook, on_host, tmp_path):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.write_file(handle, "b.txt", b"1")
        hook.write_file(handle, "a/inner.txt", b"2")
        os.symlink(tmp_path / "workspace" / "a", tmp_path / "workspace" / "link")
        assert hook.list_directory(handle) == [("a", True), ("b.txt", False), ("link", False)]
        assert hook.list_directory(handle, "a") == [("inner.txt", False)]
        with pytest.raises(SandboxError, match="Listing 'nope'.*does not exist") as info:
            hook.list_directory(handle, "nope")
        assert not isinstance(info.value, SandboxTerminalError)

    def test_filesystem_errors_are_recoverable(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        fake.Sandbox.by_id[handle].fs_errors["write_bytes"] = fake.exception.SandboxFilesystemPermissionError("ro")
        with pytest.raises(SandboxError, match="ro") as info:
            hook.write_file(handle, "/etc/x", b"1")
        assert not isinstance(info.value, SandboxTerminalError)


# -- attaching from another task -----------------------------------------------------------------------


class TestAttach:
    def test_provision_then_attach_from_another_hook(self, make_hook, fake, tmp_path):
        with time_machine.travel(NOW, tick=False) as traveller:
            provisioner = make_hook(sandbox_timeout=1800, workdir="/data")
            handle = provisioner.create(spec=SandboxSpec(owner="dag/run"))
            traveller.shift(5)
            worker = make_hook()  # another task: knows nothing but the handle
            attached = worker.attach(handle, owner="dag/run", holder="dag/run/analyse")
            assert fake.Sandbox.from_id_calls == [handle]
            assert attached.remaining_lifetime == pytest.approx(1795)
            assert attached.workdir == "/data"
            assert attached.network == SandboxSpec()
            sandbox = fake.Sandbox.by_id[handle]
            assert sandbox.tags[HOLDER_TAG] == "dag/run/analyse"
            worker.run_command(handle, "ls", timeout=10, max_output_bytes=10)
            assert [c for c in sandbox.calls if c[0] == "exec"][-1][2]["workdir"] == "/data"
            worker.release(handle, holder="dag/run/analyse")
            assert HOLDER_TAG not in sandbox.tags
            assert not sandbox.terminated

    def test_wrong_owner_and_other_holder(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        with pytest.raises(SandboxTerminalError, match="not owned by 'dag/other'"):
            make_hook().attach(handle, owner="dag/other", holder="h1")
        make_hook().attach(handle, owner="dag/run", holder="h1")
        make_hook().attach(handle, owner="dag/run", holder="h1")  # a retry of the same task
        with pytest.raises(SandboxTerminalError, match="held by 'h1'"):
            make_hook().attach(handle, owner="dag/run", holder="h2")

    def test_ended_sandbox_cannot_be_attached(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        fake.Sandbox.by_id[handle].poll_result = 0
        with pytest.raises(SandboxTerminalError, match="has ended"):
            make_hook().attach(handle, owner="dag/run", holder="h")

    def test_vanished_sandbox_is_terminal(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec(owner="dag/run"))
        fake.Sandbox.by_id[handle].tag_errors.append(fake.exception.NotFoundError("gone"))
        with pytest.raises(SandboxTerminalError, match="is gone"):
            hook.read_tags(handle)

    def test_list_sandboxes_by_tags(self, make_hook, fake):
        etl = make_hook(tags={"dag_id": "etl"})
        first = etl.create(spec=SandboxSpec())
        make_hook(tags={"dag_id": "other"}).create(spec=SandboxSpec())
        assert etl.list_sandboxes({"dag_id": "etl"}) == [first]
        assert len(etl.list_sandboxes()) == 2
        assert fake.Sandbox.list_calls[0]["tags"] == {"dag_id": "etl", "airflow_sandbox": "true"}


# -- teardown ------------------------------------------------------------------------------------------


class TestDestroy:
    def test_terminates_without_waiting(self, make_hook, fake):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        hook.destroy(handle)
        sandbox = fake.Sandbox.by_id[handle]
        assert ("terminate", (), {"wait": False}) in sandbox.calls
        assert sandbox.terminated

    def test_from_another_task_and_idempotent(self, make_hook, fake):
        handle = make_hook().create(spec=SandboxSpec())
        other = make_hook()
        other.destroy(handle)
        fake.Sandbox.by_id[handle].terminate_error = fake.exception.NotFoundError("already gone")
        other.destroy(handle)
        make_hook().destroy("sb-never-existed")

    def test_failure_is_logged_not_raised(self, make_hook, fake, caplog):
        hook = make_hook()
        handle = hook.create(spec=SandboxSpec())
        fake.Sandbox.by_id[handle].terminate_error = fake.exception.InvalidError("boom")
        with caplog.at_level(logging.WARNING):
            hook.destroy(handle)
        assert handle in caplog.text and "boom" in caplog.text

    def test_not_a_handle(self, make_hook):
        with pytest.raises(ValueError):
            make_hook().destroy(None)


def test_test_connection_round_trip(make_hook, fake):
    hook = make_hook()
    original = fake.Sandbox._make

    def make(sandbox_id, kwargs):
        sandbox = original(sandbox_id, kwargs)
        sandbox.processes.append(fake_modal.FakeProcess(0, b"sandbox-ok\n"))
        return sandbox

    fake.Sandbox._make = make
    ok, message = hook.test_connection()
    assert ok, message
    assert only_sandbox(fake).terminated


def test_monotonic_clock_is_untouched_by_time_machine(make_hook):
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


def test_session_engine_provision_attach_export(make_hook, on_host, tmp_path):
    """The guide's attach pattern through SandboxSession: provision, attach from a new hook, export, destroy."""
    from sandbox_provider.engine.session import SandboxSession

    first_hook = make_hook()
    with SandboxSession(
        first_hook, spec=SandboxSpec(owner="dag/run"), files={"data/in.txt": "hello\n"}, keep=True
    ) as first:
        handle = first.ensure()
        assert first.run("cat data/in.txt > data/out.txt", timeout=30, max_output_bytes=1000).ok
    sandbox = only_sandbox(on_host)
    assert not sandbox.terminated

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
    assert sandbox.terminated
