"""Batch transfers on the local backend, against real bubblewrap: directories, globs, limits,
symlinks as the sandbox sees them, hostile files, all-or-nothing exports, and launch counts."""

from __future__ import annotations

import os
import stat
import sys
from unittest import mock

import pytest
from airflow.sdk import DAG, task

from conftest import requires_bwrap
from sandbox_provider.engine.session import SandboxSession
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.errors import SandboxTerminalError

pytestmark = requires_bwrap


@pytest.fixture
def counted(tmp_path):
    """
    A hook whose bubblewrap is a script that counts its sandbox launches, then runs the real one; the
    worker's own tar reading a walked directory (confined by bubblewrap to it) is noted apart.
    """
    real = next(p for p in (os.path.join(d, "bwrap") for d in os.environ["PATH"].split(":")) if os.access(p, os.X_OK))
    log = tmp_path / "launches"
    log.write_text("")
    log.chmod(0o666)  # a root worker's launches run the script as the sandbox's user
    wrapper = tmp_path / "bin" / "bwrap"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in " --help ") echo help ;; *" /walked "*) echo tar ;; *) echo x ;; esac >> {log}\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    os.chmod(tmp_path / "bin", 0o755)
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"), bwrap_path=str(wrapper))

    def launches(kind: str = "x") -> int:
        return log.read_text().splitlines().count(kind) if log.exists() else 0

    return hook, launches


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _session(hook, **options):
    return SandboxSession(hook, **options)


def test_directories_move_in_one_launch_each_way(counted, tmp_path):
    hook, launches = counted
    source = tmp_path / "in"
    _tree(source, {f"d{i % 7}/f{i}.txt": f"file {i}" for i in range(300)})
    (source / "link.txt").symlink_to(source / "d0" / "f0.txt")  # the worker follows the Dag author's links
    out = tmp_path / "out" / "tree"
    glob_out = tmp_path / "out" / "csv"
    before = launches()
    with _session(
        hook,
        inputs={"data": f"file://{source}/"},
        files={"pkg": {"__init__.py": "", "sub/mod.py": "X = 1\n"}, "one.txt": "one"},
        exports={"data": f"file://{out}/", "res/*.csv": f"file://{glob_out}/"},
    ) as session:
        result = session.run(
            "mkdir res && echo a > res/a.csv && echo b > res/b.csv && echo n > res/skip.txt && "
            "find data -type f | wc -l && cat pkg/sub/mod.py one.txt data/link.txt",
            timeout=60,
            max_output_bytes=4096,
        )
        assert result.ok, result.stderr
        assert result.stdout.split("\n")[:3] == ["301", "X = 1", "onefile 0"]
    assert launches() - before == 2  # staging with the command, then one export
    assert launches("tar") == 1  # the walked directory read by the worker's tar, confined to it
    assert sorted(p.name for p in glob_out.iterdir()) == ["a.csv", "b.csv"]
    assert (out / "d3" / "f10.txt").read_text() == "file 10"
    assert sum(1 for _ in out.rglob("*.txt")) == 301
    assert not [p for p in (tmp_path / "out").iterdir() if ".partial" in p.name]
    assert {r.path: r.size_bytes for r in session.export_records}["res/*.csv"] == 4


def test_an_existing_destination_directory_keeps_its_other_files(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    dest = tmp_path / "dest"
    _tree(dest, {"old.txt": "kept", "a.txt": "replaced"})
    hook.run_command(handle, "mkdir -p d/s && echo new > d/a.txt && echo s > d/s/b", timeout=30, max_output_bytes=99)
    from sandbox_provider.engine.transfer import export_files

    records = export_files(hook, handle, {"d": f"file://{dest}/"})
    assert (dest / "a.txt").read_text() == "new\n" and (dest / "old.txt").read_text() == "kept"
    assert (dest / "s" / "b").read_text() == "s\n" and records[0].size_bytes == 6


@pytest.fixture
def hook_and_sandbox(tmp_path):
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handle = hook.create(spec=SandboxSpec())
    yield hook, handle
    hook.destroy(handle)


def _export(hook, handle, exports, **kwargs):
    from sandbox_provider.engine.transfer import export_files

    return export_files(hook, handle, exports, **kwargs)


def test_symlinks_resolve_as_the_sandbox_sees_them(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    # Positive control: on the worker this path exists and holds something of the host's.
    assert os.path.exists("/etc/hostname") or os.path.exists("/etc/machine-id")
    host_file = "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/machine-id"
    hook.run_command(
        handle,
        "mkdir d && echo mine > /tmp/own && ln -s /tmp/own d/own && ln -s ../d d/loop-free-dir-link-target 2>/dev/null;"
        f" rm -f d/loop-free-dir-link-target; mkdir e && ln -s {host_file} e/host",
        timeout=30,
        max_output_bytes=999,
    )
    _export(hook, handle, {"d": f"file://{tmp_path}/d/"})
    assert (tmp_path / "d" / "own").read_text() == "mine\n"  # the sandbox's own /tmp, not the worker's
    assert not os.path.islink(tmp_path / "d" / "own")
    with pytest.raises(SandboxTerminalError, match="'e'") as err:
        _export(hook, handle, {"e": f"file://{tmp_path}/e/"})  # the host file is not there for the sandbox
    assert "host" in str(err.value)  # tar names the link whose target is missing
    assert not (tmp_path / "e").exists()


def test_hostile_files_and_a_missing_one_change_no_destination(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    hook.run_command(
        handle, "mkdir d && echo ok > d/ok && mkfifo d/pipe && echo f > good", timeout=30, max_output_bytes=99
    )
    (tmp_path / "good").write_text("before")
    with pytest.raises(SandboxTerminalError, match="not a regular file"):
        _export(hook, handle, {"good": f"file://{tmp_path}/good", "d": f"file://{tmp_path}/d/"})
    with pytest.raises(SandboxTerminalError, match="does not exist"):
        _export(hook, handle, {"good": f"file://{tmp_path}/good", "nope/": f"file://{tmp_path}/n/"})
    assert (tmp_path / "good").read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "state") == ["good"]


def test_limits_per_file_and_in_total(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    hook.run_command(
        handle, "mkdir d && head -c 100 /dev/zero > d/a && head -c 100 /dev/zero > d/b", timeout=30, max_output_bytes=9
    )
    with pytest.raises(SandboxTerminalError, match="more than the limit of 99 bytes"):
        _export(hook, handle, {"d": f"file://{tmp_path}/x/"}, max_bytes=99)
    with pytest.raises(SandboxTerminalError, match="more than the limit of 150 bytes"):
        _export(hook, handle, {"d": f"file://{tmp_path}/x/"}, max_total_bytes=150)
    assert not (tmp_path / "x").exists()
    assert [r.size_bytes for r in _export(hook, handle, {"d": f"file://{tmp_path}/x/"}, max_total_bytes=200)] == [200]


def test_a_device_reached_through_a_symlink_is_refused(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    hook.run_command(handle, "mkdir d && ln -s /dev/zero d/zero", timeout=30, max_output_bytes=9)
    with pytest.raises(SandboxTerminalError, match="device"):
        _export(hook, handle, {"d": f"file://{tmp_path}/x/"})
    assert not (tmp_path / "x").exists()


def test_staged_files_replace_a_symlink_rather_than_follow_it(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    hook.run_command(handle, "echo secret > /tmp/target && ln -s /tmp/target a", timeout=30, max_output_bytes=9)
    from sandbox_provider.engine.transfer import stage_files

    stage_files(hook, handle, {"a": "new", "b": {"c": "c"}})
    out = hook.run_command(handle, "cat /tmp/target a b/c; test -L a || echo plain", timeout=30, max_output_bytes=99)
    assert out.stdout == "secret\nnewcplain\n"


@task.sandbox
def add(a, b):
    return a + b


def test_task_sandbox_takes_one_launch(counted):
    hook, launches = counted
    ti = mock.MagicMock(dag_id="d", run_id="r", task_id="add", map_index=-1)
    with DAG("d", schedule=None) as dag:
        add.override(backend=hook)(2, 3)
    before = launches()
    assert dag.tasks[0].execute({"ti": ti, "run_id": "r"}) == 5
    assert launches() - before == 1  # files and command in one; the result read from the worker's side


def test_a_create_launches_nothing_the_first_command_is_the_probe(counted):
    hook, launches = counted
    handle = hook.create()
    assert launches() == 0  # no test launch of bwrap in the task: the first real launch shows it works
    assert hook.run_command(handle, "echo ok", timeout=30, max_output_bytes=99).stdout == "ok\n"
    assert launches() == 1
    hook.destroy(handle)


def test_a_worker_where_bubblewrap_cannot_build_a_sandbox_fails_the_first_command_with_its_reason(tmp_path):
    """
    The create no longer launches bwrap to see whether it works here; the first command is that
    launch, and a bwrap that cannot build the sandbox fails it saying why (a terminal error, never a
    command's exit status). The control: the same hook with the real bwrap runs the command.
    """
    from sandbox_provider.sandbox import SandboxTerminalError

    broken = tmp_path / "bin" / "bwrap"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    os.chmod(tmp_path / "bin", 0o755)
    real = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handle = real.create()
    assert real.run_command(handle, "echo ok", timeout=30, max_output_bytes=99).ok
    real.destroy(handle)
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"), bwrap_path=str(broken))
    handle = hook.create()
    with pytest.raises(SandboxTerminalError, match="could not set up the sandbox.*No permissions to create new"):
        hook.run_command(handle, "echo ok", timeout=30, max_output_bytes=99)
    hook.destroy(handle)
    assert os.listdir(tmp_path / "state") == []


def test_a_big_local_input_is_copied_whole(hook_and_sandbox, tmp_path):
    hook, handle = hook_and_sandbox
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    from sandbox_provider.engine.transfer import stage_inputs

    stage_inputs(hook, handle, {"big.bin": f"file://{big}"})
    import hashlib

    out = hook.run_command(handle, "sha256sum big.bin; stat -c %a big.bin", timeout=30, max_output_bytes=999)
    assert out.stdout.split()[0] == hashlib.sha256(big.read_bytes()).hexdigest()
    assert stat.S_IMODE(int(out.stdout.split()[2], 8)) & 0o600 == 0o600 and sys.platform == "linux"


def _staged_entry(path: str, data: bytes):
    import io

    from sandbox_provider.sandbox.batch import ImportEntry

    return ImportEntry(path=path, size=len(data), open=lambda: io.BytesIO(data))


def test_a_tiny_stage_is_written_by_the_worker_without_the_shell_and_tar(counted):
    """Two small files with the command: written straight into the workspace, the command's launch runs no tar."""
    hook, launches = counted
    handle = hook.create()
    stage = [_staged_entry("script.py", b"print(2 + 3)\n"), _staged_entry("/workspace/d/e/args.json", b"[2, 3]")]
    with mock.patch("sandbox_provider.sandbox.guest.program", side_effect=AssertionError("stage.sh ran")):
        result = hook.run_command(
            handle,
            "python3 script.py; cat d/e/args.json; stat -c '%u %a' script.py d d/e d/e/args.json",
            timeout=30,
            max_output_bytes=999,
            stage=stage,
        )
    uid = hook.uid_of(handle)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["5", "[2, 3]" + f"{uid} 644", f"{uid} 755", f"{uid} 755", f"{uid} 644"]
    assert launches() == 1
    hook.destroy(handle)


def test_a_tiny_stage_never_writes_through_a_link_the_sandbox_planted(counted, tmp_path):
    """
    A link the sandbox put where a staged file or directory goes: the worker does not follow it (nor
    write into the file it names); stage.sh's tar, as the sandbox's user, replaces the link. The
    control: without the links the worker writes the files itself (no tar).
    """
    hook, launches = counted
    handle = hook.create()
    secret = tmp_path / "worker-secret.txt"
    secret.write_text("the worker's\n")
    os.chmod(tmp_path, 0o755)
    plant = f"ln -s {secret} script.py && mkdir real && ln -s real d && ln -s /etc/passwd pw"
    assert hook.run_command(handle, plant, timeout=30, max_output_bytes=99).ok
    stage = [_staged_entry("script.py", b"print('staged')\n"), _staged_entry("d/args.json", b"[1]")]
    programs = []
    from sandbox_provider.sandbox import guest

    real_program = guest.program

    def counting(name):
        programs.append(name)
        return real_program(name)

    with mock.patch("sandbox_provider.sandbox.guest.program", side_effect=counting):
        result = hook.run_command(
            handle,
            "python3 script.py; test -L script.py || echo replaced",
            timeout=30,
            max_output_bytes=99,
            stage=stage,
        )
        assert result.stdout == "staged\nreplaced\n", result.stderr
        assert programs == ["stage.sh"]  # the link sent it to the sandbox's tar
        assert secret.read_text() == "the worker's\n"
        out = hook.run_command(handle, "cat real/args.json; test -L d && echo link", timeout=30, max_output_bytes=99)
        assert out.stdout == "[1]link\n"  # written through the sandbox's own link, as the sandbox sees it
        programs.clear()
        fresh = [_staged_entry("new/one.txt", b"1"), _staged_entry("two.txt", b"2")]
        assert (
            hook.run_command(handle, "cat new/one.txt two.txt", timeout=30, max_output_bytes=9, stage=fresh).stdout
            == "12"
        )
        assert programs == []  # the control: new names, written by the worker
    hook.destroy(handle)
