"""
The OpenSandbox guest daemon of the test image (``opensandbox_execd.py``, beside this file) and its entrypoint, run on the host.

The daemon listens on a loopback port in a temporary directory and is driven by the real
``opensandbox`` SDK's execd clients, as a sandbox's daemon is, and by raw HTTP where the wire format
itself is the subject.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("opensandbox")

from opensandbox.config import ConnectionConfigSync  # noqa: E402
from opensandbox.exceptions import SandboxApiException  # noqa: E402
from opensandbox.models.execd import RunCommandOpts  # noqa: E402
from opensandbox.models.execd_sync import ExecutionHandlersSync  # noqa: E402
from opensandbox.models.filesystem import DirectoryListEntry, WriteEntry  # noqa: E402
from opensandbox.models.sandboxes import SandboxEndpoint  # noqa: E402
from opensandbox.sync.adapters.factory import AdapterFactorySync  # noqa: E402

GUEST = Path(__file__).resolve().parent
DAEMON = GUEST / "opensandbox_execd.py"
BOOTSTRAP = GUEST / "opensandbox_bootstrap.sh"


def _wait_for_line(path: Path, marker: str, proc: subprocess.Popen, seconds: float = 20.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                return line
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}: {path.read_text()}")
        time.sleep(0.02)
    raise AssertionError(f"no {marker!r} within {seconds} s: {path.read_text()}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The daemon on a free loopback port, working in a directory of its own; yields its URL and port."""
    base = tmp_path_factory.mktemp("execd")
    work = base / "work"
    work.mkdir()
    log = base / "execd.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(DAEMON), "--host", "127.0.0.1", "--port", "0"],
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            env={**os.environ, "DAEMON_TEST_MARK": "from-daemon"},
        )
    try:
        line = _wait_for_line(log, "listening on", proc)
        port = int(line.rsplit(":", 1)[1])
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "cwd": work, "log": log}
    finally:
        _stop(proc)


def _services(daemon, *, use_server_proxy: bool = False):
    config = ConnectionConfigSync(domain=f"127.0.0.1:{daemon['port']}", use_server_proxy=use_server_proxy)
    factory = AdapterFactorySync(config)
    # The prefix the OpenSandbox server puts in every execd endpoint it hands out.
    endpoint = SandboxEndpoint(endpoint=f"127.0.0.1:{daemon['port']}/proxy/44772")
    return factory.create_command_service(endpoint), factory.create_filesystem_service(endpoint)


@pytest.fixture
def work(tmp_path):
    """A fresh directory for one test's files (the daemon serves any path)."""
    return tmp_path


@pytest.fixture
def commands(daemon):
    return _services(daemon)[0]


@pytest.fixture
def files(daemon):
    return _services(daemon)[1]


def _alive_with(marker: str) -> list[int]:
    """Pids of processes on this host whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                pids.append(int(entry.name))
    return pids


def _wait_gone(marker: str, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _alive_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _wait_alive(marker: str, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while not (found := _alive_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def _kill_all(marker: str) -> None:
    for pid in _alive_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _marker_sleep() -> tuple[str, str]:
    """A sleep whose command line is unique to this test: (marker, shell text that runs it)."""
    seconds = f"{300 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"
    return seconds, f"sleep {seconds}"


# -- health and routing ---------------------------------------------------------------------------


def test_ping_answers_with_and_without_the_proxy_prefix(daemon):
    assert httpx.get(daemon["url"] + "/ping").status_code == 200
    assert httpx.get(daemon["url"] + "/proxy/44772/ping").status_code == 200
    assert httpx.get(f"{daemon['url']}/proxy/{daemon['port']}/ping").status_code == 200


def test_other_ports_and_unknown_paths_get_execd_error_bodies(daemon):
    other = httpx.get(daemon["url"] + "/proxy/18080/policy")
    assert other.status_code == 502
    assert other.json()["code"] == "NOT_SUPPORTED"
    assert "only to itself" in other.json()["message"]
    unknown = httpx.post(daemon["url"] + "/code", json={})
    assert unknown.status_code == 404 and unknown.json()["code"] == "NOT_SUPPORTED"


# -- commands -------------------------------------------------------------------------------------


def test_exit_zero_streams_lines_and_completes(commands, daemon):
    seen = []
    handlers = ExecutionHandlersSync(on_stdout=lambda m: seen.append(("out", m.text)))
    execution = commands.run(
        "echo one; echo two >&2; printf 'no-newline'; echo $DAEMON_TEST_MARK $EXTRA; pwd",
        opts=RunCommandOpts(envs={"EXTRA": "from-request"}),
        handlers=handlers,
    )
    assert execution.exit_code == 0
    assert execution.error is None and execution.complete is not None
    assert execution.id
    out = [m.text for m in execution.logs.stdout]
    assert out == ["one", "no-newlinefrom-daemon from-request", str(daemon["cwd"])]
    assert [m.text for m in execution.logs.stderr] == ["two"]
    assert seen == [("out", text) for text in out]


def test_a_final_line_without_newline_is_its_own_event(commands):
    execution = commands.run("printf 'a\\nb'")
    assert [m.text for m in execution.logs.stdout] == ["a", "b"]


@pytest.mark.parametrize("status", [1, 3, 124, 255])
def test_non_zero_exit_is_a_command_exec_error_with_the_status(commands, status):
    execution = commands.run(f"echo before; exit {status}")
    assert execution.exit_code == status
    assert execution.error.name == "CommandExecError"
    assert execution.error.value == str(status)
    assert execution.error.traceback == [f"exit status {status}"]
    assert [m.text for m in execution.logs.stdout] == ["before"]


@pytest.mark.parametrize(("sig", "text"), [("KILL", "signal: killed"), ("TERM", "signal: terminated")])
def test_a_signal_death_is_minus_one_like_the_vendor(commands, sig, text):
    execution = commands.run(f"kill -{sig} $$")
    assert execution.exit_code == -1
    assert execution.error.value == "-1"
    assert execution.error.traceback == [text]


def test_the_timeout_kills_the_whole_group_and_the_daemon_keeps_serving(commands):
    marker, sleep = _marker_sleep()
    try:
        execution = commands.run(
            f"{sleep} & {sleep} & echo started; wait", opts=RunCommandOpts(timeout=timedelta(milliseconds=700))
        )
        assert execution.exit_code == -1
        assert execution.error.traceback == ["signal: killed"]
        assert [m.text for m in execution.logs.stdout] == ["started"]
        assert _wait_gone(marker) == []
        assert commands.run("echo still-here").exit_code == 0
    finally:
        _kill_all(marker)


def test_the_command_returns_without_waiting_for_a_child_holding_its_output(commands):
    marker, sleep = _marker_sleep()
    try:
        execution = commands.run(f"{sleep} & echo parent-done")
        assert execution.exit_code == 0
        assert [m.text for m in execution.logs.stdout] == ["parent-done"]
        # Positive control for the timeout test above: without a timeout, the child lives on.
        assert _alive_with(marker)
    finally:
        _kill_all(marker)


def test_argv_and_cwd_are_honoured(commands, work):
    sub = work / "sub"
    sub.mkdir()
    execution = commands.run(
        ["/bin/sh", "-c", 'pwd; echo "$0"', "zero"], opts=RunCommandOpts(working_directory=str(sub))
    )
    assert [m.text for m in execution.logs.stdout] == [str(sub), "zero"]


def test_stdin_is_empty(commands):
    execution = commands.run("cat; echo after-cat")
    assert [m.text for m in execution.logs.stdout] == ["after-cat"]


def test_a_long_line_and_many_lines_arrive_whole(commands):
    execution = commands.run("head -c 300000 /dev/zero | tr '\\0' x; echo; seq 1 20000")
    out = [m.text for m in execution.logs.stdout]
    assert out[0] == "x" * 300000
    assert out[1:] == [str(n) for n in range(1, 20001)]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "INVALID_REQUEST_BODY"),
        ({"command": "true", "argv": ["true"]}, "INVALID_REQUEST_BODY"),
        ({"command": "true", "background": True}, "NOT_SUPPORTED"),
        ({"command": "true", "cwd": "/no/such/dir"}, "INVALID_REQUEST_BODY"),
        ({"command": "true", "timeout": -1}, "INVALID_REQUEST_BODY"),
    ],
)
def test_bad_command_requests_are_refused_before_running(daemon, body, code):
    response = httpx.post(daemon["url"] + "/command", json=body)
    assert response.status_code == 400
    assert response.json()["code"] == code


def test_a_body_that_is_not_json_is_refused(daemon):
    response = httpx.post(daemon["url"] + "/command", content=b"{nope")
    assert response.status_code == 400 and response.json()["code"] == "INVALID_REQUEST_BODY"


def test_wire_format_is_execd_framing_over_chunked_encoding(daemon):
    """Bare JSON objects each followed by a blank line, every one with a timestamp; a ping while it runs."""
    with httpx.stream("POST", daemon["url"] + "/command", json={"command": "sleep 3.2; echo done; exit 2"}) as rsp:
        assert rsp.status_code == 200
        assert rsp.headers["content-type"] == "text/event-stream"
        assert rsp.headers["transfer-encoding"] == "chunked"
        raw = rsp.read()
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    events = [json.loads(frame) for frame in frames[:-1]]
    assert all(isinstance(e["timestamp"], int) for e in events)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "init" and events[0]["text"]
    assert "ping" in kinds
    assert events[-2] == {"type": "stdout", "text": "done", "timestamp": events[-2]["timestamp"]}
    assert events[-1]["error"] == {"ename": "CommandExecError", "evalue": "2", "traceback": ["exit status 2"]}


def test_the_success_event_carries_the_execution_time(daemon):
    raw = httpx.post(daemon["url"] + "/command", json={"command": "true"}).content
    last = json.loads(raw.split(b"\n\n")[-2])
    assert last["type"] == "execution_complete" and isinstance(last["execution_time"], int)


def test_a_client_that_goes_away_ends_its_command(daemon):
    marker, sleep = _marker_sleep()
    try:
        with httpx.stream("POST", daemon["url"] + "/command", json={"command": f"{sleep}; echo never"}) as rsp:
            chunks = rsp.iter_bytes()  # kept: a dropped iterator closes the response
            first = next(chunks)
            assert json.loads(first.split(b"\n\n")[0])["type"] == "init"
            assert _wait_alive(marker)  # positive control: it runs while someone listens
        # The daemon watches the connection while the command runs.
        assert _wait_gone(marker) == []
    finally:
        _kill_all(marker)


# -- files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_server_proxy", [False, True], ids=["chunked", "content-length"])
def test_upload_then_download_is_byte_identical(daemon, use_server_proxy, work):
    _, files = _services(daemon, use_server_proxy=use_server_proxy)
    # Bytes that look like the start of a multipart delimiter must not end the part.
    data = os.urandom(300_000) + b"\r\n--opensandbox_" + os.urandom(70_000) + b"\r\n--"
    target = work / "deep" / "er" / "blob.bin"
    files.write_file(str(target), data, mode=640)
    assert target.read_bytes() == data
    assert oct(target.stat().st_mode & 0o777) == "0o640"
    assert files.read_bytes(str(target)) == data


def test_upload_streams_a_file_object_and_several_entries(files, daemon, work):
    big = os.urandom(5 * 1024 * 1024)
    files.write_files(
        [
            WriteEntry(path=str(work / "big.bin"), data=io.BytesIO(big)),
            WriteEntry(path=str(work / "note.txt"), data="héllo\n"),
        ]
    )
    assert (work / "big.bin").read_bytes() == big
    assert (work / "note.txt").read_text(encoding="utf-8") == "héllo\n"
    streamed = b"".join(files.read_bytes_stream(str(work / "big.bin"), chunk_size=65536))
    assert streamed == big


def test_ranged_reads(files, daemon, work):
    target = work / "range.bin"
    data = bytes(range(256)) * 4
    target.write_bytes(data)
    read = lambda header: b"".join(files.read_bytes_stream(str(target), range_header=header))  # noqa: E731
    assert read("bytes=0-99") == data[:100]
    assert read("bytes=1000-") == data[1000:]
    assert read("bytes=-10") == data[-10:]
    assert read("bytes=1000-5000") == data[1000:]


@pytest.mark.parametrize("content", [b"", b"abc"], ids=["empty", "short"])
def test_a_range_past_the_end_is_416_as_on_the_vendor_daemon(daemon, content, work):
    target = work / "small.bin"
    target.write_bytes(content)
    response = httpx.get(
        daemon["url"] + "/files/download", params={"path": str(target)}, headers={"Range": "bytes=3-9"}
    )
    assert response.status_code == 416
    assert response.headers["content-range"] == f"bytes */{len(content)}"


def test_reading_a_missing_file_is_404_file_not_found(files, daemon, work):
    with pytest.raises(SandboxApiException) as err:
        files.read_bytes(str(work / "missing"))
    assert err.value.status_code == 404
    assert "FILE_NOT_FOUND" in str(err.value)
    with pytest.raises(SandboxApiException) as err:
        files.get_file_info([str(work / "missing")])
    assert err.value.status_code == 404


def test_file_info_and_listing(files, daemon, work):
    (work / "a.txt").write_bytes(b"12345")
    (work / "a.txt").chmod(0o600)
    (work / "d").mkdir()
    (work / "d" / "inner.txt").write_bytes(b"x")
    (work / "link").symlink_to(work / "a.txt")
    info = files.get_file_info([str(work / "a.txt")])[str(work / "a.txt")]
    assert (info.size, info.mode, info.entry_type) == (5, 600, "file")
    assert info.modified_at.tzinfo is not None
    one = files.list_directory(DirectoryListEntry(path=str(work), depth=1))
    assert [(Path(e.path).name, e.entry_type) for e in one] == [
        ("a.txt", "file"),
        ("d", "directory"),
        ("link", "symlink"),
    ]
    two = files.list_directory(DirectoryListEntry(path=str(work), depth=2))
    assert str(work / "d" / "inner.txt") in [e.path for e in two]
    assert files.list_directory(DirectoryListEntry(path=str(work), depth=0)) == []


@pytest.mark.parametrize(("name", "status"), [("missing", 404), ("a.txt", 400), ("link", 400)])
def test_listing_refuses_what_is_not_a_directory(files, daemon, name, status, work):
    (work / "a.txt").write_bytes(b"1")
    (work / "real").mkdir()
    (work / "link").symlink_to(work / "real")
    with pytest.raises(SandboxApiException) as err:
        files.list_directory(DirectoryListEntry(path=str(work / name), depth=1))
    assert err.value.status_code == status


def test_create_directories_applies_the_mode_to_new_ones_only(files, daemon, work):
    (work / "old").mkdir(mode=0o755)
    files.create_directories(
        [WriteEntry(path=str(work / "new" / "deeper"), mode=700), WriteEntry(path=str(work / "old"), mode=700)]
    )
    assert oct((work / "new" / "deeper").stat().st_mode & 0o777) == "0o700"
    assert oct((work / "old").stat().st_mode & 0o777) == "0o755"


def test_upload_without_metadata_or_file_is_refused(daemon):
    only_file = httpx.post(daemon["url"] + "/files/upload", files=[("file", ("x", b"data"))])
    assert only_file.status_code == 400 and only_file.json()["code"] == "INVALID_FILE_METADATA"
    no_path = httpx.post(
        daemon["url"] + "/files/upload", files=[("metadata", ("metadata", b"{}")), ("file", ("x", b"d"))]
    )
    assert no_path.status_code == 400 and no_path.json()["code"] == "INVALID_FILE_METADATA"
    not_multipart = httpx.post(daemon["url"] + "/files/upload", content=b"raw")
    assert not_multipart.status_code == 400 and not_multipart.json()["code"] == "INVALID_FILE"


# -- the entrypoint -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_bootstrap_starts_the_daemon_then_becomes_the_command(tmp_path):
    port = _free_port()
    log = tmp_path / "boot.log"
    env = {**os.environ, "EXECD": str(DAEMON), "EXECD_PORT": str(port), "EXECD_HOST": "127.0.0.1"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            ["sh", str(BOOTSTRAP), "-c", "echo first && exec sleep 30"],
            cwd=tmp_path,
            env=env,
            stdout=sink,
            stderr=sink,
            start_new_session=True,  # the daemon it starts shares the group, which the test ends
        )
    try:
        _wait_for_line(log, "listening on", proc)
        _wait_for_line(log, "first", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/ping").status_code == 200
        # The shell became the command: the bootstrap's pid now runs sleep.
        assert b"sleep" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_bootstrap_refuses_a_missing_daemon(tmp_path):
    result = subprocess.run(
        ["sh", str(BOOTSTRAP), "true"], env={**os.environ, "EXECD": str(tmp_path / "nope")}, capture_output=True
    )
    assert result.returncode == 127
    assert b"is missing or not executable" in result.stderr
