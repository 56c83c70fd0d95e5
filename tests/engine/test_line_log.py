"""LineLog: a command's output to the task log line by line, bounded, masked, streams told apart."""

from __future__ import annotations

import logging
import threading

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.engine.output import LineLog
from sandbox_provider.operators.sandbox import SandboxOperator


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def recorded():
    logger = logging.getLogger("test.line_log")
    logger.propagate = False
    handler = Recorder()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield logger, handler.lines
    logger.removeHandler(handler)


def test_lines_are_logged_whole_as_they_end(recorded):
    logger, lines = recorded
    live = LineLog(logger)
    live("stdout", b"line 1\nli")
    assert lines == ["[stdout] line 1"]
    live("stderr", b"oops\r\n")
    live("stdout", b"ne 2\n")
    assert lines == ["[stdout] line 1", "[stderr] oops", "[stdout] line 2"]
    live("stdout", b"no newline at the end")
    live.flush()
    assert lines[-1] == "[stdout] no newline at the end"


def test_a_character_split_between_pieces_stays_whole(recorded):
    logger, lines = recorded
    live = LineLog(logger)
    data = "naïve ünïcode\n".encode()
    for i in range(len(data)):
        live("stdout", data[i : i + 1])
    assert lines == ["[stdout] naïve ünïcode"]
    live("stdout", b"\xff\xfe bad bytes\n")
    assert lines[-1] == "[stdout] \ufffd\ufffd bad bytes"


def test_a_line_without_end_is_logged_in_bounded_pieces(recorded):
    logger, lines = recorded
    live = LineLog(logger, max_line_chars=10)
    for _ in range(100):
        live("stdout", b"x" * 7)  # 700 characters, never a newline
        assert len(live._held["stdout"]) <= 10
    live("stdout", b"\n")
    assert lines[0] == "[stdout] " + "x" * 10
    assert all(line == "[stdout+] " + "x" * 10 for line in lines[1:])
    assert sum(len(line.split(" ", 1)[1]) for line in lines) == 700


def test_secrets_are_masked_before_they_are_logged(recorded):
    from airflow.sdk.log import mask_secret

    logger, lines = recorded
    mask_secret("hunter2-line-log-secret")
    live = LineLog(logger)
    live("stdout", b"the password is hunter2-line-")
    live("stdout", b"log-secret!\n")
    assert lines == ["[stdout] the password is ***!"]


def test_two_reader_threads_never_interleave_a_line(recorded):
    logger, lines = recorded
    live = LineLog(logger)

    def write(stream, char):
        for _ in range(200):
            live(stream, (char * 50).encode())
            live(stream, (char * 50 + "\n").encode())

    threads = [threading.Thread(target=write, args=(s, c)) for s, c in (("stdout", "o"), ("stderr", "e"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(lines)) == ["[stderr] " + "e" * 100, "[stdout] " + "o" * 100]
    assert len(lines) == 400


def test_the_operator_logs_each_line_while_the_command_runs(tmp_path, monkeypatch):
    """The first line reaches the log before the command ends: the command waits for the test to see it."""
    from unittest import mock

    import sandbox_provider.operators.sandbox as operator_module

    hook = FakeSandboxHook(str(tmp_path / "fake"))
    gate = tmp_path / "gate"
    logged: list[tuple[str, bool]] = []

    class Watched(LineLog):
        def _emit(self, stream, line):
            super()._emit(stream, line)
            logged.append((f"[{stream}] {line}", gate.exists()))
            if line == "line 1":
                gate.write_text("go")  # only now may the command go on

    monkeypatch.setattr(operator_module, "LineLog", Watched)
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command=f"echo line 1; while [ ! -e {gate} ]; do sleep 0.05; done; echo line 2; echo err >&2",
        timeout=60,
    )
    result = op.execute({"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1)})
    assert logged[0] == ("[stdout] line 1", False)  # logged while the command still waited
    assert sorted(line for line, _ in logged) == ["[stderr] err", "[stdout] line 1", "[stdout] line 2"]
    assert result["stdout"] == "line 1\nline 2\n" and result["stderr"] == "err\n"  # the tails stay


def test_a_flush_from_a_signal_handler_that_interrupted_a_write_gives_up(recorded):
    logger, lines = recorded
    live = LineLog(logger)
    live("stdout", b"partial")
    with live._lock:  # the writer was interrupted holding the lock, on this same thread
        live.flush()  # returns after its wait instead of deadlocking
    assert lines == []
    live.flush()
    assert lines == ["[stdout] partial"]
