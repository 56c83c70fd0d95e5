"""The sbx hook's subprocess plumbing, with real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from sandbox_provider.hooks.sbx import driver


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_collects_output_and_exit_code():
    result = driver.run(["/bin/sh", "-c", "cat; printf 'e' >&2; exit 3"], wall=30, stdin=b"\x00in\xff")
    assert (result.returncode, result.stdout, result.stderr) == (3, b"\x00in\xff", b"e")


def test_stream_passes_chunks_in_this_thread_as_they_come():
    seen = []
    code = driver.stream(
        ["/bin/sh", "-c", "echo one; sleep 0.1; echo two >&2; echo three"],
        stdin=b"",
        wall=30,
        on_stdout=lambda b: seen.append(("out", b)),
        on_stderr=lambda b: seen.append(("err", b)),
    )
    assert code == 0
    assert b"".join(b for kind, b in seen if kind == "out") == b"one\nthree\n"
    assert [b for kind, b in seen if kind == "err"] == [b"two\n"]


def test_a_hung_process_and_its_group_are_killed(tmp_path):
    pidfile = tmp_path / "pids"
    with pytest.raises(driver.CliHung):
        driver.run(["/bin/sh", "-c", f"sleep 300 & echo $! > {pidfile}; sleep 300"], wall=0.5)
    pids = [int(p) for p in pidfile.read_text().split()]
    try:
        # SIGKILL was sent before run() returned; give a loaded machine a moment to deliver it.
        for _ in range(500):
            if not any(alive(p) for p in pids):
                break
            time.sleep(0.01)
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_missing_binary_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        driver.run([str(tmp_path / "sbx")], wall=5)


def test_a_large_stdin_and_output_do_not_deadlock():
    data = os.urandom(3 << 20)
    assert driver.run(["cat"], wall=60, stdin=data).stdout == data


@pytest.mark.parametrize(
    ("text", "size"), [("2g", 2 << 30), ("1536m", 1536 << 20), ("1048576k", 1 << 30), ("4096", 4096)]
)
def test_memory_bytes(text, size):
    assert driver.memory_bytes(text) == size


@pytest.mark.parametrize("text", ["", "2 GB", "1.5g", "-1g", "lots", None])
def test_memory_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="memory must be a size"):
        driver.memory_bytes(text)


def test_stdin_can_be_a_stream_and_its_failure_is_raised():
    import io

    assert driver.run(["wc", "-c"], wall=30, stdin=io.BytesIO(b"x" * 200_000)).stdout.strip() == b"200000"

    class Broken(io.RawIOBase):
        def readable(self):
            return True

        def read(self, size=-1):
            raise OSError("source went away")

    with pytest.raises(OSError, match="source went away"):
        driver.run(["cat"], wall=30, stdin=Broken())
