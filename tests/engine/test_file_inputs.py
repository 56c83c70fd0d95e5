"""
file:// inputs: symlinks are followed, as the worker reads them; [sandbox] file_input_dirs confines them;
inside a directory input, a link is followed only to a file inside that directory.
"""

from __future__ import annotations

import os

import pytest

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.engine import storage
from sandbox_provider.engine.transfer import stage_entries
from sandbox_provider.sandbox import SandboxError, SandboxSession, SandboxTerminalError


def counting(made):
    """``made``, noting in ``made.provisioned`` the name of each sandbox it provisions."""
    made.provisioned = []
    real = made._provision
    made._provision = lambda request: made.provisioned.append(request.name) or real(request)
    return made


@pytest.fixture
def hook(tmp_path):
    return counting(FakeSandboxHook(str(tmp_path / "fake")))


@pytest.fixture
def tree(tmp_path):
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "data.csv").write_text("inside\n")
    (outside / "secret.txt").write_text("outside\n")
    os.symlink(outside / "secret.txt", allowed / "leads-out")
    os.symlink(allowed / "data.csv", outside / "leads-in")
    return allowed, outside


def staged(hook, url):
    with SandboxSession(hook, inputs={"in": url}) as session:
        return session.run("cat in", timeout=30, max_output_bytes=1000).stdout


def test_without_the_setting_symlinks_are_followed(hook, tree):
    allowed, _ = tree
    assert staged(hook, (allowed / "leads-out").as_uri()) == "outside\n"


def test_the_setting_allows_what_lies_inside(hook, tree, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", f"{allowed}, /nonexistent/too")
    assert staged(hook, (allowed / "data.csv").as_uri()) == "inside\n"
    assert staged(hook, (outside / "leads-in").as_uri()) == "inside\n"  # the file it reads lies inside


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("outside/secret.txt", r"outside the directories this worker stages files from \(\[sandbox\] file_input_dirs"),
        ("allowed/leads-out", r"allowed/leads-out \(which leads to .*outside/secret.txt\), outside the directories"),
        ("allowed/../outside/secret.txt", "outside the directories"),
    ],
)
def test_the_setting_refuses_what_lies_outside_before_provisioning(hook, tree, tmp_path, monkeypatch, name, message):
    allowed, _ = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", str(allowed))
    with pytest.raises(SandboxTerminalError, match=message):
        staged(hook, f"file://{tmp_path}/{name}")
    assert hook.provisioned == []


def test_a_relative_directory_in_the_setting_is_a_clear_error(hook, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", "data/incoming")
    with pytest.raises(SandboxTerminalError, match=r"absolute directories.*\['data/incoming'\]"):
        staged(hook, (allowed / "data.csv").as_uri())
    assert hook.provisioned == []


def test_the_setting_is_read_from_airflow_configuration(monkeypatch, tree):
    allowed, _ = tree
    monkeypatch.delenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", raising=False)
    from airflow.sdk.configuration import conf

    monkeypatch.setattr(
        conf, "get", lambda section, key, fallback=None: str(allowed) if section == "sandbox" else fallback
    )
    assert storage.file_input_dirs() == [str(allowed)]


def test_a_link_swapped_after_the_check_is_caught_on_the_open_file(tree, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", str(allowed))
    real = storage.resolve_file_input

    def checked_then_swapped(local, url, what, **kwargs):
        real(local, url, what, **kwargs)  # passes: inside the allowed directory
        return str(outside / "secret.txt")  # ...but by the time it is opened it leads outside

    monkeypatch.setattr(storage, "resolve_file_input", checked_then_swapped)
    with pytest.raises(SandboxTerminalError, match="changed while it was opened and now leads to .*secret.txt"):
        storage.open_file_input(str(allowed / "data.csv"), "file:///x", "inputs['in']")


def test_the_option_is_declared_to_airflow():
    from sandbox_provider.get_provider_info import get_provider_info

    option = get_provider_info()["config"]["sandbox"]["options"]["file_input_dirs"]
    assert option["default"] == "" and "symlink" in option["description"]


# -- links inside a directory input (issue 23, item 4) ---------------------------------------------------


@pytest.fixture(
    params=["fake", pytest.param("local", marks=requires_bwrap), pytest.param("docker", marks=pytest.mark.docker)]
)
def any_hook(request, tmp_path):
    """Each backend that stages the worker's files here, counting what it provisions."""
    if request.param == "fake":
        return counting(FakeSandboxHook(str(tmp_path / "fake")))
    if request.param == "local":
        from sandbox_provider.hooks.local import LocalSandboxHook

        return counting(LocalSandboxHook(state_root=str(tmp_path / "state")))
    from sandbox_provider.hooks.docker import DockerSandboxHook

    return counting(DockerSandboxHook(request.getfixturevalue("docker_conn"), pull="never"))


def _root_only(tmp_path):
    """A file only the worker's user may read, outside the directory inputs."""
    secret = tmp_path / "root-only.txt"
    secret.write_text("the worker's secret\n")
    secret.chmod(0o600)
    return secret


@pytest.fixture
def directory_with_a_leak(tmp_path):
    """``dir/`` holding a file, a link to it, and ``leak``: a link to a root-only file outside the directory."""
    secret = _root_only(tmp_path)
    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    (folder / "data.csv").write_text("inside\n")
    (folder / "sub" / "alias").symlink_to("../data.csv")
    (folder / "leak").symlink_to(secret)
    return folder, secret


def test_a_link_in_a_directory_input_leading_outside_it_is_refused(any_hook, directory_with_a_leak):
    folder, secret = directory_with_a_leak
    # Positive controls: the worker reads the secret through the link, and the secret named as an input
    # of its own (the author's choice) is staged.
    assert (folder / "leak").read_text() == "the worker's secret\n"
    assert staged(any_hook, secret.as_uri()) == "the worker's secret\n"
    any_hook.provisioned.clear()
    with pytest.raises(
        SandboxTerminalError, match=r"dir/leak is a symbolic link to .*root-only.txt, outside the directory"
    ):
        with SandboxSession(any_hook, inputs={"in": folder.as_uri() + "/"}) as session:
            session.run("cat in/leak", timeout=60, max_output_bytes=999)
    assert any_hook.provisioned == []  # refused before provisioning


def test_a_link_leading_inside_the_directory_input_is_followed(any_hook, directory_with_a_leak):
    folder, _ = directory_with_a_leak
    (folder / "leak").unlink()
    with SandboxSession(any_hook, inputs={"in": folder.as_uri() + "/"}) as session:
        result = session.run("cat in/sub/alias; test -L in/sub/alias || echo plain", timeout=60, max_output_bytes=999)
    assert result.stdout == "inside\nplain\n"


def test_a_link_retargeted_outside_after_the_walk_is_caught_when_opened(directory_with_a_leak):
    folder, secret = directory_with_a_leak
    (folder / "leak").unlink()
    entries = {entry.path: entry for entry in stage_entries({}, {"in": folder.as_uri() + "/"})}
    (folder / "sub" / "alias").unlink()
    (folder / "sub" / "alias").symlink_to(secret)
    # Positive control: the link now reaches the secret.
    assert (folder / "sub" / "alias").read_text() == "the worker's secret\n"
    with pytest.raises(SandboxTerminalError, match="outside the directory"):
        entries["in/sub/alias"].open()


def test_a_plain_file_swapped_for_a_link_after_the_walk_is_not_read_through_it(directory_with_a_leak):
    folder, secret = directory_with_a_leak
    (folder / "leak").unlink()
    entries = {entry.path: entry for entry in stage_entries({}, {"in": folder.as_uri() + "/"})}
    (folder / "data.csv").unlink()
    (folder / "data.csv").symlink_to(secret)
    # Positive control: by path, the name now reads the secret.
    assert (folder / "data.csv").read_text() == "the worker's secret\n"
    with pytest.raises(SandboxError, match="in/data.csv|data.csv"):
        entries["in/data.csv"].open()


def test_what_is_staged_is_the_listing_checked_before_provisioning(hook, tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "listed.txt").write_text("listed\n")
    with SandboxSession(hook, inputs={"in": folder.as_uri() + "/"}) as session:
        assert hook.provisioned == []
        (folder / "later.txt").write_text("added after the check\n")
        os.mkfifo(folder / "pipe")  # nor is a bad member added later met
        result = session.run("ls in", timeout=30, max_output_bytes=999)
    assert result.stdout == "listed.txt\n" and len(hook.provisioned) == 1


@pytest.mark.parametrize("files", [5, 40], ids=["few", "many"])  # many: the local backend's own tar archives them
def test_a_directory_swapped_for_a_link_after_the_walk_is_never_read_through(any_hook, tmp_path, files):
    source = tmp_path / "src"
    for i in range(files):
        (source / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (source / f"d{i % 4}" / f"f{i}.txt").write_text(f"file {i}\n")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "f0.txt").write_text("SECRET\n")  # as long as the file it stands in for: read whole if read
    (hidden / "f0.txt").chmod(0o600)
    entries = stage_entries({}, {"in": f"file://{source}/"})
    (source / "d0").rename(tmp_path / "d0-moved")
    (source / "d0").symlink_to(hidden)
    # Positive control: by path, the walked name now reads the secret.
    assert (source / "d0" / "f0.txt").read_text() == "SECRET\n"
    handle = any_hook.create()
    try:
        with pytest.raises(SandboxError, match="d0"):
            any_hook.import_batch(handle, entries)
        inside = any_hook.run_command(handle, "cat in/d0/f0.txt in/d1/f1.txt", timeout=60, max_output_bytes=999)
        assert "SECRET" not in inside.stdout
    finally:
        any_hook.destroy(handle)


# -- hard links inside a directory input ---------------------------------------------------------------


@pytest.fixture
def directory_with_a_hard_link(tmp_path):
    """``dir/`` holding ``data.csv`` (twice: ``copy.csv`` is a hard link to it) and ``leak``, a hard link to a
    root-only file outside the directory."""
    secret = _root_only(tmp_path)
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "data.csv").write_text("inside\n")
    os.link(folder / "data.csv", folder / "copy.csv")
    os.link(secret, folder / "leak")
    return folder, secret


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"), reason="needs root and setpriv")
def test_this_kernel_lets_no_user_hard_link_a_file_they_cannot_read(directory_with_a_hard_link, tmp_path):
    """What makes a hard link in a directory input harmless where fs.protected_hardlinks is 1 (this machine)."""
    import subprocess

    from sandbox_provider.engine.transfer import hard_links_protected

    folder, secret = directory_with_a_hard_link
    if not hard_links_protected():
        pytest.skip("this worker's kernel does not protect hard links (fs.protected_hardlinks=0)")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    mine = tmp_path / "nobody's.txt"
    mine.write_text("x")
    os.chown(mine, 65534, 65534)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "ln"]
    # Positive control: that user may link a file of its own; not root's.
    assert subprocess.run([*as_nobody, str(mine), str(shared / "own")], capture_output=True).returncode == 0
    refused = subprocess.run([*as_nobody, str(secret), str(shared / "leak")], capture_output=True, text=True)
    assert refused.returncode != 0 and "Operation not permitted" in refused.stderr


def test_a_hard_link_out_of_a_directory_input_is_refused_where_the_kernel_does_not_protect_them(
    any_hook, directory_with_a_hard_link, monkeypatch
):
    from sandbox_provider.engine import transfer

    folder, _ = directory_with_a_hard_link
    # Positive control: the link is the root-only file, and a kernel that protects hard links lets it be staged.
    monkeypatch.setattr(transfer, "hard_links_protected", lambda: True)
    with SandboxSession(any_hook, inputs={"in": folder.as_uri() + "/"}) as session:
        result = session.run("cat in/leak in/copy.csv", timeout=60, max_output_bytes=999)
    assert result.stdout == "the worker's secret\ninside\n"
    any_hook.provisioned.clear()
    monkeypatch.setattr(transfer, "hard_links_protected", lambda: False)
    with pytest.raises(SandboxTerminalError, match=r"dir/leak has 2 hard links, 1 of them outside the directory"):
        with SandboxSession(any_hook, inputs={"in": folder.as_uri() + "/"}) as session:
            session.run("true", timeout=60, max_output_bytes=999)
    assert any_hook.provisioned == []  # refused before provisioning
    (folder / "leak").unlink()  # every link of data.csv is inside: staged on such a kernel too
    with SandboxSession(any_hook, inputs={"in": folder.as_uri() + "/"}) as session:
        result = session.run("cat in/data.csv in/copy.csv", timeout=60, max_output_bytes=999)
    assert result.stdout == "inside\ninside\n"
