"""The local backend's system-call filter, loaded by real bubblewrap: what it refuses, and that it refuses nothing else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from pid_namespace import plain_bwrap
from sandbox_provider.hooks.local import driver as _local_driver
from sandbox_provider.hooks.local import seccomp as _local_seccomp

pytestmark = pytest.mark.skipif(
    not shutil.which("bwrap") and not os.environ.get("SANDBOX_REQUIRE_BWRAP"), reason="bubblewrap is not installed"
)

# Each probe: (label, syscall name, arguments). Run by a guest Python through libc's syscall().
PROBES = [
    ("keyctl", "keyctl", (0, -3)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    ("add_key", "add_key", (b"user", b"k", b"v", 1, -3)),
    ("request_key", "request_key", (b"user", b"k", 0, 0)),
    ("ptrace", "ptrace", (16, "CHILD", 0, 0)),  # PTRACE_ATTACH to a child of the guest
    ("bpf", "bpf", (0, 0, 0)),
    ("perf_event_open", "perf_event_open", (0, 0, -1, -1, 0)),
    ("userfaultfd", "userfaultfd", (0,)),
    ("io_uring_setup", "io_uring_setup", (1, 0)),
    ("kexec_load", "kexec_load", (0, 0, 0, 0)),
    ("init_module", "init_module", (0, 0, b"")),
    ("delete_module", "delete_module", (b"x", 0)),
    ("mount", "mount", (b"none", b"/tmp", b"tmpfs", 0, 0)),
    ("umount2", "umount2", (b"/tmp", 0)),
    ("pivot_root", "pivot_root", (b"/", b"/")),
    ("setns", "setns", (-1, 0)),
    ("unshare user", "unshare", (0x10000000,)),
    ("unshare mount", "unshare", (0x20000,)),
    ("clone new net", "clone", (0x40000000 | 17, 0, 0, 0, 0)),
    ("clone3", "clone3", (0, 0)),
    ("personality no-aslr", "personality", (0x0040000,)),
    ("personality no-aslr, high bit", "personality", (0x80040000,)),
]

GUEST = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
child = os.fork()
if child == 0:
    import time
    time.sleep(60)
    os._exit(0)
for label, number, args in json.loads(sys.argv[1]):
    args = [child if a == "CHILD" else a for a in args]
    args = [a.encode() if isinstance(a, str) else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    result = libc.syscall(number, *args)
    if label == "clone new net" and result == 0:
        os._exit(0)
    out[label] = [result, ctypes.get_errno()]
os.kill(child, 9)
os.waitpid(child, 0)
def call(fn, *args):
    ctypes.set_errno(0)
    return [fn(*args), ctypes.get_errno()]
libc.personality(0)
out["personality query"] = call(libc.personality, 0xFFFFFFFF)
out["personality linux32"] = call(libc.personality, 8)
libc.personality(0)
out["unshare files"] = call(libc.unshare, 0x400)
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = [os.waitpid(pid, 0)[1] >> 8, 0]
import threading
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["thread"] = [0, 0]
print(json.dumps(out))
"""


def _numbers():
    sc = _local_seccomp._binding()
    rows = []
    for label, name, args in PROBES:
        rows.append(
            [label, sc.resolve_syscall(sc.Arch.NATIVE, name), [a.decode() if isinstance(a, bytes) else a for a in args]]
        )
    return rows


def _run(filtered: bool) -> dict[str, list[int]]:
    argv = [*plain_bwrap(), "--die-with-parent"]
    fds: tuple[int, ...] = ()
    if filtered:
        fd = _local_driver.memfd("filter", _local_seccomp.filter_program())
        argv += ["--seccomp", str(fd)]
        fds = (fd,)
    kwargs = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        done = subprocess.run(
            [*argv, "python3", "-c", GUEST, json.dumps(_numbers())],
            pass_fds=fds,
            capture_output=True,
            text=True,
            timeout=60,
            **kwargs,
        )
    finally:
        for fd in fds:
            os.close(fd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def filtered():
    return _run(True)


@pytest.fixture(scope="module")
def unfiltered():
    return _run(False)


EPERM, ENOSYS = 1, 38


@pytest.mark.parametrize("label", [p[0] for p in PROBES if p[1] != "clone3"])
def test_refused_with_eperm(filtered, label):
    assert filtered[label] == [-1, EPERM]


def test_clone3_says_enosys_so_libc_falls_back_to_clone(filtered):
    assert filtered["clone3"] == [-1, ENOSYS]


def test_positive_controls_work_without_the_filter(unfiltered):
    # The same calls in the same bubblewrap, without the filter: these succeed there.
    assert unfiltered["keyctl"][0] > 0  # the session keyring's id: the worker's keyring is reachable
    assert unfiltered["ptrace"] == [0, 0]  # attached to another process
    assert unfiltered["unshare user"] == [0, 0]
    assert unfiltered["personality no-aslr"][0] >= 0
    assert unfiltered["clone new net"][0] > 0


def test_ordinary_programs_keep_working(filtered):
    assert filtered["personality query"][0] >= 0
    assert filtered["personality linux32"][0] >= 0
    assert filtered["unshare files"] == [0, 0]
    assert filtered["fork"][0] == 7
    assert filtered["thread"] == [0, 0]


def test_the_documented_list_is_what_is_built():
    names = _local_seccomp.refused_names()
    for group in _local_seccomp.REFUSED.values():
        for name in group:
            if _local_seccomp._known(_local_seccomp._binding(), name):
                assert name in names
    for name in ("keyctl", "add_key", "request_key", "ptrace", "bpf", "perf_event_open", "userfaultfd"):
        assert name in names
        assert f"``{name}``" in _local_seccomp.__doc__
    assert len(_local_seccomp.filter_program()) % 8 == 0  # whole BPF instructions


def test_missing_binding_is_a_terminal_error_naming_the_package(monkeypatch):
    import builtins

    from sandbox_provider.sandbox import SandboxTerminalError

    real_import = builtins.__import__

    def no_binding(name, *args, **kwargs):
        if name in ("seccomp", "pyseccomp"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_binding)
    with pytest.raises(SandboxTerminalError, match="pip install pyseccomp"):
        _local_seccomp._binding()
