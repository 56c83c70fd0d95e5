"""Rules of the backend kit that every backend inherits: callbacks, keep without attach, extras, attach."""

from __future__ import annotations

import logging

import pytest

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox import SandboxSession, SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.settings import Setting, SettingsTable


class _NotAttachable(FakeSandboxHook):
    attachable = False


@requires_bwrap
def test_a_callback_that_raises_stops_the_command_at_once(tmp_path):
    from sandbox_provider.hooks.local import LocalSandboxHook

    hook = LocalSandboxHook(state_root=str(tmp_path / "s"))
    handle = hook.create()
    try:
        # Positive control: without the callback the command gets to its end.
        assert hook.run_command(handle, "echo a; sleep 1; touch after", timeout=30, max_output_bytes=100).ok
        hook.run_command(handle, "rm after", timeout=30, max_output_bytes=100)

        def interrupt(stream, data):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            hook.run_command(
                handle, "echo a; sleep 1; touch after", timeout=30, max_output_bytes=100, on_output=interrupt
            )
        check = hook.run_command(
            handle, "sleep 1.5; test -e after && echo ran || echo stopped", timeout=30, max_output_bytes=100
        )
        assert check.stdout == "stopped\n"
    finally:
        hook.destroy(handle)


def test_keep_on_a_backend_that_cannot_attach_is_refused_before_provisioning(tmp_path):
    hook = _NotAttachable(str(tmp_path))
    with pytest.raises(ValueError, match="keep_sandbox=True leaves the sandbox standing"):
        SandboxSession(hook, keep=True)
    assert hook.calls == []


def test_an_unknown_extra_is_named_with_the_nearest_setting(caplog):
    table = SettingsTable(Setting("memory_bytes", int, label="Memory", help="Bytes."))
    with caplog.at_level(logging.WARNING):
        assert table.resolve({}, {"memory_byte": 5, "empty": ""}, conn_id="c") == {"memory_bytes": None}
    assert "'memory_byte'" in caplog.text and "Did you mean 'memory_bytes'?" in caplog.text
    assert "'empty'" not in caplog.text


def test_attach_refuses_an_expired_sandbox_and_an_empty_holder(tmp_path):
    import time

    import time_machine

    hook = FakeSandboxHook(str(tmp_path), sandbox_timeout=5)
    handle = hook.create(spec=SandboxSpec(owner="d/r"))
    for owner, holder in (("d/r", ""), ("", "d/r/t"), ("d/r", None)):
        with pytest.raises(SandboxTerminalError, match="non-empty"):
            hook.attach(handle, owner=owner, holder=holder)
    assert hook.attach(handle, owner="d/r", holder="d/r/t").remaining_lifetime > 0
    hook.release(handle, holder="d/r/t")
    with time_machine.travel(time.time() + 10):
        with pytest.raises(SandboxTerminalError, match="end of its lifetime; it is not attached"):
            hook.attach(handle, owner="d/r", holder="d/r/t2")
    assert "airflow_holder" not in hook.read_tags(handle)


def test_local_paths_must_be_absolute(add_connection):
    from sandbox_provider.hooks.local import LocalSandboxHook

    for key in ("state_root", "image"):
        conn = add_connection(f"rel_{key}", "sandbox_local", extra={key: "relative/dir"})
        with pytest.raises(SandboxTerminalError, match=f"{key} must be an absolute path"):
            LocalSandboxHook(sandbox_conn_id=conn).create()
