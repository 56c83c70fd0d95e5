"""read_file on the local backend from the worker's side of the workspace: a plain file needs no
launch, and whatever the sandbox would see differently is answered by the sandbox itself."""

# ruff: noqa: F811 (the hook and sandbox fixtures of test_local are used by name)

from __future__ import annotations

import os

import pytest
from test_local import hook, sandbox  # noqa: F401 (the fixtures)

from conftest import requires_bwrap
from sandbox_provider.hooks.local import files as _local_files
from sandbox_provider.hooks.local import hook as local_module
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError

pytestmark = requires_bwrap


@pytest.fixture
def launches(monkeypatch):
    """How many commands the hook has started since the fixture was set up."""
    count = [0]
    real = local_module.driver.start

    def start(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(local_module.driver, "start", start)
    return lambda: count[0]


def _sh(hook, handle, command):
    result = hook.run_command(handle, command, timeout=30, max_output_bytes=4096)
    assert result.ok, result.stderr


def _host(hook, handle, relative):
    return os.path.join(hook.state_root, handle, "workspace", relative)


def _outcome(read):
    try:
        return ("bytes", read())
    except SandboxError as err:
        return (type(err).__name__, str(err))


def test_a_plain_workspace_file_is_read_without_a_launch(hook, sandbox, launches):
    _sh(hook, sandbox, "mkdir -p d/e && printf 'made inside' > d/e/f.txt")
    before = launches()
    assert hook.read_file(sandbox, "d/e/f.txt", max_bytes=11) == b"made inside"
    assert hook.read_file(sandbox, "/workspace/./d//e/f.txt", max_bytes=100) == b"made inside"
    assert launches() == before


@pytest.mark.parametrize(
    ("setup", "path"),
    [
        ("printf real > real.txt && ln -s real.txt alias", "alias"),  # a link: the sandbox follows it
        ("ln -s {secret} link", "link"),  # a host path: the sandbox sees nothing there
        ("mkdir d && printf x > d/f && ln -s d l", "l/f"),  # a linked directory on the way
        ("printf top > f.txt && ln -s /tmp sub", "sub/../f.txt"),  # /tmp/.. is / in there, not the workspace
        ("printf hidden > f && chmod 000 f", "f"),  # unreadable to its owner, not to root
        ("mkdir d && printf x > d/f && chmod 000 d", "d/f"),  # a directory its owner cannot pass
        ("mkfifo p", "p"),  # not a regular file (and opening it must not hang)
        ("printf 0123456789 > ten", "ten"),  # over the budget
        ("printf x > /tmp/t", "/tmp/t"),  # outside the workdir
    ],
)
def test_what_the_worker_would_see_differently_is_left_to_the_sandbox(hook, sandbox, launches, tmp_path, setup, path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    _sh(hook, sandbox, setup.format(secret=secret))
    before = launches()
    got = _outcome(lambda: hook.read_file(sandbox, path, max_bytes=9))
    assert launches() == before + 1  # answered by a read inside the sandbox
    assert got == _outcome(lambda: _local_files.LocalFiles.read_file(hook, sandbox, path, max_bytes=9))
    assert "host secret" not in repr(got)


def test_the_cases_differ_on_the_worker_side(hook, sandbox, tmp_path):
    """Positive control: read plainly from the worker, these paths give what the sandbox does not."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    _sh(
        hook,
        sandbox,
        f"ln -s {secret} link && printf top > f.txt && ln -s /tmp sub && printf hidden > h && chmod 000 h",
    )
    assert open(_host(hook, sandbox, "link")).read() == "host secret"  # the worker follows links to its own files
    assert open(os.path.normpath(_host(hook, sandbox, "sub/../f.txt"))).read() == "top"  # .. taken lexically
    assert open(_host(hook, sandbox, "h")).read() == "hidden"  # root reads what the owner may not
    for path in ("link", "sub/../f.txt", "h"):
        with pytest.raises(SandboxError):
            hook.read_file(sandbox, path, max_bytes=100)


def test_the_budget_and_the_lifetime_apply(hook, launches):
    handle = hook.create()
    _sh(hook, handle, "printf 0123456789 > ten")
    with pytest.raises(SandboxFileTooLargeError) as info:
        hook.read_file(handle, "ten", max_bytes=9)
    assert (info.value.size_bytes, info.value.max_bytes) == (10, 9)
    assert hook.read_file(handle, "ten", max_bytes=10) == b"0123456789"
    hook.destroy(handle)
    with pytest.raises(SandboxTerminalError, match="does not exist"):
        hook.read_file(handle, "ten", max_bytes=10)
