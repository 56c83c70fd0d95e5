"""
What a local sandbox's create, run and destroy no longer pay each time (issue 32): the removal a
destroy leaves goes to one thread per worker process, which the process waits for as it exits; the
plan of a new sandbox comes from the record just written, not read back; bubblewrap is looked up once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import requires_bwrap
from sandbox_provider.hooks.local import LocalSandboxHook, state
from sandbox_provider.hooks.local import plan as plans
from sandbox_provider.hooks.local.hook import wait_for_removals

pytestmark = requires_bwrap


def _removal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sandbox-removal")]


def test_destroys_that_do_not_wait_share_one_removal_thread_and_leave_nothing(tmp_path):
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handles = [hook.create() for _ in range(3)]
    uids = [hook.uid_of(handle) for handle in handles]
    cgroups = hook._cgroups()
    for handle in handles:
        assert hook.run_command(handle, "true", timeout=30, max_output_bytes=100).ok
        LocalSandboxHook(state_root=hook.state_root).destroy(handle, wait=False)  # a new hook each, as tasks do
        if cgroups is not None:  # nothing of it runs once destroy returns
            assert cgroups.members(handle) == []
    assert len(_removal_threads()) <= 1
    assert wait_for_removals(30)
    assert os.listdir(hook.state_root) == []
    if cgroups is not None:
        assert not any(cgroups.exists(handle) for handle in handles)
    leases = hook._leases()
    assert leases is None or not set(uids) & set(leases.leases())


_EXIT_RIGHT_AFTER_DESTROY = """
import os, sys, time
from sandbox_provider.hooks.local import LocalSandboxHook, removals, state

if sys.argv[2] == "no-exit-wait":
    removals._waited_at_exit = True  # the control: as if nothing waited for the removal at exit
slow = state.remove_sandbox_dir

def remove_slowly(path):
    time.sleep(1.0)  # the worker reaches its exit while the removal still runs
    slow(path)

state.remove_sandbox_dir = remove_slowly
hook = LocalSandboxHook(state_root=sys.argv[1])
handle = hook.create()
hook.destroy(handle, wait=False)
print(handle, flush=True)
"""


@pytest.mark.parametrize("mode", ["exit-wait", "no-exit-wait"])
def test_a_worker_that_exits_right_after_a_destroy_finishes_the_removal_first(tmp_path, mode):
    root = str(tmp_path / "state")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_RIGHT_AFTER_DESTROY), root, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    handle = done.stdout.split()[-1]
    if mode == "exit-wait":
        assert os.listdir(root) == []
    else:  # the removal thread died with the process: the next sweep has it to do
        assert os.listdir(root) == [state.DESTROYED + handle]
        hook = LocalSandboxHook(state_root=root)
        assert handle in hook.gc_expired().removed
        assert os.listdir(root) == []


def test_the_first_command_uses_the_record_written_at_create_not_read_back(tmp_path, monkeypatch):
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handle = hook.create()
    reads = []
    real = state.read_record
    monkeypatch.setattr(state, "read_record", lambda path: reads.append(path) or real(path))
    try:
        assert hook.run_command(handle, "echo $HOME", timeout=30, max_output_bytes=100).stdout == "/workspace\n"
        assert reads == []
        hook.write_tags(handle, {**hook.read_tags(handle), "extra": "1"})  # a change of stamps: read again
        reads.clear()
        assert hook.run_command(handle, "true", timeout=30, max_output_bytes=100).ok
        assert reads  # the control: a plan the hook does not have comes from the record
    finally:
        hook.destroy(handle)


def test_bubblewrap_is_looked_up_once_per_process_and_a_missing_one_each_time(tmp_path, monkeypatch):
    asked = []
    real = plans.shutil.which
    monkeypatch.setattr(plans.shutil, "which", lambda name, path=None: asked.append(name) or real(name, path=path))
    monkeypatch.setattr(plans, "_FOUND", {})
    for _ in range(3):
        LocalSandboxHook(state_root=str(tmp_path / "state"))._bwrap()
    assert asked == ["bwrap"]
    for _ in range(2):
        with pytest.raises(Exception, match="not installed"):
            LocalSandboxHook(state_root=str(tmp_path / "state"), bwrap_path="bwrap-not-here")._bwrap()
    assert asked == ["bwrap", "bwrap-not-here", "bwrap-not-here"]


def test_a_destroy_where_no_thread_can_start_removes_the_sandbox_itself(tmp_path, monkeypatch):
    from sandbox_provider.hooks.local import removals

    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    handle = hook.create()
    assert wait_for_removals(30)
    monkeypatch.setattr(removals, "_thread", None)

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    hook.destroy(handle, wait=False)
    assert os.listdir(hook.state_root) == []  # removed before destroy returned
    assert removals.wait(0)  # and nothing counted as left to wait for


def test_a_removal_still_queued_is_not_taken_on_by_the_next_create(tmp_path):
    """
    The removal thread keeps the ``.destroyed-`` directory locked from the destroy on, so a create's
    sweep (here or in another worker) leaves it alone and does not pay for it; a leftover that no
    live worker holds is still swept.
    """
    from sandbox_provider.hooks.local import removals

    hook = LocalSandboxHook(state_root=str(tmp_path / "state"))
    root = hook.state_root
    left, queued = hook.create(), hook.create()
    # The positive control: a killed worker's leftover, renamed away with no lock held, is swept.
    assert state.mark_destroyed(root, left) is not None
    go = threading.Event()
    removals.submit(lambda: go.wait(60))  # the removal thread is busy: the next removal waits in line
    try:
        LocalSandboxHook(state_root=root).destroy(queued, wait=False)
        assert sorted(os.listdir(root)) == sorted([state.DESTROYED + left, state.DESTROYED + queued])
        other = LocalSandboxHook(state_root=root).create()  # its create sweeps the state root
        assert sorted(os.listdir(root)) == sorted([other, state.DESTROYED + queued])
        script = "import sys; from sandbox_provider.hooks.local import LocalSandboxHook as H; print(H(state_root=sys.argv[1]).gc_expired())"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        swept = subprocess.run(
            [sys.executable, "-c", script, root], capture_output=True, text=True, timeout=120, env=env
        )
        assert swept.returncode == 0 and queued not in swept.stdout, swept.stdout + swept.stderr
        assert state.DESTROYED + queued in os.listdir(root)
    finally:
        go.set()
    assert wait_for_removals(30)
    assert os.listdir(root) == [other]
    hook.destroy(other)
