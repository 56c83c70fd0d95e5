"""Crash-safe sandbox directories: atomic creation, destroy marks, the workspace removed last (removal itself: test_nofollow)."""

from __future__ import annotations

import os

import pytest

from sandbox_provider.hooks.local import state

HANDLE = "airflow-sandbox-0123456789ab"


def test_building_renames_into_place_or_leaves_nothing(tmp_path):
    root = str(tmp_path)
    with state.building(root, HANDLE, 0o700) as staging:
        assert os.path.basename(staging) == state.CREATING + HANDLE
        with state.claim(staging, wait=False) as got:
            assert not got  # the builder holds it
        state.write_record(staging, {"stamps": {"a": "1"}, "env": {"K": "v"}, "limits": {}})
    assert os.listdir(root) == [HANDLE]
    assert os.listdir(os.path.join(root, HANDLE)) == [state.RECORD]
    assert state.read_record(os.path.join(root, HANDLE)) == {"stamps": {"a": "1"}, "env": {"K": "v"}, "limits": {}}
    assert oct(os.stat(os.path.join(root, HANDLE, state.RECORD)).st_mode & 0o777) == "0o600"

    other = "airflow-sandbox-ba9876543210"
    with pytest.raises(RuntimeError), state.building(root, other, 0o700):
        raise RuntimeError("provisioning failed")
    assert os.listdir(root) == [HANDLE]


def test_an_interrupted_create_is_claimable_once_its_worker_is_gone(tmp_path):
    # A worker that dies inside building(): its directory stays, unlocked.
    pid = os.fork()
    if pid == 0:
        with state.building(str(tmp_path), HANDLE, 0o700):
            os._exit(9)
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    kinds = list(state.classify(str(tmp_path)))
    assert kinds == [("creating", HANDLE, str(tmp_path / (state.CREATING + HANDLE)))]
    with state.claim(kinds[0][2], wait=False) as got:
        assert got
        state.remove_sandbox_dir(kinds[0][2])
    assert os.listdir(tmp_path) == []


def test_mark_destroyed_and_classify(tmp_path):
    (tmp_path / HANDLE).mkdir()
    (tmp_path / "not-a-sandbox").mkdir()
    (tmp_path / ".destroyed-nonsense").mkdir()
    trash = state.mark_destroyed(str(tmp_path), HANDLE)
    assert trash == str(tmp_path / (state.DESTROYED + HANDLE))
    assert state.mark_destroyed(str(tmp_path), HANDLE) == trash  # a second destroy finds the trash
    assert list(state.classify(str(tmp_path))) == [("destroyed", HANDLE, trash)]
    state.remove_sandbox_dir(trash)
    assert state.mark_destroyed(str(tmp_path), HANDLE) is None


def test_the_workspace_goes_last(tmp_path, monkeypatch):
    sandbox = tmp_path / HANDLE
    for sub in ("workspace", "tmp"):
        (sandbox / sub).mkdir(parents=True)
    (sandbox / "workspace" / "result.txt").write_text("the job's data")
    (sandbox / "tmp" / "scratch").write_text("x")
    state.write_record(str(sandbox), {"stamps": {}, "env": {}, "limits": {}})
    real = state.remove_tree

    def interrupted(path):  # a worker killed as the removal reaches the workspace
        if path.endswith("/workspace"):
            raise KeyboardInterrupt
        real(path)

    monkeypatch.setattr(state, "remove_tree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        state.remove_sandbox_dir(str(sandbox))
    assert os.listdir(sandbox) == ["workspace"]
    assert (sandbox / "workspace" / "result.txt").read_text() == "the job's data"
    monkeypatch.setattr(state, "remove_tree", real)
    state.remove_sandbox_dir(str(sandbox))
    assert not sandbox.exists()


def test_box_on_a_sized_tmpfs_and_the_workspace_goes_last(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mounting needs a root worker")
    sandbox = tmp_path / HANDLE
    box = sandbox / state.BOX
    box.mkdir(parents=True)
    (sandbox / state.RECORD).write_text("{}")
    state.mount_box(str(box), size_bytes=1024 * 1024, uid=1_900_000_123, gid=1_900_000_123)
    try:
        info = os.stat(box)
        assert (info.st_uid, info.st_gid, oct(info.st_mode & 0o777)) == (1_900_000_123, 1_900_000_123, "0o700")
        with pytest.raises(OSError, match="No space left"), open(box / "big", "wb") as f:
            f.write(b"\0" * 2 * 1024 * 1024)
        os.unlink(box / "big")
        (box / "workspace").mkdir()
        (box / "workspace" / "result.txt").write_text("the job's data")
    finally:
        # A removal interrupted as it reaches the box: the worker's files are gone, the box whole.
        real = state._unmount

        def interrupted(path):
            raise KeyboardInterrupt

        monkeypatch.setattr(state, "_unmount", interrupted)
        with pytest.raises(KeyboardInterrupt):
            state.remove_sandbox_dir(str(sandbox))
        assert os.listdir(sandbox) == [state.BOX] and os.path.ismount(box)
        assert (box / "workspace" / "result.txt").read_text() == "the job's data"
        monkeypatch.setattr(state, "_unmount", real)
    state.remove_sandbox_dir(str(sandbox))
    assert not sandbox.exists()
