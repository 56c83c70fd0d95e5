"""
The OpenSandbox guest daemon of the test image (``opensandbox_execd.py``, beside this file; test
infrastructure) and its entrypoint, run on the host.

The daemon listens on a loopback port in a temporary directory and is driven by the real
``opensandbox`` SDK's execd clients, as a sandbox's daemon is (its access token in the SDK's extra
headers), and by raw HTTP where the wire format itself is the subject. The module's daemon runs its
commands as the test's own user and without the wait after each command; the cases for the command
user, the token and the wait start daemons of their own.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

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
FORGE = GUEST / "opensandbox_forge.py"
TOKEN = "host-test-token-" + uuid.uuid4().hex
AUTH = {"X-EXECD-ACCESS-TOKEN": TOKEN}


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


def _start_daemon(base: Path, env: dict, *args: str) -> tuple[subprocess.Popen, dict]:
    """
    The daemon on a free loopback port, working in ``base/work`` (its output files in ``base/spool``),
    with ``env`` over this process's environment (a None value removes a variable).
    """
    work, spool = base / "work", base / "spool"
    work.mkdir(parents=True, exist_ok=True)
    spool.mkdir(exist_ok=True)
    log = base / "execd.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(DAEMON), "--host", "127.0.0.1", "--port", "0", *args],
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            env={k: v for k, v in {**os.environ, "TMPDIR": str(spool), **env}.items() if v is not None},
        )
    try:
        line = _wait_for_line(log, "listening on", proc)
    except BaseException:
        _stop(proc)
        raise
    port = int(line.rsplit(":", 1)[1])
    return proc, {"url": f"http://127.0.0.1:{port}", "port": port, "cwd": work, "log": log, "spool": spool}


#: The module's daemon: commands as the test's own user, no wait after a command.
OWN_USER = {"EXECD_COMMAND_UID": str(os.getuid()), "EXECD_COMMAND_GID": str(os.getgid())}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The daemon on a free loopback port, working in a directory of its own; yields its URL and port."""
    env = {"DAEMON_TEST_MARK": "from-daemon", "EXECD_ACCESS_TOKEN": TOKEN, "EXECD_API_GRACE_SHUTDOWN": "0"}
    proc, info = _start_daemon(tmp_path_factory.mktemp("execd"), {**env, **OWN_USER})
    try:
        yield info
    finally:
        _stop(proc)


def _services(daemon, *, use_server_proxy: bool = False, token: str | None = TOKEN):
    headers = {"X-EXECD-ACCESS-TOKEN": token} if token else {}
    config = ConnectionConfigSync(
        domain=f"127.0.0.1:{daemon['port']}", use_server_proxy=use_server_proxy, headers=headers
    )
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
    assert httpx.get(daemon["url"] + "/ping", headers=AUTH).status_code == 200
    assert httpx.get(daemon["url"] + "/proxy/44772/ping", headers=AUTH).status_code == 200
    assert httpx.get(f"{daemon['url']}/proxy/{daemon['port']}/ping", headers=AUTH).status_code == 200


def test_other_ports_and_unknown_paths_get_execd_error_bodies(daemon):
    other = httpx.get(daemon["url"] + "/proxy/18080/policy", headers=AUTH)
    assert other.status_code == 502
    assert other.json()["code"] == "NOT_SUPPORTED"
    assert "only to itself" in other.json()["message"]
    unknown = httpx.post(daemon["url"] + "/code", json={}, headers=AUTH)
    assert unknown.status_code == 404 and unknown.json()["code"] == "NOT_SUPPORTED"


# -- the access token -----------------------------------------------------------------------------

#: One request per route the daemon serves.
ROUTES = [
    ("GET", "/ping"),
    ("POST", "/command"),
    ("GET", "/files/download?path=/etc/hostname"),
    ("GET", "/files/info?path=/"),
    ("DELETE", "/files?path=/nonexistent-file"),
    ("GET", "/directories/list?path=/"),
    ("POST", "/directories"),
    ("POST", "/files/upload"),
    ("GET", "/proxy/44772/ping"),
]


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-EXECD-ACCESS-TOKEN": "wrong"}, {"X-EXECD-ACCESS-TOKEN": TOKEN[:-1]}, {"Authorization": f"Bearer {TOKEN}"}],
    ids=["none", "wrong", "a-prefix", "another-header"],
)
def test_every_route_refuses_a_request_without_the_token(daemon, headers):
    marker = daemon["cwd"] / f"ran-{uuid.uuid4().hex}"
    for method, path in ROUTES:
        body = {"command": f"touch {marker}"} if path == "/command" else None
        response = httpx.request(method, daemon["url"] + path, json=body, headers=headers)
        assert response.status_code == 401, (method, path, response.text)
        assert "X-EXECD-ACCESS-TOKEN" in response.json()["error"]
    assert not marker.exists()
    # Positive control: the same request with the token runs the command.
    response = httpx.post(daemon["url"] + "/command", json={"command": f"touch {marker}"}, headers=AUTH)
    assert response.status_code == 200 and marker.exists()


def test_the_newer_header_name_carries_the_token_too(daemon):
    assert httpx.get(daemon["url"] + "/ping", headers={"OpenSandbox-Execd-Token": TOKEN}).status_code == 200


def test_the_token_never_reaches_a_command(commands):
    out = "\n".join(m.text for m in commands.run("env").logs.stdout)
    assert "DAEMON_TEST_MARK=from-daemon" in out  # positive control: the daemon's environment is passed on
    assert TOKEN not in out and "EXECD_ACCESS_TOKEN" not in out


def test_without_a_token_every_request_is_refused_and_the_flag_gives_one(tmp_path):
    proc, info = _start_daemon(tmp_path / "none", {"EXECD_ACCESS_TOKEN": None, **OWN_USER})
    try:
        for headers in ({}, AUTH, {"X-EXECD-ACCESS-TOKEN": ""}):
            response = httpx.get(info["url"] + "/ping", headers=headers)
            assert response.status_code == 401 and "without an access token" in response.json()["error"]
    finally:
        _stop(proc)
    proc, info = _start_daemon(tmp_path / "flag", {"EXECD_ACCESS_TOKEN": None, **OWN_USER}, "--access-token", "f")
    try:
        assert httpx.get(info["url"] + "/ping", headers={"X-EXECD-ACCESS-TOKEN": "f"}).status_code == 200
        assert httpx.get(info["url"] + "/ping").status_code == 401
    finally:
        _stop(proc)


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


def _events(daemon, command: str) -> list[dict]:
    raw = httpx.post(daemon["url"] + "/command", json={"command": command}, headers=AUTH).content
    return [json.loads(frame) for frame in raw.split(b"\n\n")[:-1]]


def test_lines_are_framed_as_the_vendors_daemon_frames_them(daemon):
    """LF and CR each end a line, CRLF ends one, an empty line is sent as a newline, a last line as it is."""
    events = _events(daemon, "printf 'a\\n\\n\\nb\\r\\nc\\rd\\r\\re'; printf '\\n\\r\\nx' >&2")
    assert [e["text"] for e in events if e["type"] == "stdout"] == ["a", "\n", "\n", "b", "c", "d", "\n", "e"]
    assert [e["text"] for e in events if e["type"] == "stderr"] == ["\n", "\n", "x"]


def test_output_is_spooled_byte_for_byte_where_only_the_daemon_can_write(daemon, files):
    events = _events(daemon, "printf 'one\\r\\ntwo'; printf 'err\\n' >&2")
    execution_id = events[0]["text"]
    out, err = (daemon["spool"] / f"{execution_id}.{stream}" for stream in ("stdout", "stderr"))
    assert (out.read_bytes(), err.read_bytes()) == (b"one\r\ntwo", b"err\n")
    assert (out.stat().st_uid, oct(out.stat().st_mode & 0o777)) == (os.geteuid(), "0o644")
    files.delete_files([str(out), str(err)])
    assert not out.exists() and not err.exists()
    files.delete_files([str(out)])  # a missing file is no error, as on the vendor's daemon
    (daemon["cwd"] / "adir").mkdir(exist_ok=True)
    with pytest.raises(SandboxApiException, match="is a directory") as info:
        files.delete_files([str(daemon["cwd"] / "adir")])
    assert info.value.status_code == 500


def _stream_end_gap(url: str) -> float:
    """Seconds between the last event of a command's stream and the stream's end."""
    with httpx.stream("POST", url + "/command", json={"command": "true"}, headers=AUTH) as response:
        last = None
        for chunk in response.iter_raw():
            if b"execution_complete" in chunk:
                last = time.monotonic()
        ended = time.monotonic()
    assert last is not None
    return ended - last


def test_the_wait_after_each_command_is_on_by_default_and_can_be_turned_off(tmp_path, daemon):
    """The vendor's daemon holds a finished command's stream open for a second; EXECD_API_GRACE_SHUTDOWN=0 does not."""
    env = {"EXECD_ACCESS_TOKEN": TOKEN, "EXECD_API_GRACE_SHUTDOWN": None, **OWN_USER}
    proc, info = _start_daemon(tmp_path, env)
    try:
        assert _stream_end_gap(info["url"]) >= 0.95
    finally:
        _stop(proc)
    assert _stream_end_gap(daemon["url"]) < 0.9  # the module's daemon, with the wait turned off


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
    response = httpx.post(daemon["url"] + "/command", json=body, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["code"] == code


def test_a_body_that_is_not_json_is_refused(daemon):
    response = httpx.post(daemon["url"] + "/command", content=b"{nope", headers=AUTH)
    assert response.status_code == 400 and response.json()["code"] == "INVALID_REQUEST_BODY"


def test_wire_format_is_execd_framing_over_chunked_encoding(daemon):
    """Bare JSON objects each followed by a blank line, every one with a timestamp; a ping while it runs."""
    with httpx.stream(
        "POST", daemon["url"] + "/command", json={"command": "sleep 3.2; echo done; exit 2"}, headers=AUTH
    ) as rsp:
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
    raw = httpx.post(daemon["url"] + "/command", json={"command": "true"}, headers=AUTH).content
    last = json.loads(raw.split(b"\n\n")[-2])
    assert last["type"] == "execution_complete" and isinstance(last["execution_time"], int)


def test_a_client_that_goes_away_ends_its_command(daemon):
    marker, sleep = _marker_sleep()
    try:
        with httpx.stream(
            "POST", daemon["url"] + "/command", json={"command": f"{sleep}; echo never"}, headers=AUTH
        ) as rsp:
            chunks = rsp.iter_bytes()  # kept: a dropped iterator closes the response
            first = next(chunks)
            assert json.loads(first.split(b"\n\n")[0])["type"] == "init"
            assert _wait_alive(marker)  # positive control: it runs while someone listens
        # The daemon watches the connection while the command runs.
        assert _wait_gone(marker) == []
    finally:
        _kill_all(marker)


# -- the command user: a command cannot reach the daemon -------------------------------------------

COMMAND_ID = 65432
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon changes user only when it runs as root")


@pytest.fixture(scope="module")
def guarded():
    """
    A daemon as root whose commands run as COMMAND_ID, in a directory under /tmp that user can reach
    (pytest's own are root's, mode 0700); yields its URL, port, pid and directories.
    """
    base = Path(tempfile.mkdtemp(prefix="execd-guarded-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "work").mkdir()
        os.chown(base / "work", COMMAND_ID, COMMAND_ID)
        shutil.copy(FORGE, base / "forge.py")
        shutil.copy(DAEMON, base / "execd.py")  # for a daemon the command user runs itself
        env = {
            "EXECD_ACCESS_TOKEN": TOKEN,
            "EXECD_API_GRACE_SHUTDOWN": "0",
            "EXECD_COMMAND_UID": str(COMMAND_ID),
            "EXECD_COMMAND_GID": str(COMMAND_ID),
            "EXECD_COMMAND_HOME": str(base / "work"),
        }
        proc, info = _start_daemon(base, env)
        try:
            yield {**info, "pid": proc.pid, "base": base}
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(info, command: str, url: str | None = None, token: str = TOKEN) -> tuple[int, list[str]]:
    """``(exit code, stdout lines)`` of ``command`` sent raw to a daemon (``url`` default ``info``'s)."""
    response = httpx.post(
        (url or info["url"]) + "/command", json={"command": command}, headers={"X-EXECD-ACCESS-TOKEN": token}
    )
    events = [json.loads(frame) for frame in response.content.split(b"\n\n")[:-1]]
    end = events[-1]
    code = 0 if end["type"] == "execution_complete" else int(end["error"]["evalue"])
    return code, [e["text"] for e in events if e["type"] == "stdout"]


def _wait_serving(url: str, token: str, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ping", headers={"X-EXECD-ACCESS-TOKEN": token}).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return False


@needs_root
def test_commands_and_file_operations_are_the_command_users(guarded):
    _, out = _run(guarded, "id -u; id -G; echo $HOME; touch made-by-command")
    assert out == [str(COMMAND_ID), str(COMMAND_ID), str(guarded["base"] / "work")]
    _, files = _services(guarded)
    files.write_file(str(guarded["base"] / "work" / "uploaded.txt"), b"data")
    owners = {name: (guarded["base"] / "work" / name).stat().st_uid for name in ("uploaded.txt", "made-by-command")}
    assert owners == {"uploaded.txt": COMMAND_ID, "made-by-command": COMMAND_ID}
    # Where the command user may not write or read, neither may a file operation; the daemon itself (root) could.
    with pytest.raises(SandboxApiException, match="permission denied") as denied:
        files.write_file(str(guarded["base"] / "root-owned.txt"), b"x")
    assert denied.value.status_code == 500 and not (guarded["base"] / "root-owned.txt").exists()
    secret = guarded["base"] / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    with pytest.raises(SandboxApiException, match="permission denied"):
        files.read_bytes(str(secret))
    assert secret.read_bytes() == b"root only"  # positive control: the file is there to read for root


@needs_root
def test_a_command_can_neither_kill_the_daemon_nor_take_its_port(guarded):
    """
    The forging attack (kill the daemon, bind its port, answer later commands) works against a daemon
    of the command's own user, and fails against this one: EPERM, EADDRINUSE, and the real result.
    """
    # Positive control: a second daemon run by the command user itself falls to the same attack.
    decoy = _free_port()
    _run(
        guarded,
        f"python3 {guarded['base']}/execd.py --host 127.0.0.1 --port {decoy} --access-token decoy 2>/dev/null &",
    )
    assert _wait_serving(f"http://127.0.0.1:{decoy}", "decoy")
    decoy_pid = _wait_alive(f"--port {decoy}")[0]
    code, out = _run(guarded, f"python3 {guarded['base']}/forge.py {decoy_pid} {decoy} 127.0.0.1")
    outcome = json.loads(out[-1])
    try:
        assert (code, outcome["kill"], outcome["bind"]) == (0, "done", "done")
        assert _run(guarded, "echo REAL; exit 3", url=f"http://127.0.0.1:{decoy}", token="decoy") == (
            0,
            ["FORGED-OUTPUT"],
        )
    finally:
        if outcome.get("forger"):
            _kill_quietly(outcome["forger"])
    # The attack itself, on the daemon of this sandbox.
    code, out = _run(guarded, f"python3 {guarded['base']}/forge.py {guarded['pid']} {guarded['port']} 127.0.0.1")
    outcome = json.loads(out[-1])
    assert (outcome["kill"], outcome["bind"], outcome["forger"]) == ("EPERM", "EADDRINUSE", None)
    assert _run(guarded, "echo REAL; exit 3") == (3, ["REAL"])


@needs_root
def test_a_command_cannot_rewrite_the_output_of_another(guarded):
    """A process left behind by one command tries to write into the next command's output file, and cannot."""
    spool = guarded["spool"]
    lurker = (
        "import glob, os, time\n"
        "end = time.time() + 4\n"
        "while time.time() < end:\n"
        f"    for path in glob.glob('{spool}/*.stdout'):\n"
        "        try:\n"
        "            with open(path, 'a') as f: f.write('FORGED-OUTPUT\\n')\n"
        "            print('wrote', path, flush=True)\n"
        "        except OSError as err:\n"
        "            print('refused', err.errno, flush=True)\n"
        "    time.sleep(0.01)\n"
    )
    (guarded["base"] / "work" / "lurker.py").write_text(lurker)
    _run(guarded, "python3 lurker.py > lurker.log 2>&1 &")
    code, out = _run(guarded, "sleep 0.5; echo REAL; exit 3")
    assert (code, out) == (3, ["REAL"])
    time.sleep(4)
    log = (guarded["base"] / "work" / "lurker.log").read_text()
    assert "refused 13" in log and "wrote" not in log  # it really tried: EACCES


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
        daemon["url"] + "/files/download", params={"path": str(target)}, headers={**AUTH, "Range": "bytes=3-9"}
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


def test_an_error_answer_that_ends_the_connection_says_so(daemon, work):
    """
    After an error the daemon closes the connection (the request's body may be unread). Its answer
    says ``Connection: close``, so a client with a pool of kept-alive connections never sends its
    next request on this one: under load it used to, and read "Server disconnected without sending
    a response" (a load run's failure of the 404 test above).
    """
    missing = quote(str(work / "missing"))
    request = (
        f"GET /files/download?path={missing} HTTP/1.1\r\nHost: x\r\nX-EXECD-ACCESS-TOKEN: {TOKEN}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", daemon["port"]), timeout=10) as conn:
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        # The connection really ends after the error (what a client reusing it would meet) ...
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404") and b"FILE_NOT_FOUND" in body, reply
        # ... and the answer says so.
        assert b"\r\nconnection: close" in head.lower(), head
    # A client that keeps connections alive opens a new one for the next request, which is answered.
    with httpx.Client(base_url=daemon["url"], headers=AUTH) as client:
        for _ in range(3):
            assert client.get("/files/download", params={"path": str(work / "missing")}).status_code == 404
            assert client.get("/ping").status_code == 200


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
    only_file = httpx.post(daemon["url"] + "/files/upload", files=[("file", ("x", b"data"))], headers=AUTH)
    assert only_file.status_code == 400 and only_file.json()["code"] == "INVALID_FILE_METADATA"
    no_path = httpx.post(
        daemon["url"] + "/files/upload", files=[("metadata", ("metadata", b"{}")), ("file", ("x", b"d"))], headers=AUTH
    )
    assert no_path.status_code == 400 and no_path.json()["code"] == "INVALID_FILE_METADATA"
    not_multipart = httpx.post(daemon["url"] + "/files/upload", content=b"raw", headers=AUTH)
    assert not_multipart.status_code == 400 and not_multipart.json()["code"] == "INVALID_FILE"


# -- the entrypoint -------------------------------------------------------------------------------


def test_bootstrap_starts_the_daemon_then_becomes_the_command(tmp_path):
    port = _free_port()
    log = tmp_path / "boot.log"
    env = {**os.environ, "EXECD": str(DAEMON), "EXECD_PORT": str(port), "EXECD_HOST": "127.0.0.1", **OWN_USER}
    env["EXECD_ACCESS_TOKEN"] = TOKEN
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
        assert httpx.get(f"http://127.0.0.1:{port}/ping", headers=AUTH).status_code == 200
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
