"""The session engine with the real local backend: staging, exports all-or-nothing, teardown, attach."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local.hook import wait_for_removals
from sandbox_provider.sandbox import SandboxSession, SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.spec import HOLDER_TAG


@pytest.fixture
def hook(tmp_path):
    return LocalSandboxHook(state_root=str(tmp_path / "state"))


def sandboxes(hook):
    wait_for_removals()  # a session's destroy does not wait for the files to go
    return sorted(os.listdir(hook.state_root)) if os.path.isdir(hook.state_root) else []


def test_lazy_create_stage_run_export_destroy(hook, tmp_path):
    source = tmp_path / "in.csv"
    source.write_bytes(b"a,b\n1,2\n")
    out = tmp_path / "out" / "nested" / "result.txt"
    with SandboxSession(
        hook,
        files={"job.sh": "wc -l < data/in.csv > result.txt"},
        inputs={"data/in.csv": f"file://{source}"},
        exports={"result.txt": f"file://{out}"},
    ) as session:
        assert session.handle is None  # nothing provisioned before first use
        result = session.run("sh job.sh", timeout=30, max_output_bytes=1000)
        assert result.ok, result.stderr
        handle = session.handle
    assert out.read_text() == "2\n"
    assert [(r.path, r.size_bytes) for r in session.export_records] == [("result.txt", 2)]
    assert handle not in sandboxes(hook)
    assert [p.name for p in out.parent.iterdir()] == ["result.txt"]


def test_failing_second_export_changes_nothing(hook, tmp_path):
    first = tmp_path / "first.txt"
    first.write_text("earlier run")
    second = tmp_path / "second.txt"
    session = SandboxSession(hook, exports={"a.txt": f"file://{first}", "missing.txt": f"file://{second}"})
    with pytest.raises(SandboxTerminalError, match="Could not export 'missing.txt'.*does not exist"):
        with session:
            session.run("echo new > a.txt", timeout=30, max_output_bytes=100)
    assert first.read_text() == "earlier run"
    assert not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.txt", "state"]
    assert sandboxes(hook) == []


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("mkdir out", "is a directory"),
        ("ln -s /dev/zero out", "not a regular file"),
        ("head -c 2000 /dev/zero > out", "limit"),
    ],
)
def test_bad_export_sources_name_the_file(hook, tmp_path, setup, message):
    with pytest.raises(SandboxTerminalError, match=f"'out'.*{message}"):
        with SandboxSession(hook, exports={"out": f"file://{tmp_path}/o"}, max_export_bytes=1000) as session:
            session.run(setup, timeout=30, max_output_bytes=100)
    assert not (tmp_path / "o").exists()


def test_failed_job_exports_nothing_but_destroys(hook, tmp_path):
    with pytest.raises(RuntimeError):
        with SandboxSession(hook, exports={"a": f"file://{tmp_path}/a"}) as session:
            session.run("echo x > a", timeout=30, max_output_bytes=100)
            raise RuntimeError("job failed")
    assert not (tmp_path / "a").exists()
    assert sandboxes(hook) == []


def test_no_sandbox_standing_names_the_exports(hook, tmp_path):
    with pytest.raises(SandboxTerminalError, match="no sandbox standing.*'report.md'"):
        with SandboxSession(hook, exports={"report.md": f"file://{tmp_path}/r"}):
            pass


@pytest.mark.parametrize("url", ["", "relative/path.txt", "/abs/but/no/scheme", None, "file://relative"])
def test_bad_export_urls_refused_before_provisioning(hook, url):
    with pytest.raises(ValueError, match="exports"):
        SandboxSession(hook, exports={"a": url})
    assert sandboxes(hook) == []


def test_bad_arguments_refused(hook):
    with pytest.raises(ValueError, match="sandbox_owner applies to a sandbox shared"):
        SandboxSession(hook, owner="x")
    with pytest.raises(ValueError, match="spec cannot be combined"):
        SandboxSession(hook, attach_to="airflow-sandbox-000000000000", spec=SandboxSpec())
    with pytest.raises(SandboxTerminalError, match="not a sandbox handle"):
        SandboxSession(hook, attach_to="None")
    with pytest.raises(ValueError, match="path may not be empty"):
        SandboxSession(hook, files={"": "x"})
    with pytest.raises(ValueError, match="max_export_bytes"):
        SandboxSession(hook, max_export_bytes=0)
    with SandboxSession(hook) as session:
        with pytest.raises(ValueError, match="timeout"):
            session.run("true", timeout=-1, max_output_bytes=10)
    assert sandboxes(hook) == []


def test_keep_then_attach_then_collect(hook, tmp_path):
    with SandboxSession(hook, spec=SandboxSpec(owner="d/r"), keep=True, files={"in.txt": "42"}) as provision:
        handle = provision.ensure()
    assert sandboxes(hook) == [handle]
    with SandboxSession(hook, attach_to=handle, owner="d/r", holder="d/r/work") as work:
        assert work.attached.remaining_lifetime > 3000
        work.run("cat in.txt > out.txt", timeout=30, max_output_bytes=100)
    assert HOLDER_TAG not in hook.read_tags(handle)  # released, not destroyed
    with pytest.raises(SandboxTerminalError, match="not owned by 'd/other'"):
        SandboxSession(hook, attach_to=handle, owner="d/other", holder="d/other/x").open()
    with SandboxSession(
        hook,
        attach_to=handle,
        owner="d/r",
        holder="d/r/collect",
        keep=False,
        exports={"out.txt": f"file://{tmp_path}/o"},
    ):
        pass
    assert (tmp_path / "o").read_text() == "42"
    assert sandboxes(hook) == []


def test_attached_command_clamped_to_lifetime(tmp_path):
    import time_machine

    hook = LocalSandboxHook(state_root=str(tmp_path / "s"), sandbox_timeout=30)
    handle = hook.create(spec=SandboxSpec(owner="d/r"))
    with SandboxSession(hook, attach_to=handle, owner="d/r", holder="d/r/t") as session:
        result = session.run("true", timeout=300, max_output_bytes=10)
        assert result.applied_timeout is not None and result.applied_timeout <= 30
        with time_machine.travel(time.time() + 60, tick=True):
            with pytest.raises(SandboxTerminalError, match="end of its lifetime"):
                session.run("true", timeout=300, max_output_bytes=10)
    hook.destroy(handle)


def test_async_session(hook):
    async def main():
        async with SandboxSession(hook) as session:
            await session.awrite_file("x.txt", b"hi")
            result = await session.arun("cat x.txt", timeout=30, max_output_bytes=10)
            return result.stdout, await session.alist_directory(".")

    assert asyncio.run(main()) == ("hi", [("x.txt", False)])
    assert sandboxes(hook) == []


def test_spec_validation():
    with pytest.raises(ValueError, match=r"strings to strings.*\['PORT'\]"):
        SandboxSpec(env={"PORT": 8080})
    with pytest.raises(ValueError, match="narrow block_network=True"):
        SandboxSpec(block_network=False, allow_egress_to=["pypi.org"])
    with pytest.raises(ValueError, match="single string"):
        SandboxSpec(allow_egress_to="pypi.org")
    with pytest.raises(ValueError, match="True or False"):
        SandboxSpec(block_network="no")
    env = {"A": "1"}
    spec = SandboxSpec(env=env)
    env["A"] = "2"
    assert spec.env["A"] == "1"


def test_export_to_a_directory_is_refused_before_copying(hook, tmp_path):
    first = tmp_path / "first.txt"
    first.write_text("earlier")
    (tmp_path / "adir").mkdir()
    with pytest.raises(SandboxTerminalError, match="is a directory. Name a file"):
        with SandboxSession(hook, exports={"a": first.as_uri(), "b": (tmp_path / "adir").as_uri()}) as session:
            session.run("echo new > a; echo b > b", timeout=30, max_output_bytes=100)
    assert first.read_text() == "earlier"
    assert list((tmp_path / "adir").iterdir()) == []


def test_two_exports_to_one_destination_refused(hook, tmp_path):
    with pytest.raises(ValueError, match="sends both 'a' and 'b'"):
        SandboxSession(hook, exports={"a": f"file://{tmp_path}/x", "b": f"file://{tmp_path}/x"})


def test_unknown_scheme_refused_before_provisioning(hook):
    session = SandboxSession(hook, exports={"a": "nosuchscheme://bucket/key"})
    with pytest.raises(ValueError, match=r"exports\['a'\].*'nosuchscheme'"):
        session.open()
    assert session.handle is None and sandboxes(hook) == []


def test_empty_or_nul_paths_are_clear_errors(hook):
    from sandbox_provider.sandbox import SandboxError

    handle = hook.create()
    try:
        for bad in ("", "a\0b"):
            with pytest.raises(SandboxError, match="not a usable path"):
                hook.write_file(handle, bad, b"x")
            with pytest.raises(SandboxError, match="not a usable path"):
                hook.read_file(handle, bad, max_bytes=10)
        with pytest.raises(ValueError, match="whole, positive number of bytes"):
            hook.read_file(handle, "x", max_bytes=0.5)
    finally:
        hook.destroy(handle)


def test_listing_too_large_is_an_error_not_a_silent_cut(hook, monkeypatch):
    from sandbox_provider.sandbox import SandboxError
    from sandbox_provider.sandbox import files as hook_module

    handle = hook.create()
    try:
        hook.run_command(
            handle, "mkdir d; cd d; for i in $(seq 300); do : > file-$i; done", timeout=30, max_output_bytes=100
        )
        assert len(hook.list_directory(handle, "d")) == 300
        monkeypatch.setattr(hook_module, "LIST_OUTPUT_BYTES", 1000)
        with pytest.raises(SandboxError, match="more entries than one listing returns"):
            hook.list_directory(handle, "d")
    finally:
        hook.destroy(handle)


def test_async_session_inside_an_except_block_still_exports(hook, tmp_path):
    async def main():
        try:
            raise KeyError("handled before the session began")
        except KeyError:
            async with SandboxSession(hook, exports={"a": (tmp_path / "a").as_uri()}) as session:
                await session.arun("echo ok > a", timeout=30, max_output_bytes=10)

    asyncio.run(main())
    assert (tmp_path / "a").read_text() == "ok\n"


def test_closed_while_provisioning_tears_down_and_runs_nothing(hook):
    sessions = []

    class KilledDuringCreate(LocalSandboxHook):
        def create(self, *, spec=None):
            handle = super().create(spec=spec)
            sessions[0].close(succeeded=False)  # what on_kill does, in the thread it interrupts
            return handle

    killed = KilledDuringCreate(state_root=hook.state_root)
    session = SandboxSession(killed)
    sessions.append(session)
    with pytest.raises(SandboxTerminalError, match="closed while sandbox .* was being provisioned"):
        session.run("touch ran", timeout=30, max_output_bytes=10)
    assert sandboxes(hook) == []


def test_commands_with_nul_or_nothing_are_recoverable_errors(hook):
    from sandbox_provider.sandbox import SandboxError

    with SandboxSession(hook) as session:
        for bad in ("echo a\0b", "", "   "):
            with pytest.raises(SandboxError, match="cannot be run"):
                session.run(bad, timeout=5, max_output_bytes=10)
        assert session.handle is None


def test_export_never_replaces_a_device_or_pipe(hook, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SandboxTerminalError, match="not a regular file"):
        with SandboxSession(hook, exports={"a": fifo.as_uri()}) as session:
            session.run("echo x > a", timeout=30, max_output_bytes=10)
    import stat

    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # nothing was provisioned either


def test_an_input_that_is_a_device_is_refused(hook):
    with pytest.raises(SandboxTerminalError, match="/dev/zero is not a regular file"):
        with SandboxSession(hook, inputs={"zeros": "file:///dev/zero"}) as session:
            session.ensure()
    assert sandboxes(hook) == []
