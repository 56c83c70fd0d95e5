"""The worker's trees through descriptors: links never followed below a chosen top; removal iterative and bounded."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import deep_tree
from sandbox_provider.sandbox.nofollow import Descent, LinkInTheWay, create_file, open_directory, remove_tree


@pytest.fixture
def planted(tmp_path):
    """``top/a/b`` real directories, ``top/a/link -> victim``, ``top/a/b/file-link -> victim/keep``."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("the victim's")
    top = tmp_path / "top"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "link").symlink_to(victim)
    (top / "a" / "b" / "file-link").symlink_to(victim / "keep")
    return top, victim


@pytest.mark.parametrize("parts", [["a", "link"], ["a", "link", "deeper"]])
def test_a_descent_refuses_a_link_on_its_way(planted, parts):
    top, victim = planted
    # Positive control: by path, the link leads into the victim's directory.
    assert os.listdir(os.path.join(top, *parts[:2])) == ["keep"]
    root = open_directory(str(top))
    try:
        with Descent(root) as descent, pytest.raises(LinkInTheWay) as refused:
            descent.to(parts, create=True)
        assert refused.value.filename == "a/link"
    finally:
        os.close(root)
    assert os.listdir(victim) == ["keep"]  # nothing made in there


def test_a_descent_makes_what_is_missing_and_reuses_what_it_holds(planted):
    top, _ = planted
    with Descent(open_directory(str(top)), own=True) as descent:
        assert descent.to(["a", "new", "deeper"]) is None
        made = descent.make(["a", "new", "deeper"])
        assert os.fstat(made).st_ino == os.stat(top / "a" / "new" / "deeper").st_ino
        assert descent.to(["a", "new", "deeper"]) == made  # nothing reopened
        (top / "a" / "file").write_text("x")
        with pytest.raises(NotADirectoryError):
            descent.to(["a", "file", "x"])


def test_a_new_file_is_never_made_through_a_link(planted):
    top, victim = planted
    root = os.open(top / "a" / "b", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            create_file(root, "file-link")
        with create_file(root, "fresh") as made:
            made.write(b"new")
    finally:
        os.close(root)
    assert (victim / "keep").read_text() == "the victim's"
    # Positive control: a plain open of that name writes into the victim's file.
    with open(top / "a" / "b" / "file-link", "w") as plain:
        plain.write("overwritten")
    assert (victim / "keep").read_text() == "overwritten"


# -- removal -----------------------------------------------------------------------------------------------


def test_a_5000_deep_tree_that_rmtree_cannot_remove(fast_dir):
    top = str(fast_dir / "deep")
    deep_tree(top, 5000)
    # Positive control: the standard library's recursive removal gives up on it.
    with pytest.raises((RecursionError, OSError)):
        shutil.rmtree(top)
    assert os.path.isdir(top)
    remove_tree(top)
    assert not os.path.exists(top)


def test_names_modes_and_flags_set_inside_do_not_block_removal(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    top = tmp_path / "box"
    (top / "a" / "b").mkdir(parents=True)
    for name in ("-rf", "with\nnewline", " ", "*", "..."):
        (top / "a" / name).write_text("x")
    (top / "a" / "link-out").symlink_to(outside)
    (top / "a" / "dir-link-out").symlink_to(tmp_path)
    os.mkfifo(top / "a" / "fifo")
    for i in range(2000):
        (top / "a" / "b" / f"f{i}").write_text("")
    (top / "a" / "b").chmod(0)
    (top / "a").chmod(0o500)
    if os.geteuid() == 0 and shutil.which("chattr"):
        (top / "sealed").write_text("x")
        (top / "log").write_text("x")
        subprocess.run(["chattr", "+i", str(top / "sealed")], check=True)
        subprocess.run(["chattr", "+a", str(top / "log")], check=True)
        # Positive control: the flags do block a plain unlink.
        with pytest.raises(PermissionError):
            os.unlink(top / "sealed")
    remove_tree(str(top))
    assert not top.exists()
    assert outside.read_text() == "keep me"


def test_a_link_to_remove_is_removed_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (tmp_path / "link").symlink_to(victim)
    remove_tree(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and (victim / "keep").exists()
    remove_tree(str(tmp_path / "missing"))  # missing is fine
    remove_tree(str(tmp_path / "missing-parent" / "x"))


def test_the_path_to_the_tree_may_pass_a_link(tmp_path):
    (tmp_path / "real" / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "via").symlink_to(tmp_path / "real")
    remove_tree(str(tmp_path / "via" / "tree"))  # the caller named this path: its links are followed
    assert os.listdir(tmp_path / "real") == []


def test_removal_never_leaves_its_file_system(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting needs a root worker")
    top = tmp_path / "sandbox"
    (top / "inner").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "t", str(top / "inner")], check=True)
    try:
        (top / "inner" / "kept").write_text("x")
        with pytest.raises(OSError, match="mount point"):
            remove_tree(str(top))
        assert (top / "inner" / "kept").exists()
    finally:
        subprocess.run(["umount", str(top / "inner")], check=True)
    remove_tree(str(top))
