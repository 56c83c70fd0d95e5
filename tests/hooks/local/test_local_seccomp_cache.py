"""
The built system-call filter kept on disk for later worker processes (``seccomp_cache.py``): a later
process reads the very program a fresh build gives without loading libseccomp, and a kept filter it
cannot trust (someone else's directory or file, a link, a library that changed) is never read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox_provider.hooks.local import seccomp, seccomp_cache

#: Run in a new process: the filter, the keyctl number, and whether the binding had to be loaded.
PROBE = """
import json, sys
from sandbox_provider.hooks.local import seccomp
program = seccomp.filter_program()
print(json.dumps({"program": program.hex(), "keyctl": seccomp.syscall_number("keyctl"),
                  "names": list(seccomp.refused_names()),
                  "loaded": any(name in sys.modules for name in ("seccomp", "pyseccomp"))}))
"""


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """A temp dir of the test's own, for this process and the processes it starts."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    return tmp_path


def probe() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def kept_file(temp_dir) -> str:
    (name,) = os.listdir(seccomp_cache.cache_dir())
    return os.path.join(seccomp_cache.cache_dir(), name)


def test_a_later_process_reads_what_a_fresh_build_gives_without_libseccomp(temp_dir):
    program, names, numbers = seccomp._build()
    first = probe()
    assert first["loaded"]  # positive control: the first process built it
    assert oct(os.stat(seccomp_cache.cache_dir()).st_mode & 0o777) == "0o700"
    assert oct(os.stat(kept_file(temp_dir)).st_mode & 0o777) == "0o600"
    second = probe()
    assert not second["loaded"]
    assert second["program"] == first["program"] == program.hex()
    assert second["names"] == list(names) and second["keyctl"] == numbers["keyctl"]


def untrusted(kind: str, temp_dir) -> None:
    """Make the kept filter one that must not be read, the way ``kind`` says."""
    path = kept_file(temp_dir)
    if kind == "file writable by others":
        os.chmod(path, 0o622)
    elif kind == "directory writable by others":
        os.chmod(seccomp_cache.cache_dir(), 0o777)
    elif kind == "someone else's file":
        os.chown(path, 65534, 65534)
    elif kind == "someone else's directory":
        os.chown(seccomp_cache.cache_dir(), 65534, 65534)
    elif kind == "a link":
        os.rename(path, path + ".elsewhere")
        os.symlink(path + ".elsewhere", path)
    elif kind == "libseccomp changed":
        with open(path) as f:
            record = json.load(f)
        record["builders"][0][2] += 1  # another inode: the library was replaced
        with open(path, "w") as f:
            json.dump(record, f)
    elif kind == "a truncated file":
        with open(path, "r+b") as f:
            f.truncate(100)


KINDS = [
    "file writable by others",
    "directory writable by others",
    "a link",
    "libseccomp changed",
    "a truncated file",
    pytest.param("someone else's file", marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")),
    pytest.param("someone else's directory", marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")),
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_filter_that_cannot_be_trusted_is_not_read(temp_dir, kind):
    probe()
    assert seccomp_cache.load() is not None  # positive control: as kept, it is read
    untrusted(kind, temp_dir)
    assert seccomp_cache.load() is None
    again = probe()
    assert again["loaded"]  # built again, and what it gives is the real filter
    assert again["program"] == seccomp._build()[0].hex()
