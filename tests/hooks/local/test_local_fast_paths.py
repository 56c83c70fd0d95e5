"""The local backend's fast transfer paths, against real bubblewrap: a walked directory archived by the
worker's own tar, a big local file copied in by its descriptor, and directory exports the sandbox
writes into their ``.partial`` directory, checked by the worker afterwards (hostile launches too)."""

# ruff: noqa: F811 (the hook and sandbox fixtures of test_local are used by name)

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time

import pytest
from test_local import hook, sandbox  # noqa: F401 (the fixtures)

from conftest import requires_bwrap
from sandbox_provider.engine.transfer import export_files, stage_entries, stage_files, stage_inputs
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local import files as _local_files
from sandbox_provider.hooks.local import transfer as _local_transfer
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

pytestmark = requires_bwrap


def _run(hook, handle, command: str) -> str:
    result = hook.run_command(handle, command, timeout=60, max_output_bytes=1 << 20)
    assert result.ok, result.stderr
    return result.stdout


def _tree(root, count: int, names: tuple[str, ...] = ()) -> dict[str, bytes]:
    made = {}
    for i in range(count):
        made[f"d{i % 5}/f{i}.txt"] = f"file {i}\n".encode()
    for name in names:
        made[name] = f"odd {name!r}\n".encode()
    for name, data in made.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return made


def _digest_inside(hook, handle, directory: str) -> str:
    quoted = "'" + directory.replace("'", "'\\''") + "'"
    return _run(hook, handle, f"cd {quoted} && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum -z")


def _digest_here(root) -> str:
    lines = []
    for path in sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: os.fsencode(p.relative_to(root))):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  ./{path.relative_to(root)}\0")
    return "".join(lines)


# -- staging a walked directory with the worker's tar --------------------------------------------------


def test_a_walked_directory_goes_to_the_workers_tar_and_lands_whole(hook, sandbox, tmp_path, monkeypatch):
    source = tmp_path / "src"
    odd = ("-leading dash", "sp ace/x", "amp&back\\slash", "ünï", "comma,pipe|hash#")
    _tree(source, 60, odd)
    calls = []
    real = _local_transfer.archive_natively
    monkeypatch.setattr(_local_transfer, "archive_natively", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    special = "a&b\\c,d"  # characters the transform must escape, and its first delimiter
    unsayable = "we&ird\\dir,|#:;@%!~"  # every delimiter the transform could use: tarfile headers instead
    for target in ("plain", special, unsayable):
        stage_inputs(hook, sandbox, {target: f"file://{source}/"})
        assert _digest_inside(hook, sandbox, target) == _digest_here(source)
    assert calls == [65, 65]  # positive control: the first two went to the worker's tar, the third did not
    modes = _run(hook, sandbox, "stat -c %a plain/d0/f0.txt 'plain/-leading dash'").split()
    assert modes == ["644", "644"]


def test_an_absolute_sandbox_path_and_files_beside_it(hook, sandbox, tmp_path):
    source = tmp_path / "src"
    _tree(source, 40)
    entries = stage_entries({"/tmp/extra/one.txt": "one"}, {"/tmp/abs": f"file://{source}/"})
    assert _local_transfer.native_split(entries)[1]  # the walk goes natively, after the text file
    hook.import_batch(sandbox, entries)
    assert _digest_inside(hook, sandbox, "/tmp/abs") == _digest_here(source)
    assert _run(hook, sandbox, "cat /tmp/extra/one.txt") == "one"


def test_an_entry_landing_on_a_walked_path_keeps_the_order_of_the_mapping(hook, sandbox, tmp_path):
    source = tmp_path / "src"
    _tree(source, 40)
    entries = stage_entries({}, {"in": f"file://{source}/", "in/d0/f0.txt": f"file://{source}/d1/f1.txt"})
    assert _local_transfer.native_split(entries)[1] == []  # moving the walk last would change the winner
    hook.import_batch(sandbox, entries)
    assert _run(hook, sandbox, "cat in/d0/f0.txt") == "file 1\n"  # the later entry won, as it always did


def test_a_file_swapped_for_a_symlink_after_the_walk_goes_in_as_that_symlink(hook, sandbox, tmp_path):
    source = tmp_path / "src"
    _tree(source, 40)
    secret = tmp_path / "secret.txt"
    secret.write_text("worker secret\n")
    entries = stage_entries({}, {"in": f"file://{source}/"})
    victim = source / "d0" / "f0.txt"
    victim.unlink()
    victim.symlink_to(secret)
    # Positive control: following the link on the worker reaches the secret.
    assert victim.read_text() == "worker secret\n"
    hook.import_batch(sandbox, entries)
    inside = hook.run_command(sandbox, "readlink in/d0/f0.txt; cat in/d0/f0.txt", timeout=30, max_output_bytes=999)
    assert inside.stdout.splitlines()[0] == str(secret)
    assert "worker secret" not in inside.stdout  # the sandbox sees a dangling link, never the bytes


def test_a_walked_file_that_vanished_fails_the_staging(hook, sandbox, tmp_path):
    source = tmp_path / "src"
    _tree(source, 40)
    entries = stage_entries({}, {"in": f"file://{source}/"})
    (source / "d3" / "f3.txt").unlink()
    with pytest.raises(Exception, match="f3.txt"):
        hook.import_batch(sandbox, entries)


# -- a big local file by its descriptor ---------------------------------------------------------------


def test_a_big_local_file_goes_in_by_descriptor(hook, sandbox, tmp_path, monkeypatch):
    monkeypatch.setattr(_local_files, "DIRECT_COPY_BYTES", 1 << 20)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom((1 << 20) + 5))
    copied = []
    real = hook._import_direct
    monkeypatch.setattr(hook, "_import_direct", lambda h, e: copied.append(e.path) or real(h, e))
    (tmp_path / "s.txt").write_text("s")
    stage_inputs(hook, sandbox, {"b/big.bin": f"file://{big}", "small.txt": f"file://{tmp_path}/s.txt"})
    assert copied == ["b/big.bin"]
    out = _run(hook, sandbox, "sha256sum b/big.bin; cat small.txt")
    assert out.split()[0] == hashlib.sha256(big.read_bytes()).hexdigest() and out.endswith("s")


def test_a_big_source_that_changed_size_is_refused_and_nothing_lands(hook, sandbox, tmp_path, monkeypatch):
    monkeypatch.setattr(_local_files, "DIRECT_COPY_BYTES", 1 << 10)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 4096)
    entry = stage_entries({}, {"big.bin": f"file://{big}"})[0]
    big.write_bytes(b"x" * 5000)  # grew after its size was taken
    with pytest.raises(Exception, match="does not hold the 4096 bytes"):
        hook.import_batch(sandbox, [entry])
    assert _run(hook, sandbox, "ls -A") == ""


# -- directory exports written in place --------------------------------------------------------------


def test_an_export_in_place_gives_the_files_to_the_worker(hook, sandbox, tmp_path):
    _run(
        hook,
        sandbox,
        "mkdir -p d/s && echo a > d/a && cp /bin/true d/s/tool && chmod 4755 d/s/tool && chmod 700 d/s && "
        "printf 'x%.0s' $(seq 300) > d/big",
    )
    records = export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    out = tmp_path / "out"
    tool = out / "s" / "tool"
    assert records[0].size_bytes == 2 + 300 + os.path.getsize("/bin/true")
    assert stat.S_IMODE(tool.stat().st_mode) == 0o666 & ~_umask()  # no set-id bit, no exec bit
    assert stat.S_IMODE((out / "s").stat().st_mode) == 0o777 & ~_umask()
    assert {p.stat().st_uid for p in out.rglob("*")} | {out.stat().st_uid} == {os.geteuid()}
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_an_empty_directory_and_a_glob_matching_nothing_give_empty_directories(hook, sandbox, tmp_path):
    _run(hook, sandbox, "mkdir empty full && echo x > full/a.csv")
    records = export_files(hook, sandbox, {"empty": f"file://{tmp_path}/e/", "full/*.txt": f"file://{tmp_path}/g/"})
    assert [r.size_bytes for r in records] == [0, 0]
    assert list((tmp_path / "e").iterdir()) == [] and list((tmp_path / "g").iterdir()) == []


def test_more_files_than_the_limit_fail_and_leave_nothing(hook, sandbox, tmp_path, monkeypatch):
    from sandbox_provider.sandbox import batch

    _run(hook, sandbox, "mkdir d && cd d && touch $(seq 30)")
    monkeypatch.setattr(batch.ExportLimits, "__init__", _limits_with_files(20))
    with pytest.raises(SandboxTerminalError, match="more than 20 files"):
        export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def _limits_with_files(count: int):
    from sandbox_provider.sandbox import batch

    original = batch.ExportLimits.__init__

    def init(self, max_file_bytes, max_total_bytes, max_files=100_000):
        original(self, max_file_bytes, max_total_bytes, count)

    return init


def test_a_deep_tree_exports_and_a_failed_one_is_removed_whole(hook, sandbox, tmp_path):
    _run(hook, sandbox, "p=d; for i in $(seq 200); do p=$p/x; done; mkdir -p $p && echo deep > $p/f && mkfifo d/pipe")
    with pytest.raises(SandboxTerminalError, match="named pipe"):
        export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # the 200-deep partial is gone too
    _run(hook, sandbox, "rm d/pipe")
    export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    assert (tmp_path / "out" / "/".join(["x"] * 200) / "f").read_text() == "deep\n"


_PLANTED = '#!/bin/sh\necho ran >> /workspace/hostile-ran\nexec /usr/bin/{name} "$@"\n'


def test_programs_planted_on_the_dags_path_do_not_run_beside_worker_descriptors(tmp_path, monkeypatch):
    # The Dag author put the workspace first on PATH; the code in the sandbox planted tar and cat there.
    monkeypatch.setattr(_local_files, "DIRECT_COPY_BYTES", 1 << 10)
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handle = hook.create(spec=SandboxSpec(env={"PATH": "/workspace/bin:/usr/bin:/bin"}))
    try:
        stage_files(hook, handle, {"bin/tar": _PLANTED.format(name="tar"), "bin/cat": _PLANTED.format(name="cat")})
        _run(hook, handle, "chmod 755 bin/tar bin/cat && mkdir d && echo a > d/a && echo x | cat > /dev/null")
        assert _run(hook, handle, "/usr/bin/cat hostile-ran") == "ran\n"  # positive control: they run in commands
        big = tmp_path / "big.bin"
        big.write_bytes(b"b" * 4096)
        stage_inputs(hook, handle, {"big.bin": f"file://{big}"})  # by descriptor: the worker's cat only
        export_files(hook, handle, {"d": f"file://{tmp_path}/out/"})  # in place: the worker's tar only
        assert _run(hook, handle, "/usr/bin/cat hostile-ran") == "ran\n"
        assert (tmp_path / "out" / "a").read_text() == "a\n"
    finally:
        hook.destroy(handle)


def test_the_check_after_an_export_refuses_what_a_hostile_launch_could_leave(tmp_path):
    from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest

    limits = ExportLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 20)
    request = ExportRequest("d", "tree")
    for name, make in (
        ("symbolic link", lambda d: os.symlink("/etc/passwd", d / "passwd")),
        ("named pipe", lambda d: os.mkfifo(d / "pipe")),
    ):
        top = tmp_path / name.replace(" ", "-")
        (top / "sub").mkdir(parents=True)
        (top / "ok").write_text("ok")
        make(top / "sub")
        with pytest.raises(Exception, match=name):
            _local_files.adopt_in_place([str(top)], [request], limits)
    top = tmp_path / "setuid"
    top.mkdir()
    (top / "tool").write_text("x")
    os.chmod(top / "tool", 0o6777)
    assert _local_files.adopt_in_place([str(top)], [request], limits) == [{"tool": 1}]
    assert stat.S_IMODE((top / "tool").stat().st_mode) == 0o666 & ~_umask()


def test_a_file_swapped_for_a_link_while_adopted_is_refused_not_followed(tmp_path, monkeypatch):
    """The mode (and owner) the worker gives an exported file never lands on what a link swapped in leads to."""
    from sandbox_provider.sandbox.batch import ExportBudget, ExportLimits, ExportRequest

    victim = tmp_path / "victim"
    victim.write_text("the worker's")
    victim.chmod(0o604)
    top = tmp_path / "partial"
    top.mkdir()
    (top / "f").write_text("x")
    (top / "f").chmod(0o604)
    real = ExportBudget.admit

    def swapped_while_admitted(budget, request, name, size):
        (top / name).unlink()  # listed as a regular file; a link by the time it is made the worker's
        (top / name).symlink_to(victim)
        return real(budget, request, name, size)

    # Positive control: a chmod by name, as the adoption did it, changes the victim's mode.
    (tmp_path / "control").symlink_to(victim)
    os.chmod(tmp_path / "control", 0o644)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    victim.chmod(0o604)
    monkeypatch.setattr(ExportBudget, "admit", swapped_while_admitted)
    limits = ExportLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 20)
    with pytest.raises(SandboxError, match="'d/f' changed into something that is not a regular file"):
        _local_files.adopt_in_place([str(top)], [ExportRequest("d", "tree")], limits)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o604


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_wide_directory_exports_within_few_descriptors(hook, sandbox, tmp_path):
    import resource

    _run(hook, sandbox, "mkdir w && cd w && for i in $(seq 200); do mkdir d$i && echo $i > d$i/f; done")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = len(os.listdir("/proc/self/fd")) + 64  # far fewer than the 200 subdirectories
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
    try:
        records = export_files(hook, sandbox, {"w": f"file://{tmp_path}/out/"})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert records[0].size_bytes == sum(len(f"{i}\n") for i in range(1, 201))
    assert (tmp_path / "out" / "d200" / "f").read_text() == "200\n"


def test_an_export_past_its_total_stops_while_it_is_written(hook, sandbox, tmp_path):
    import threading

    # Sparse files cost the sandbox nothing and come out whole: 20 x 9 MiB against a 20 MiB total.
    _run(hook, sandbox, "mkdir s && for i in $(seq 20); do truncate -s 9M s/f$i; done")
    # Positive control: 180 MiB of data behind almost no disk in the sandbox.
    disk, apparent = map(int, _run(hook, sandbox, "du -sk s | cut -f1; du -sk --apparent-size s | cut -f1").split())
    assert disk < 1000 and apparent >= 180 * 1024
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            size = 0
            for partial in tmp_path.glob("*.partial"):
                # The export removes the partial tree once it stops: a walk may find it gone midway.
                with contextlib.suppress(OSError):
                    for path in partial.rglob("*"):
                        with contextlib.suppress(OSError):
                            size += path.lstat().st_size
            peak[0] = max(peak[0], size)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(SandboxTerminalError, match="more than the limit of 20971520 bytes"):
            export_files(hook, sandbox, {"s": f"file://{tmp_path}/out/"}, max_bytes=10 << 20, max_total_bytes=20 << 20)
    finally:
        done.set()
        watcher.join()
    assert peak[0] <= (20 << 20) + (10 << 20)  # the total, and at most one more member while tar was stopped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_export_directories_made_before_one_that_fails_are_removed(tmp_path):
    from sandbox_provider.sandbox.errors import SandboxError

    (tmp_path / "taken").mkdir()  # something is already where the second one goes
    with pytest.raises(SandboxError, match="Could not make the export directory"):
        _local_files.prepare_in_place([str(tmp_path / "first"), str(tmp_path / "taken")], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def _swap_after_prepare(monkeypatch, victim, names: dict[int, str]) -> None:
    """Between making the ``.partial`` directories and the launch, each is moved away and a link to ``victim``
    put at its name: what anyone who can write the destination's parent can do at that moment."""
    real = _local_files.prepare_in_place

    def prepare_then_swap(directories, uid):
        held = real(directories, uid)
        for fd, directory in zip(held, directories, strict=True):
            names[fd] = directory
            os.rename(directory, directory + ".moved")
            os.symlink(victim, directory)
        return held

    monkeypatch.setattr(_local_files, "prepare_in_place", prepare_then_swap)


def test_an_export_directory_swapped_for_a_link_before_the_launch_is_written_where_it_was_made(
    hook, sandbox, tmp_path, monkeypatch
):
    from sandbox_provider.hooks.local import plan as plans

    _run(hook, sandbox, "mkdir d && echo planted > d/a")
    victim = tmp_path / "victim"  # a directory the sandbox's user may write (a non-root worker: all of its own)
    victim.mkdir()
    if os.geteuid() == 0:
        os.chown(victim, hook.uid_of(sandbox), hook.uid_of(sandbox))
    names: dict[int, str] = {}
    _swap_after_prepare(monkeypatch, victim, names)

    def by_path(bwrap_argv, binds):  # the launch before: each directory bound by its name
        at = bwrap_argv.index("--remount-ro")
        extra = [arg for fd, dest in binds for arg in ("--bind", names[fd], dest)]
        return [*bwrap_argv[:at], *extra, *bwrap_argv[at:]]

    # Positive control: bound by name, the launch follows the link and the sandbox writes into the victim.
    with monkeypatch.context() as by_name:
        by_name.setattr(plans, "with_binds", by_path)
        with pytest.raises(SandboxError, match="was moved or replaced while the sandbox wrote"):
            export_files(hook, sandbox, {"d": f"file://{tmp_path}/control/"})
    assert (victim / "a").read_text() == "planted\n"
    (victim / "a").unlink()

    with pytest.raises(SandboxError, match="was moved or replaced while the sandbox wrote") as raised:
        export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    assert list(victim.iterdir()) == []  # the link was not followed
    moved = [p for p in tmp_path.iterdir() if p.name.endswith(".moved") and "out.airflow" in p.name]
    assert len(moved) == 1 and str(moved[0]) in str(raised.value)  # written where it was made, and named
    assert not (tmp_path / "out").exists()  # nothing published


def test_an_export_directory_replaced_before_it_is_opened_is_refused_and_left_alone(tmp_path, monkeypatch):
    made = tmp_path / "d.partial"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_text("someone else's")
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    real_open = os.open

    def open_after_swap(path, flags, *args, **kwargs):
        if path == str(made):  # between the worker's mkdir and its open
            os.rename(made, tmp_path / "ours")
            os.rename(theirs, made)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(_local_files.os, "open", open_after_swap)
    with pytest.raises(SandboxError, match="was replaced as soon as it was made"):
        _local_files.prepare_in_place([str(made)], None)
    monkeypatch.undo()
    assert (made / "keep").read_text() == "someone else's"  # not the worker's to remove


def test_a_bubblewrap_without_bind_fd_exports_through_the_worker(hook, sandbox, tmp_path, monkeypatch):
    from sandbox_provider.hooks.local import plan as plans

    old = tmp_path / "old-bwrap"  # one that lists its options without --bind-fd
    old.write_text("#!/bin/sh\necho 'usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]'\necho '    --bind SRC DEST'\n")
    old.chmod(0o755)
    assert plans.binds_by_descriptor(hook._bwrap()) and not plans.binds_by_descriptor(str(old))
    _run(hook, sandbox, "mkdir d && echo a > d/a")
    monkeypatch.setattr(plans, "binds_by_descriptor", lambda bwrap: False)
    monkeypatch.setattr(_local_files, "prepare_in_place", lambda *args: pytest.fail("no directory is bound"))
    records = export_files(hook, sandbox, {"d": f"file://{tmp_path}/out/"})
    assert records[0].size_bytes == 2 and (tmp_path / "out" / "a").read_text() == "a\n"


def test_the_descriptor_an_export_directory_is_mounted_by_does_not_reach_the_sandbox(hook, sandbox, tmp_path):
    """A directory descriptor of the worker's inside the sandbox would lead out of it (``/proc/self/fd/N/..``)."""
    import subprocess

    from sandbox_provider.sandbox.hook import OutputSink

    (tmp_path / "beside").write_text("the worker's\n")
    look = "ls /proc/self/fd/{fd}/.. 2>&1; for f in /proc/[0-9]*/fd/*; do readlink $f; done 2>/dev/null; true"
    # Positive control: a descriptor handed down that bubblewrap does not take leads out to the files beside it.
    opened = tmp_path / "opened"
    opened.mkdir()
    control = os.open(opened, os.O_RDONLY | os.O_DIRECTORY)
    plain = ["bwrap", "--unshare-user", "--unshare-pid", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin"]
    plain += ["--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev"]
    try:
        leaked = subprocess.run(
            [*plain, "--", "sh", "-c", look.format(fd=control)], pass_fds=[control], capture_output=True, text=True
        )
    finally:
        os.close(control)
    assert "beside" in leaked.stdout, leaked
    partial = tmp_path / "x.partial"
    partial.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(partial, hook.uid_of(sandbox), hook.uid_of(sandbox))
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sink = OutputSink(65536, None)
        argv = ["/bin/sh", "-c", look.format(fd=fd)]
        outcome = hook._exec(sandbox, argv, timeout=60, output=sink, binds=[(fd, "/.airflow-export/0")])
    finally:
        os.close(fd)
    assert outcome.exit_code == 0
    assert "beside" not in sink.out.text() and str(tmp_path) not in sink.out.text(), sink.out.text()
