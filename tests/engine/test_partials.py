"""
Partial files of an export are named for the task instance and try, and swept (issue 12, item 3), however
deep (issue 23, item 6).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from conftest import deep_tree
from fake_hook import FakeSandboxHook
from sandbox_provider.engine.publish import remove_partial
from sandbox_provider.engine.transfer import export_files, partial_tag, remove_stale_partials
from sandbox_provider.sandbox import SandboxSession

STAMPS = {
    "airflow_dag_id": "d",
    "airflow_run_id": "r",
    "airflow_task_id": "t",
    "airflow_map_index": "-1",
    "airflow_try_number": "2",
}


@pytest.fixture
def hook(tmp_path):
    return FakeSandboxHook(str(tmp_path / "fake"))


def test_the_partial_name_carries_the_task_instance_and_try(hook, tmp_path):
    seen = []
    real = hook.export_file

    def spy(handle, path, stream, *, max_bytes):
        seen.append(os.path.basename(stream.name))
        return real(handle, path, stream, max_bytes=max_bytes)

    hook.export_file = spy
    handle = hook.create()
    hook.write_file(handle, "a", b"A")
    export_files(hook, handle, {"a": (tmp_path / "x.csv").as_uri()}, stamps=STAMPS)
    key, try_number = partial_tag(STAMPS)
    assert seen == [f"x.csv.airflow-{key}-2.partial"] and try_number == 2 and len(key) == 12
    assert partial_tag({**STAMPS, "airflow_try_number": "3"})[0] == key  # one key for every try
    assert partial_tag({**STAMPS, "airflow_map_index": "0"})[0] != key  # another task instance
    assert sorted(os.listdir(tmp_path)) == ["fake", "x.csv"]


def test_the_next_export_removes_what_earlier_tries_left(hook, tmp_path):
    key = partial_tag(STAMPS)[0]
    earlier = tmp_path / f"x.csv.airflow-{key}-1.partial"
    earlier.write_bytes(b"half of try 1")
    other_task = tmp_path / f"x.csv.airflow-{'0' * 12}-1.partial"
    other_task.write_bytes(b"another task instance's live export")
    other_file = tmp_path / f"y.csv.airflow-{key}-1.partial"
    other_file.write_bytes(b"another destination")
    handle = hook.create()
    hook.write_file(handle, "a", b"A")
    export_files(hook, handle, {"a": (tmp_path / "x.csv").as_uri()}, stamps=STAMPS)
    assert not earlier.exists()
    assert other_task.exists() and other_file.exists()  # not this task instance's, or not this destination
    assert (tmp_path / "x.csv").read_bytes() == b"A"


def test_a_session_in_a_task_names_partials_for_its_try(hook, tmp_path):
    from unittest import mock

    context = {"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=2)}
    key = partial_tag(STAMPS)[0]
    (tmp_path / f"x.csv.airflow-{key}-1.partial").write_bytes(b"left by try 1")
    with SandboxSession(hook, exports={"a": (tmp_path / "x.csv").as_uri()}, context=context) as session:
        session.run("echo A > a", timeout=30, max_output_bytes=100)
    assert sorted(os.listdir(tmp_path)) == ["fake", "x.csv"]


def test_cleanup_entry_point_removes_old_partials_only(tmp_path):
    old = tmp_path / f"x.csv.airflow-{'a' * 12}-1.partial"
    old.write_bytes(b"old")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / f"x.csv.airflow-{'b' * 12}-1.partial"
    fresh.write_bytes(b"an export may still be writing this")
    unrelated = tmp_path / "notes.partial"
    unrelated.write_bytes(b"not ours")
    assert remove_stale_partials(tmp_path.as_uri() + "/") == [f"file://{old}"]
    assert fresh.exists() and unrelated.exists()
    # Named by destination, with no age limit: that destination's partials go, and only ours.
    (tmp_path / f"y.csv.airflow-{'c' * 12}-1.partial").write_bytes(b"y")
    assert remove_stale_partials((tmp_path / "x.csv").as_uri(), older_than=0) == [f"file://{fresh}"]
    assert sorted(os.listdir(tmp_path)) == ["notes.partial", f"y.csv.airflow-{'c' * 12}-1.partial"]


def test_cleanup_entry_point_refuses_a_path_that_is_no_url():
    with pytest.raises(ValueError, match="storage URL"):
        remove_stale_partials("/tmp/out")


# -- deep leftovers (issue 23, item 6) ---------------------------------------------------------------------


def _sweep(how: str, hook, folder) -> None:
    if how == "retry":  # the next try's export of that destination
        handle = hook.create()
        hook.run_command(handle, "mkdir -p out && echo A > out/a", timeout=30, max_output_bytes=9)
        export_files(hook, handle, {"out": (folder / "out").as_uri() + "/"}, stamps=STAMPS)
    elif how == "stale":
        assert remove_stale_partials(folder.as_uri() + "/", older_than=0) == [f"file://{folder}/{LEFT}"]
    else:  # what a failed export calls on each of its partial copies
        from airflow.sdk import ObjectStoragePath

        assert remove_partial(ObjectStoragePath((folder / LEFT).as_uri()))


LEFT = f"out.airflow-{partial_tag(STAMPS)[0]}-1.partial"


@pytest.mark.parametrize("how", ["retry", "stale", "failed-export"])
def test_a_3000_deep_partial_is_removed_by_every_sweep(hook, fast_dir, how):
    deep_tree(str(fast_dir / "control"), 3000)
    # Positive control: the standard library's recursive removal gives up on such a tree.
    with pytest.raises((RecursionError, OSError)):
        shutil.rmtree(fast_dir / "control")
    assert (fast_dir / "control" / "d").is_dir()
    shutil.move(fast_dir / "control", fast_dir / LEFT)
    (fast_dir / "victim").mkdir()
    (fast_dir / "victim" / "keep").write_text("x")
    os.symlink(fast_dir / "victim", fast_dir / LEFT / "d" / "link")  # removed, never followed
    _sweep(how, hook, fast_dir)
    assert not os.path.lexists(fast_dir / LEFT)
    assert (fast_dir / "victim" / "keep").read_text() == "x"
