"""
Bad input is refused before anything is provisioned, and nothing is left half-written (issue 12).

Each refusal runs on every backend the machine has (the fake, local bubblewrap, Docker, and Modal through
its real SDK over the Modal stand-in): the backend's ``_provision`` must never be called, the message must say what to change,
and no destination, partial or temporary file may change.
"""

from __future__ import annotations

import os
import socket
from unittest import mock

import pytest
from modal_server import modal_server_fixture  # noqa: F401 - the Modal stand-in's fixture

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.engine.storage import check_storage_url
from sandbox_provider.engine.transfer import check_transfer_map
from sandbox_provider.hooks.local.hook import wait_for_removals
from sandbox_provider.operators.sandbox import SandboxOperator
from sandbox_provider.sandbox import SandboxSession, SandboxSpec, SandboxTerminalError

BACKENDS = [
    "fake",
    pytest.param("local", marks=requires_bwrap),
    pytest.param("docker", marks=pytest.mark.docker),
    "modal",
]


@pytest.fixture(params=BACKENDS)
def hook(request, tmp_path, monkeypatch):
    """A backend whose ``_provision`` fails the test if anything reaches it."""
    if request.param == "fake":
        made = FakeSandboxHook(str(tmp_path / "fake"))
    elif request.param == "local":
        from sandbox_provider.hooks.local import LocalSandboxHook

        made = LocalSandboxHook(state_root=str(tmp_path / "state"))
    elif request.param == "docker":
        from sandbox_provider.hooks.docker import DockerSandboxHook

        made = DockerSandboxHook(request.getfixturevalue("docker_conn"), pull="never")
    else:
        from sandbox_provider.hooks.modal import ModalSandboxHook

        request.getfixturevalue("modal_server")
        made = ModalSandboxHook(modal_conn_id=None)
    made.provisioned = []
    monkeypatch.setattr(made, "_provision", lambda req: made.provisioned.append(req) or pytest.fail("provisioned"))
    return made


@pytest.fixture
def out(tmp_path):
    """A destination directory; the test checks it is left exactly as it was."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "kept.txt").write_text("before")
    return folder


def listing(folder):
    return sorted((p.name, p.read_text() if p.is_file() else None) for p in folder.iterdir())


def run_operator(hook, **kwargs):
    context = {"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1)}
    op = SandboxOperator(task_id="t", backend=hook, command=kwargs.pop("command", "echo x > a"), **kwargs)
    op.render_template_fields(context)
    return op.execute(context)


# -- one spelling per destination ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    [
        "file:///D/x",
        "file:///D/./x",
        "file:///D/../D/x",
        "file:///D//x",
        "file:////D/x",
        "file://localhost/D/x",
        "FILE:///D/x",
        "file:///D/sub/../x",
    ],
)
def test_every_spelling_of_a_local_file_is_one_url(spelling):
    assert check_storage_url(spelling, "exports['a']", export=True) == "file:///D/x"


def test_duplicate_destinations_are_refused_naming_both_spellings():
    with pytest.raises(ValueError) as caught:
        check_transfer_map({"a": "file:///D/x", "b": "file:///D/./x"}, "exports", urls=True)
    message = str(caught.value)
    assert "'a' and 'b'" in message and "file:///D/x and file:///D/./x" in message
    assert "give each its own destination" in message


def test_percent_escapes_name_other_files_as_storage_reads_them(tmp_path):
    # ObjectStoragePath writes "%78" as three characters, so it is not "x": two destinations, both written.
    hook = FakeSandboxHook(str(tmp_path / "fake"))
    with SandboxSession(hook, exports={"a": f"file://{tmp_path}/%78", "b": f"file://{tmp_path}/x"}) as session:
        session.run("echo A > a; echo B > b", timeout=30, max_output_bytes=100)
    assert (tmp_path / "%78").read_text() == "A\n" and (tmp_path / "x").read_text() == "B\n"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://otherhost/D/x", "names the host 'otherhost'.*file:///path/to/file"),
        ("file:///D/x/", "ends with '/' and so names a directory"),
        ("s3://bucket/a/../x", r"holds '\.', '\.\.' or an empty segment.*Write the key without them"),
        ("s3://bucket/a//x", "empty segment"),
        ("s3:///x", "names no bucket"),
        ("file:///D/x\0y", "NUL character"),
        ("file:///", "not a storage URL|names the root"),
        ("file:///D/" + "n" * 250, r"longer than the 2\d\d bytes.*\.partial sibling"),
        ("file:///" + "d/" * 2100 + "x", "longer than the"),
    ],
)
def test_bad_export_urls_say_what_to_change(url, message):
    with pytest.raises(ValueError, match=message):
        check_storage_url(url, "exports['a']", export=True)


def test_an_object_store_key_is_kept_as_written():
    assert check_storage_url("S3://bucket/a/b.csv", "x", export=True) == "s3://bucket/a/b.csv"
    assert check_storage_url("s3://bucket/a/./b", "x") == "s3://bucket/a/./b"  # inputs read what is there


def test_file_url_four_slashes_lands_at_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hook = FakeSandboxHook(str(tmp_path / "fake"))
    target = tmp_path / "abs" / "x"
    with SandboxSession(hook, exports={"a": f"file:///{target}"}) as session:  # file:////tmp/...
        session.run("echo A > a", timeout=30, max_output_bytes=100)
    assert target.read_text() == "A\n"
    assert not (tmp_path / str(tmp_path).lstrip("/")).exists()  # nothing relative to the working directory


# -- refused before provisioning, on every backend --------------------------------------------------------


def _fifo(folder):
    path = folder / "fifo"
    os.mkfifo(path)
    return path.as_uri()


def _socket(folder):
    path = folder / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()
    return path.as_uri()


def _directory(folder):
    (folder / "adir").mkdir()
    return (folder / "adir").as_uri()


def _below_a_file(folder):
    return (folder / "kept.txt").as_uri() + "/inner/x"


@pytest.mark.parametrize(
    ("make_url", "message"),
    [
        (_fifo, "is a named pipe, not a regular file"),
        (_socket, "is a socket, not a regular file"),
        (lambda folder: "file:///dev/null", "is a character device"),
        (_directory, "it is a directory. Name a file"),
        (_below_a_file, r"kept.txt is a file, not a directory"),
    ],
)
def test_destinations_an_export_cannot_write_are_refused_before_provisioning(hook, out, make_url, message):
    url = make_url(out)
    before = listing(out)
    with pytest.raises(SandboxTerminalError, match=message):
        run_operator(hook, exports={"a": url})
    assert hook.provisioned == [] and listing(out) == before
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_one_file_through_a_symlinked_directory_is_a_duplicate(hook, out, tmp_path):
    os.symlink(out, tmp_path / "link")
    with pytest.raises(ValueError, match=r"'a' to .*/out/x and 'b' to .*/link/x, which are one file"):
        run_operator(hook, exports={"a": (out / "x").as_uri(), "b": f"file://{tmp_path}/link/x"})
    assert hook.provisioned == [] and listing(out) == [("kept.txt", "before")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"files": {"a\0b": "x"}}, "NUL character"),
        ({"inputs": {"x" * 300: "file:///etc/hostname"}}, "over 255 bytes"),
        ({"exports": {"/".join(["d"] * 2100): "file:///tmp/x"}}, "more than 4095 bytes"),
        ({"files": {"a": "1"}, "inputs": {"./a": "file:///etc/hostname"}}, r"files\['a'\] and inputs\['./a'\] both"),
        ({"exports": {"a": "file:///tmp/x\0"}}, "NUL character"),
    ],
)
def test_path_rules_fail_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxOperator(task_id="t", command="true", **kwargs)


def test_a_relative_and_an_absolute_path_to_one_file_are_refused_before_provisioning(hook):
    absolute = hook.workdir.rstrip("/") + "/a"
    with pytest.raises(ValueError, match=rf"files\['a'\] and files\['{absolute}'\] both write"):
        run_operator(hook, files={"a": "1", absolute: "2"})
    assert hook.provisioned == []


def test_an_env_over_the_backend_limit_is_refused_before_provisioning(hook):
    limit = hook.capabilities.max_env_bytes
    assert limit is not None
    big = SandboxSpec(env={"BIG": "x" * limit})
    with pytest.raises(SandboxTerminalError, match=rf"more than the \w+ backend can pass \({limit} bytes\).*files="):
        run_operator(hook, spec=big)
    many = hook.capabilities.max_env_entries
    if many is not None:
        with pytest.raises(SandboxTerminalError, match=rf"holds {many + 1} variables.*\({many}\)"):
            run_operator(hook, spec=SandboxSpec(env={f"V{i}": "" for i in range(many + 1)}))
    assert hook.provisioned == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: (tmp / "missing").as_uri(), "does not exist on this worker"),
        (lambda tmp: tmp.as_uri(), r"not a regular file \(a directory\)"),
        (lambda tmp: "file:///dev/zero", r"not a regular file \(a character device\)"),
    ],
)
def test_file_inputs_that_cannot_be_staged_are_refused_before_provisioning(hook, tmp_path, make, message):
    with pytest.raises(SandboxTerminalError, match=message):
        run_operator(hook, inputs={"in": make(tmp_path)})
    assert hook.provisioned == []


def _bad_member(folder, tmp_path, monkeypatch, bad: str) -> str:
    """Put one bad member below ``folder/sub``; return what the refusal says."""
    if bad == "fifo":
        os.mkfifo(folder / "sub" / "pipe")
        return r"in/sub/pipe is not a regular file"
    outside = tmp_path / "outside.txt"
    outside.write_text("not the directory's")
    (folder / "sub" / "leak").symlink_to(outside)
    if bad == "link-outside-file-input-dirs":
        monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", str(folder))
    return r"in/sub/leak is a symbolic link to .*outside.txt, outside the directory"


@pytest.mark.parametrize("bad", ["fifo", "link-outside-the-directory", "link-outside-file-input-dirs"])
def test_bad_members_of_a_directory_input_are_refused_before_provisioning(hook, tmp_path, monkeypatch, bad):
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "ok.txt").write_text("fine")
    message = _bad_member(folder, tmp_path, monkeypatch, bad)
    with pytest.raises(SandboxTerminalError, match=message):
        run_operator(hook, inputs={"data": folder.as_uri() + "/"})
    assert hook.provisioned == []
    if (tmp_path / "state").exists():  # the local backend's state root: no sandbox directory either
        assert wait_for_removals() and os.listdir(tmp_path / "state") == []


def test_a_directory_input_without_bad_members_provisions_once(tmp_path):
    """The control of the test above: the same directory, with nothing bad in it, is provisioned and staged."""
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "ok.txt").write_text("fine")
    made = FakeSandboxHook(str(tmp_path / "fake"))
    assert run_operator(made, inputs={"data": folder.as_uri() + "/"}, command="cat data/ok.txt")["stdout"] == "fine"
    assert len([call for call in made.calls if call[0] == "provision"]) == 1


def test_the_toolset_refuses_a_bad_destination_when_the_run_starts(hook, out):
    pytest.importorskip("pydantic_ai")
    from sandbox_provider.toolsets import SandboxToolset

    toolset = SandboxToolset(hook, exports={"a": (out / "kept.txt").as_uri() + "/x"})
    with pytest.raises(SandboxTerminalError, match="is a file, not a directory"):
        with toolset:
            pass
    assert hook.provisioned == [] and listing(out) == [("kept.txt", "before")]


@pytest.mark.parametrize(
    "backend", [pytest.param("local", marks=requires_bwrap), pytest.param("docker", marks=pytest.mark.docker)]
)
def test_an_env_at_the_declared_limits_reaches_the_sandbox(request, tmp_path, backend):
    """The positive control: what a backend declares it can pass, it passes."""
    if backend == "local":
        from sandbox_provider.hooks.local import LocalSandboxHook

        real = LocalSandboxHook(state_root=str(tmp_path / "state"))
    else:
        from sandbox_provider.hooks.docker import DockerSandboxHook

        real = DockerSandboxHook(request.getfixturevalue("docker_conn"), pull="never")
    caps = real.capabilities
    specs = [SandboxSpec(env={"BIG": "y" * (caps.max_env_bytes - len("BIG") - 2)})]
    if caps.max_env_entries is not None:
        specs.append(SandboxSpec(env={f"V{i}": "z" for i in range(caps.max_env_entries)}))
    for spec in specs:
        handle = real.create(spec=spec)
        try:
            result = real.run_command(
                handle, "env | grep -c '^[VB]'; printf %s \"$BIG\" | wc -c", timeout=60, max_output_bytes=4096
            )
        finally:
            real.destroy(handle)
        assert result.ok, result.stderr
        count, size = result.stdout.split()
        assert int(count) == len(spec.env)
        assert int(size) == len(spec.env.get("BIG", ""))
