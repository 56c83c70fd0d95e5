"""
Batch transfers on the Docker backend against a real Engine: a whole mapping in one exec per
direction, with the command user's rights, and the Engine requests a ``@task.sandbox`` costs.
"""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from airflow.sdk import task

from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ImportEntry
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError

docker = pytest.importorskip("docker")

from sandbox_provider.hooks.docker import DockerSandboxHook  # noqa: E402

pytestmark = pytest.mark.docker

UID = 65432


@task.sandbox
def add(a, b):
    return a + b


@pytest.fixture(scope="module")
def hook(docker_conn):
    return DockerSandboxHook(docker_conn, pull="never")


@pytest.fixture
def sandbox(hook):
    handle = hook.create()
    yield handle
    hook.destroy(handle)


class Requests:
    """Counts the HTTP requests the docker SDK sends (at its ``APIClient.send``), by method and path."""

    def __init__(self, monkeypatch) -> None:
        import docker.api.client

        self.sent: list[tuple[str, str]] = []
        original = docker.api.client.APIClient.send

        def send(client, request, **kwargs):
            self.sent.append((request.method, request.path_url.split("?")[0]))
            return original(client, request, **kwargs)

        monkeypatch.setattr(docker.api.client.APIClient, "send", send)

    def execs(self) -> int:
        return sum(1 for method, path in self.sent if method == "POST" and path.endswith("/exec"))


def entry(path: str, data: bytes) -> ImportEntry:
    return ImportEntry(path=path, size=len(data), open=lambda: io.BytesIO(data))


class Sink:
    """An export sink keeping each file's bytes in memory, and the order of its calls."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, str], bytes] = {}
        self.streams: dict[tuple[int, str], io.BytesIO] = {}

    def begin(self, index: int, name: str) -> io.BytesIO:
        self.streams[(index, name)] = io.BytesIO()
        return self.streams[(index, name)]

    def end(self, index: int, name: str, size: int) -> None:
        data = self.streams.pop((index, name)).getvalue()
        assert len(data) == size
        self.files[(index, name)] = data


LIMITS = ExportLimits(max_file_bytes=10**6, max_total_bytes=10**7)


def sh(hook, handle, command):
    return hook.run_command(handle, command, timeout=30, max_output_bytes=64 * 1024)


def test_a_mapping_goes_in_with_one_exec_as_the_command_user(hook, sandbox, monkeypatch):
    sh(hook, sandbox, "mkdir -p real && ln -s real linked && ln -s /etc/passwd trap")
    entries = [
        entry("top.txt", b"top\n"),
        entry("deep/er/file.bin", bytes(range(256)) * 4096),
        entry("linked/through.txt", b"through a symlinked directory\n"),
        entry("trap", b"replaced, not followed\n"),
        entry("/tmp/absolute.txt", b"abs\n"),
        entry("empty", b""),
        entry("name with spaces and \u00e9", b"x"),
        entry("a" * 120 + "/" + "b" * 120, b"long"),  # over tar's 100-byte name field: a PAX header
    ]
    requests = Requests(monkeypatch)
    assert hook.import_batch(sandbox, entries) == sum(e.size for e in entries)
    assert requests.execs() == 1, requests.sent
    listing = sh(
        hook, sandbox, "stat -c '%u %a %s %n' top.txt deep/er/file.bin real/through.txt trap /tmp/absolute.txt"
    )
    assert listing.stdout.split("\n")[:5] == [
        f"{UID} 644 4 top.txt",
        f"{UID} 644 1048576 deep/er/file.bin",
        f"{UID} 644 30 real/through.txt",
        f"{UID} 644 23 trap",
        f"{UID} 644 4 /tmp/absolute.txt",
    ]
    assert hook.read_file(sandbox, "trap", max_bytes=100) == b"replaced, not followed\n"
    assert hook.read_file(sandbox, "deep/er/file.bin", max_bytes=10**7) == bytes(range(256)) * 4096
    assert hook.read_file(sandbox, "a" * 120 + "/" + "b" * 120, max_bytes=10) == b"long"
    assert "root:" in sh(hook, sandbox, "cat /etc/passwd").stdout  # the symlink's old target is untouched


def test_staging_has_only_the_command_users_rights(hook, sandbox):
    # The positive control: the same batch without the forbidden entry goes in.
    assert hook.import_batch(sandbox, [entry("ok.txt", b"ok")]) == 2
    for path in ("/usr/bin/sleep", "/.airflow-sandbox/tags.json", "/etc/evil"):
        with pytest.raises(SandboxError, match=f"Could not write '{path}' into the sandbox: Cannot open"):
            hook.import_batch(sandbox, [entry("fine.txt", b"x"), entry(path, b"#!/bin/sh\necho owned\n")])
    assert "owned" not in sh(hook, sandbox, "cat /usr/bin/sleep /etc/evil 2>&1 | head -c 100").stdout


def test_an_exec_that_ended_is_not_taken_for_a_timeout_while_its_reader_thread_exits(hook, sandbox, monkeypatch):
    """
    The reader thread of an exec still runs for a moment after it marked the stream ended (longer
    on a loaded machine, where the scheduler may pause it right there): the hook must go by that
    mark, not by whether the thread is alive, or it sweeps a finished exec and reports a timeout.
    """
    from sandbox_provider.hooks.docker import exec as _docker_exec

    finish = _docker_exec._Pump.run

    def lingering(pump):
        finish(pump)
        time.sleep(0.3)  # what a preempted thread looks like to the waiting one

    monkeypatch.setattr(_docker_exec._Pump, "run", lingering)
    assert hook.import_batch(sandbox, [entry("ok.txt", b"ok")]) == 2
    result = sh(hook, sandbox, "echo alive")
    assert (result.stdout, result.exit_code, result.timed_out) == ("alive\n", 0, False)


def test_a_source_that_lies_about_its_size_fails_naming_it(hook, sandbox):
    short = ImportEntry(path="short.txt", size=10, open=lambda: io.BytesIO(b"abc"))
    with pytest.raises(SandboxError, match="short.txt"):
        hook.import_batch(sandbox, [entry("first.txt", b"1"), short, entry("after.txt", b"2")])
    broken = ImportEntry(path="broken.txt", size=3, open=lambda: (_ for _ in ()).throw(OSError("gone")))
    with pytest.raises(SandboxError, match="broken.txt.*gone"):
        hook.import_batch(sandbox, [broken])


def test_trees_globs_and_files_come_out_in_one_exec(hook, sandbox, monkeypatch):
    hook.import_batch(
        sandbox,
        [
            entry("out/a.csv", b"a"),
            entry("out/sub/b.csv", b"bb"),
            entry("out/.hidden", b"h"),
            entry("out/notes.txt", b"n"),
            entry("elsewhere/target.txt", b"via a link"),
            entry("single.json", b"{}"),
        ],
    )
    sh(hook, sandbox, "ln -s ../elsewhere/target.txt out/link.txt && ln -s ../elsewhere out/dirlink")
    requests = Requests(monkeypatch)
    sink = Sink()
    wanted = [
        ExportRequest("out", "tree"),
        ExportRequest("out/*.csv", "glob"),
        ExportRequest("single.json", "file"),
        ExportRequest("nothing/*.csv", "glob"),
    ]
    total = hook.export_batch(sandbox, wanted, sink, limits=LIMITS)
    assert requests.execs() == 1, requests.sent
    assert sink.files == {
        (0, "a.csv"): b"a",
        (0, "sub/b.csv"): b"bb",
        (0, ".hidden"): b"h",
        (0, "notes.txt"): b"n",
        (0, "link.txt"): b"via a link",
        (0, "dirlink/target.txt"): b"via a link",
        (1, "a.csv"): b"a",
        (2, "single.json"): b"{}",
    }
    assert total == sum(len(v) for v in sink.files.values())


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (ExportRequest("missing.txt", "file"), "does not exist"),
        (ExportRequest("dir", "file"), "is a directory"),
        (ExportRequest("fifo", "file"), "not a regular file"),
        (ExportRequest("plain.txt", "tree"), "is not a directory"),
        (ExportRequest("withfifo", "tree"), "not a regular file"),
        (ExportRequest("dangling", "tree"), "dangling"),
        (ExportRequest("secret/*", "glob"), "Permission denied|cannot be read"),
    ],
    ids=["missing", "directory", "fifo", "tree-of-a-file", "fifo-in-tree", "dangling-link", "unreadable"],
)
def test_what_cannot_be_exported_fails_the_whole_batch(hook, sandbox, request_, message):
    sh(
        hook,
        sandbox,
        "mkdir -p dir withfifo dangling secret && echo x > plain.txt && mkfifo fifo withfifo/f && "
        "ln -s /nonexistent dangling/gone && ln -s /etc/shadow secret/s",
    )
    sink = Sink()
    with pytest.raises(SandboxError, match=message):
        hook.export_batch(sandbox, [ExportRequest("plain.txt", "file"), request_], sink, limits=LIMITS)


def test_limits_hold_before_a_byte_is_handed_over(hook, sandbox):
    hook.import_batch(sandbox, [entry("big/one.bin", b"1" * 5000), entry("big/two.bin", b"2" * 5000)])
    sink = Sink()
    with pytest.raises(SandboxFileTooLargeError):
        hook.export_batch(sandbox, [ExportRequest("big", "tree")], sink, limits=ExportLimits(4000, 10**6))
    with pytest.raises(SandboxFileTooLargeError):
        hook.export_batch(sandbox, [ExportRequest("big", "tree")], Sink(), limits=ExportLimits(10**6, 8000))
    with pytest.raises(SandboxError, match="more than 1 files"):
        hook.export_batch(sandbox, [ExportRequest("big", "tree")], Sink(), limits=ExportLimits(10**6, 10**6, 1))
    # The next command still runs: a refused export swept what it had started.
    assert sh(hook, sandbox, "echo alive").stdout == "alive\n"


class SlowSink(Sink):
    """A sink whose streams take ``pause`` seconds per write: a slow destination, so the exec's pipe backs up."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def begin(self, index: int, name: str) -> io.BytesIO:
        stream = super().begin(index, name)
        write = stream.write

        def slow(data) -> int:
            time.sleep(self.pause)
            return write(data)

        stream.write = slow  # type: ignore[method-assign]
        return stream


def test_an_export_cut_off_by_its_allowance_is_reported_as_a_timeout(hook, sandbox, monkeypatch):
    """
    A destination slower than the allowance: the exec is stopped mid-archive, so the reader finds the
    archive cut inside a member. That is a timeout, never "archive ended inside ...". The control: the
    same export with the allowance it normally has comes out whole.
    """
    from sandbox_provider.sandbox import batch_stream

    sh(hook, sandbox, "mkdir -p many && for i in $(seq 1 20); do head -c 300000 /dev/urandom > many/f$i; done")
    whole = Sink()
    assert hook.export_batch(sandbox, [ExportRequest("many", "tree")], whole, limits=LIMITS) == 20 * 300000
    assert len(whole.files) == 20
    monkeypatch.setattr(batch_stream, "FILE_OP_TIMEOUT", 1.0)
    monkeypatch.setattr(batch_stream, "SECONDS_PER_FILE", 0.0)
    monkeypatch.setattr(hook, "min_transfer_rate", 10**12)
    started = time.monotonic()
    with pytest.raises(SandboxError, match="Timed out while exporting") as caught:
        hook.export_batch(sandbox, [ExportRequest("many", "tree")], SlowSink(0.2), limits=LIMITS)
    assert "archive ended" not in str(caught.value)
    assert time.monotonic() - started < 30
    # The next command still runs: the cut-off export swept what it had started.
    assert sh(hook, sandbox, "echo alive").stdout == "alive\n"


def test_a_batch_is_allowed_time_per_file_as_well_as_per_byte():
    from sandbox_provider.sandbox import batch_stream

    rate = 8 * 1024 * 1024
    few = batch_stream.transfer_allowance(10 * 1024**3, 10, rate)
    many = batch_stream.transfer_allowance(10 * 1024**3, 100_000, rate)
    assert few == pytest.approx(10 * 1024**3 / rate + 10 * batch_stream.SECONDS_PER_FILE)
    assert many - few == pytest.approx((100_000 - 10) * batch_stream.SECONDS_PER_FILE)
    assert batch_stream.transfer_allowance(1, 1, rate) == batch_stream.FILE_OP_TIMEOUT


def test_files_staged_with_the_command_go_in_its_own_exec(hook, sandbox, monkeypatch):
    requests = Requests(monkeypatch)
    staged = [entry("job/in.txt", b"hello\n"), entry("/tmp/job.sh", b"cat job/in.txt; read line || echo eof\n")]
    result = hook.run_command(
        sandbox, "sh /tmp/job.sh; stat -c %u job/in.txt", timeout=30, max_output_bytes=4096, stage=staged
    )
    assert (result.exit_code, result.stdout) == (0, f"hello\neof\n{UID}\n")  # stdin is /dev/null
    assert requests.execs() == 1, requests.sent
    # A staging failure raises before the command runs, naming the file.
    with pytest.raises(SandboxError, match="Could not write '/etc/evil' into the sandbox"):
        hook.run_command(
            sandbox, "touch ran", timeout=30, max_output_bytes=4096, stage=[entry("ok", b""), entry("/etc/evil", b"x")]
        )
    assert sh(hook, sandbox, "test -e ran || echo not-run").stdout == "not-run\n"
    # The positive control: a command that exits 125 by itself is its own result.
    assert (
        hook.run_command(sandbox, "exit 125", timeout=30, max_output_bytes=4096, stage=[entry("ok", b"")]).exit_code
        == 125
    )


def test_a_command_staged_with_its_files_that_overruns_its_deadline_timed_out(hook, sandbox):
    # The exec's own allowance includes the staging; the command's deadline is what judges it.
    staged = [entry("job/in.txt", b"x")]
    result = hook.run_command(sandbox, "sleep 30", timeout=1, max_output_bytes=4096, stage=staged)
    assert (result.timed_out, result.exit_code) == (True, 137)
    # The positive control: one that ends within it did not.
    assert not hook.run_command(sandbox, "exit 137", timeout=30, max_output_bytes=4096, stage=staged).timed_out


def test_the_steps_of_a_task_sandbox_call_cost_six_engine_requests(hook, monkeypatch):
    """
    What ``@task.sandbox`` asks of the hook: create, run with its three files staged and its result
    read back by the same exec, read the result, destroy.
    """
    hook._client()  # the API version is negotiated once per worker process, not per task
    requests = Requests(monkeypatch)
    handle = hook.create()
    files = [entry("t/source.py", b"def add(a, b):\n    return a + b\n"), entry("t/call.json", b"[1, 2]")]
    script = "import json; open('t/result.json', 'w').write(json.dumps(sum(json.load(open('t/call.json')))))"
    staged = [*files, entry("t/runner.py", b"import json\n")]
    result = hook.run_command(
        handle, f'python3 -c "{script}"', timeout=60, max_output_bytes=4096, stage=staged, read_back="t/result.json"
    )
    assert result.ok, result
    assert hook.read_file(handle, "t/result.json", max_bytes=100) == b"3"
    hook.destroy(handle)
    # The sweep of leftovers, create, start; one exec of two requests; the removal.
    assert len(requests.sent) == 6, json.dumps(requests.sent)
    assert requests.execs() == 1


def test_a_file_read_back_with_the_command_is_what_a_read_finds(hook, sandbox, monkeypatch):
    """
    ``read_back`` only saves the read's exec: the bytes are the file's as the command user reads it
    after the command, and every case the copy cannot serve is read on its own, with its own errors.
    """
    staged = [entry("job/x", b"")]

    def run(command, path, **kwargs):
        return hook.run_command(sandbox, command, timeout=30, max_output_bytes=4096, stage=staged, read_back=path)

    requests = Requests(monkeypatch)
    assert run("printf 'ok\\001\\036' > out.bin", "out.bin").ok
    assert hook.read_file(sandbox, "out.bin", max_bytes=10) == b"ok\x01\x1e"
    assert requests.execs() == 1
    # The positive control of the next case: a command that forges a trailer with its own bytes.
    forged = base64.b64encode(b"forged").decode()
    run(
        f"echo real > out.txt; printf '\\036sandbox-status:%s:0:{forged}\\n' \"$AIRFLOW_SANDBOX_STATUS\" >&2", "out.txt"
    )
    assert hook.read_file(sandbox, "out.txt", max_bytes=100) == b"real\n"
    # Read on their own: over the caller's limit, over the read-back limit, missing, unreadable,
    # a symlink into the keeper's directory, a program run after the command.
    run("head -c 200 /dev/zero > big.bin", "big.bin")
    with pytest.raises(SandboxFileTooLargeError):
        hook.read_file(sandbox, "big.bin", max_bytes=100)
    run("head -c 70000 /dev/zero > bigger.bin", "bigger.bin")
    before = requests.execs()
    assert hook.read_file(sandbox, "bigger.bin", max_bytes=10**6) == bytes(70000)
    assert requests.execs() == before + 1
    run("true", "missing.txt")
    with pytest.raises(SandboxError, match="does not exist|cannot be read"):
        hook.read_file(sandbox, "missing.txt", max_bytes=100)
    run("ln -sf /.airflow-sandbox/tags.json link.json && echo x > shut.txt && chmod 000 shut.txt", "link.json")
    with pytest.raises(SandboxError):
        hook.read_file(sandbox, "link.json", max_bytes=100)
    run("true", "shut.txt")
    with pytest.raises(SandboxError):
        hook.read_file(sandbox, "shut.txt", max_bytes=100)
    run("echo old > seq.txt", "seq.txt")
    hook.write_file(sandbox, "seq.txt", b"new\n")
    assert hook.read_file(sandbox, "seq.txt", max_bytes=100) == b"new\n"
    # A failed command reads nothing back.
    before = requests.execs()
    assert run("echo kept > failed.txt; exit 3", "failed.txt").exit_code == 3
    assert hook.read_file(sandbox, "failed.txt", max_bytes=100) == b"kept\n"
    assert requests.execs() == before + 2


def test_a_task_sandbox_call_costs_at_most_ten_engine_requests(hook, monkeypatch):
    """
    ``@task.sandbox`` returning a + b, in-task, counted at the SDK's transport. The API version is
    negotiated once per worker process (the module's hook does it first), not per task.
    """
    from unittest import mock

    from airflow.sdk import DAG

    from sandbox_provider.engine import transfer

    if not hasattr(transfer, "stage_entries"):  # the engine of issue 14 (branch perf-local) stages per file
        pytest.skip("the session engine here stages files one by one; this count needs its batch staging")
    with DAG("count_requests", schedule=None) as dag:
        add(1, 2)
    operator = dag.tasks[0]
    operator.backend = DockerSandboxHook(hook.sandbox_conn_id, pull="never")
    ti = mock.MagicMock(dag_id="count_requests", run_id="r", task_id=operator.task_id, map_index=-1, try_number=1)
    # The negotiation done before counting: this test may be the first of its worker process to reach the Engine.
    hook._client()
    requests = Requests(monkeypatch)
    assert operator.execute({"ti": ti, "run_id": "r"}) == 3
    assert len(requests.sent) <= 10, json.dumps(requests.sent)
