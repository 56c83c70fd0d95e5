"""
A directory export into an existing destination never writes through a link planted in it (issue 23,
item 2), on every backend that exports to the worker's disk here: the fake, local bubblewrap (its
``.partial`` directory written in place by the sandbox) and Docker (through the engine's sink).

Whoever can write into the destination plants ``DEST/sub -> victim`` (or deeper, or at a file's own
name); the sandbox writes ``out/sub/keep``. Each test first shows the plant works against a plain
path-based write (the publishing the engine did before, or ``open()``), then that the export fails
and changes nothing: not the victim, not the destination, no ``.partial`` left.
"""

from __future__ import annotations

import os

import pytest
from airflow.sdk import ObjectStoragePath

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.engine import publish as publishing
from sandbox_provider.engine.transfer import export_files, partial_tag
from sandbox_provider.sandbox import SandboxSession, SandboxTerminalError

STAMPS = {
    "airflow_dag_id": "d",
    "airflow_run_id": "r",
    "airflow_task_id": "t",
    "airflow_map_index": "-1",
    "airflow_try_number": "1",
}


@pytest.fixture(
    params=["fake", pytest.param("local", marks=requires_bwrap), pytest.param("docker", marks=pytest.mark.docker)]
)
def hook(request, tmp_path):
    if request.param == "fake":
        return FakeSandboxHook(str(tmp_path / "fake"))
    if request.param == "local":
        from sandbox_provider.hooks.local import LocalSandboxHook

        return LocalSandboxHook(state_root=str(tmp_path / "state"))
    from sandbox_provider.hooks.docker import DockerSandboxHook

    return DockerSandboxHook(request.getfixturevalue("docker_conn"), pull="never")


#: depth -> (the file the sandbox writes below out/, the planted link below DEST, where it leads in victim/)
PLANTS = {
    "child": ("sub/keep", "sub", ""),
    "deeper": ("a/b/keep", "a/b", ""),
    "file-name": ("keep", "keep", "keep"),
}


def plant(where, depth: str):
    """``where/dest`` (an existing destination with a file of its own) and ``where/victim/keep``, the link between."""
    _, link, leads_to = PLANTS[depth]
    victim = where / "victim"
    victim.mkdir(parents=True)
    (victim / "keep").write_text("root's own\n")
    dest = where / "dest"
    (dest / link).parent.mkdir(parents=True, exist_ok=True)
    (dest / "existing.txt").write_text("kept\n")
    (dest / link).symlink_to(victim / leads_to if leads_to else victim)
    return dest, victim


def snapshot(top) -> dict[str, str]:
    """Every path below ``top`` without following links: a file's text, a link's target, or 'dir'."""
    seen = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, top)
            if os.path.islink(path):
                seen[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                seen[rel] = "dir"
            else:
                with open(path) as f:
                    seen[rel] = f.read()
    return seen


def path_based_publish(partial, target, names) -> None:
    """How files were moved into an existing destination before: parents made and renamed by path."""
    for name in names:
        dest = os.path.join(target, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(os.path.join(partial, name), dest)


def show_the_plant_works(tmp_path, depth: str) -> None:
    """Positive control: on a second copy of the plant, a path-based write lands in the victim's file."""
    written, _, _ = PLANTS[depth]
    dest, victim = plant(tmp_path / "control", depth)
    if depth == "file-name":  # renaming over a link replaces it; a plain open() writes through it
        with open(dest / written, "w") as f:
            f.write("overwritten\n")
    else:
        staged = tmp_path / "control" / "staged"
        (staged / written).parent.mkdir(parents=True)
        (staged / written).write_text("overwritten\n")
        path_based_publish(staged, dest, [written])
    assert (victim / "keep").read_text() == "overwritten\n"


@pytest.mark.parametrize("depth", list(PLANTS))
def test_a_link_planted_below_the_destination_fails_the_export_and_changes_nothing(hook, tmp_path, depth):
    show_the_plant_works(tmp_path, depth)
    written, link, _ = PLANTS[depth]
    dest, victim = plant(tmp_path / "attack", depth)
    before = snapshot(tmp_path / "attack")
    command = f"mkdir -p out/{os.path.dirname(written) or '.'} && echo overwritten > out/{written} && echo n > out/new"
    with pytest.raises(SandboxTerminalError, match=rf"{dest}/{link} is a symbolic link.*Nothing was moved"):
        with SandboxSession(hook, exports={"out": dest.as_uri() + "/"}) as session:
            assert session.run(command, timeout=60, max_output_bytes=999).ok
    assert snapshot(tmp_path / "attack") == before  # the victim, the destination, and no .partial left
    assert (victim / "keep").read_text() == "root's own\n"


def test_without_a_link_the_same_export_merges_into_the_destination(hook, tmp_path):
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "existing.txt").write_text("kept\n")
    with SandboxSession(hook, exports={"out": dest.as_uri() + "/"}) as session:
        session.run(
            "mkdir -p out/sub/deeper && echo a > out/sub/keep && echo b > out/sub/deeper/x",
            timeout=60,
            max_output_bytes=99,
        )
    assert snapshot(dest) == {
        "existing.txt": "kept\n",
        "sub": "dir",
        "sub/keep": "a\n",
        "sub/deeper": "dir",
        "sub/deeper/x": "b\n",
    }
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_one_entry_meeting_a_link_moves_no_file_of_any_entry(tmp_path):
    hook = FakeSandboxHook(str(tmp_path / "fake"))
    handle = hook.create()
    hook.run_command(
        handle,
        "mkdir -p a b/sub && echo 1 > a/x && echo 2 > b/sub/keep && echo 3 > single",
        timeout=30,
        max_output_bytes=9,
    )
    clean, dest, victim = tmp_path / "clean", *plant(tmp_path / "attack", "child")
    exports = {"a": clean.as_uri() + "/", "b": dest.as_uri() + "/", "single": (tmp_path / "single").as_uri()}
    with pytest.raises(SandboxTerminalError, match="is a symbolic link.*Nothing was moved"):
        export_files(hook, handle, exports)
    assert not clean.exists() and not (tmp_path / "single").exists()  # checked before the first file moved
    assert (victim / "keep").read_text() == "root's own\n"
    assert sorted(os.listdir(tmp_path)) == ["attack", "fake"]
    assert sorted(os.listdir(tmp_path / "attack")) == ["dest", "victim"]  # b's .partial removed too


def test_a_link_planted_between_the_check_and_the_move_stops_the_move(tmp_path):
    dest, victim = plant(tmp_path / "attack", "child")
    (dest / "sub").unlink()  # not there yet when the batch is checked
    partial = tmp_path / "attack" / "dest.airflow-000000000000-1.partial"
    (partial / "sub").mkdir(parents=True)
    (partial / "sub" / "keep").write_text("overwritten\n")
    entry = publishing.Staged(
        "out",
        dest.as_uri() + "/",
        ObjectStoragePath(dest.as_uri()),
        ObjectStoragePath(partial.as_uri()),
        True,
        {"sub/keep": 12},
    )
    publishing.check(entry)
    (dest / "sub").symlink_to(victim)  # planted now
    with pytest.raises(SandboxTerminalError, match="sub is a symbolic link"):
        publishing.publish(entry)
    assert (victim / "keep").read_text() == "root's own\n"
    assert (partial / "sub" / "keep").exists()  # left for the engine to remove, not moved anywhere


@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_a_link_planted_at_the_partial_name_is_removed_not_written_through(tmp_path, directory):
    """Whoever can write the destination's directory can name this try's .partial: its name is predictable."""
    hook = FakeSandboxHook(str(tmp_path / "fake"))
    handle = hook.create()
    hook.run_command(handle, "mkdir d && echo new > d/f && echo new > f", timeout=30, max_output_bytes=9)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("root's own\n")
    key, try_number = partial_tag(STAMPS)
    name = "out" if directory else "out.csv"
    planted = tmp_path / f"{name}.airflow-{key}-{try_number}.partial"
    planted.symlink_to(victim if directory else victim / "f")
    # Positive control: a plain open of that name writes into the victim's file.
    with open(planted / "f" if directory else planted, "w") as f:
        f.write("written through\n")
    assert (victim / "f").read_text() == "written through\n"
    (victim / "f").write_text("root's own\n")
    url = (tmp_path / name).as_uri() + ("/" if directory else "")
    export_files(hook, handle, {("d" if directory else "f"): url}, stamps=STAMPS)
    assert (victim / "f").read_text() == "root's own\n" and sorted(os.listdir(victim)) == ["f"]
    assert (tmp_path / name / "f" if directory else tmp_path / name).read_text() == "new\n"
    assert not os.path.lexists(planted)


def test_a_file_exported_onto_a_link_to_a_directory_replaces_the_link(hook, tmp_path):
    """
    ``out.csv -> victim/`` planted where a file export goes: the file lands at ``out.csv`` (the link
    replaced), never inside ``victim`` (where a move by path, the store's ``mv``, put it).
    """
    handle = hook.create()
    try:
        hook.run_command(handle, "echo from-the-sandbox > f", timeout=30, max_output_bytes=9)
        victim = tmp_path / "victim"
        victim.mkdir()
        # Positive control: the store's move of a file onto that link lands inside the victim.
        (tmp_path / "control.csv").symlink_to(victim)
        (tmp_path / "moved").write_text("x")
        local = ObjectStoragePath((tmp_path / "moved").as_uri())
        local.fs.mv(local.path, str(tmp_path / "control.csv"))
        assert os.listdir(victim) == ["moved"]
        (victim / "moved").unlink()
        (tmp_path / "out.csv").symlink_to(victim)
        records = export_files(hook, handle, {"f": (tmp_path / "out.csv").as_uri()})
        assert records[0].size_bytes == len("from-the-sandbox\n")
        assert not (tmp_path / "out.csv").is_symlink()
        assert (tmp_path / "out.csv").read_text() == "from-the-sandbox\n" and os.listdir(victim) == []
    finally:
        hook.destroy(handle)


def test_a_directory_made_where_a_file_export_goes_after_it_was_planned_is_refused(tmp_path):
    """The plan refuses a directory at a file's destination; one made since is refused by the check before any
    file of the batch moves, and the rename refuses it too (the store's move put the file inside it)."""
    partial = tmp_path / "out.csv.airflow-000000000000-1.partial"
    partial.write_text("new\n")
    target = tmp_path / "out.csv"
    entry = publishing.Staged(
        "f", target.as_uri(), ObjectStoragePath(target.as_uri()), ObjectStoragePath(partial.as_uri()), False, {"": 4}
    )
    publishing.check(entry)  # nothing there yet
    target.mkdir()  # made since
    with pytest.raises(SandboxTerminalError, match=r"a directory is there, and a file export writes a file"):
        publishing.check(entry)
    with pytest.raises(IsADirectoryError):
        publishing.publish(entry)
    assert os.listdir(target) == [] and partial.read_text() == "new\n"
