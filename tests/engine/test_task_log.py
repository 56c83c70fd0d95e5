"""
TaskLog: a command's output to the task log line by line, masked, streams told apart, as the task's
log_output says, and never in the way of the reader: lines the log cannot keep up with are counted
and left out of it, never out of the result.
"""

from __future__ import annotations

import logging
import threading
from unittest import mock

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.engine.output import tail_text
from sandbox_provider.engine.task_log import LogPolicy, TaskLog, log_policy
from sandbox_provider.operators.sandbox import SandboxOperator


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def recorded():
    logger = logging.getLogger("test.task_log")
    logger.propagate = False
    handler = Recorder()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield logger, handler.lines
    logger.removeHandler(handler)


class Gate:
    """A logger that holds every line until the test opens it: a task log that cannot keep up."""

    def __init__(self):
        self.open = threading.Event()
        self.lines: list[str] = []

    def info(self, message, *args):
        self.open.wait(60)
        self.lines.append(message % args)


def _context():
    return {"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1)}


def _seq(first: int, last: int) -> bytes:
    return "".join(f"{i}\n" for i in range(first, last + 1)).encode()


# -- lines -----------------------------------------------------------------------------------------------


def test_lines_are_logged_whole_as_they_end(recorded):
    logger, lines = recorded
    live = TaskLog(logger)
    live("stdout", b"line 1\nli")
    live("stderr", b"oops\r\n")
    live("stdout", b"ne 2\n")
    live("stdout", b"no newline at the end")
    live.flush()
    assert lines == ["[stdout] line 1", "[stderr] oops", "[stdout] line 2", "[stdout] no newline at the end"]


def test_a_character_split_between_pieces_stays_whole(recorded):
    logger, lines = recorded
    live = TaskLog(logger)
    data = "naïve ünïcode\n".encode()
    for i in range(len(data)):
        live("stdout", data[i : i + 1])
    live("stdout", b"\xff\xfe bad bytes\n")
    live.flush()
    assert lines == ["[stdout] naïve ünïcode", "[stdout] \ufffd\ufffd bad bytes"]


def test_a_line_without_end_is_logged_in_bounded_pieces(recorded):
    logger, lines = recorded
    live = TaskLog(logger, max_line_bytes=10)
    for _ in range(100):
        live("stdout", b"x" * 7)  # 700 bytes, never a newline
        assert len(live._held["stdout"]) <= 10
    live("stdout", "é\n".encode())
    live.flush()
    assert lines[0] == "[stdout] " + "x" * 10
    assert all(line.startswith("[stdout+] ") for line in lines[1:])
    assert "".join(line.split(" ", 1)[1] for line in lines) == "x" * 700 + "é"  # no character cut in two


def test_secrets_are_masked_before_they_are_logged(recorded):
    from airflow.sdk.log import mask_secret

    logger, lines = recorded
    mask_secret("hunter2-task-log-secret")
    live = TaskLog(logger)
    live("stdout", b"the password is hunter2-task-")
    live("stdout", b"log-secret!\n")
    live.flush()
    assert lines == ["[stdout] the password is ***!"]


def test_two_reader_threads_never_interleave_a_line(recorded):
    logger, lines = recorded
    live = TaskLog(logger)

    def write(stream, char):
        for _ in range(200):
            live(stream, (char * 50).encode())
            live(stream, (char * 50 + "\n").encode())

    threads = [threading.Thread(target=write, args=(s, c)) for s, c in (("stdout", "o"), ("stderr", "e"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live.flush()
    assert sorted(set(lines)) == ["[stderr] " + "e" * 100, "[stdout] " + "o" * 100]
    assert len(lines) == 400


def test_a_flush_from_a_signal_handler_that_interrupted_a_write_gives_up(recorded):
    logger, lines = recorded
    live = TaskLog(logger)
    live("stdout", b"partial")
    with live._lock:  # the reader was interrupted holding the lock, on this same thread
        assert live.flush() is False  # returns after its wait instead of deadlocking
    assert lines == []
    assert live.flush() is True
    assert lines == ["[stdout] partial"]
    assert live.flush() is True and lines == ["[stdout] partial"]  # nothing new: nothing logged again


# -- never in the reader's way -----------------------------------------------------------------------------


def test_the_reader_never_waits_for_a_log_that_cannot_keep_up():
    gate = Gate()
    live = TaskLog(gate, queue_lines=100)
    reader = threading.Thread(target=lambda: [live("stdout", _seq(i * 1000 + 1, i * 1000 + 1000)) for i in range(200)])
    reader.start()
    reader.join(30)
    # The positive control: the log is still shut (not one line written), yet all 200,000 lines were read.
    assert not reader.is_alive() and gate.lines == []
    assert live.seen["stdout"][0] == 200_000
    gate.open.set()
    assert live.flush()
    logged = [line for line in gate.lines if line.startswith("[stdout] ")]
    assert len(logged) == 100  # what the queue held
    assert live.left_out[0] == 200_000 - len(logged)
    note = [line for line in gate.lines if line.startswith("[... ")]
    assert note and "of stdout not logged: the command wrote faster than the task log takes lines" in note[0]
    counted = sum(int(line.split()[1]) for line in note)
    assert counted == live.left_out[0]  # the notes say exactly how many lines they stand for


def test_a_blocked_log_without_a_bound_would_hold_the_reader():
    # The positive control of the test above: a logger that blocks holds up a reader that writes to it itself.
    gate = Gate()
    reader = threading.Thread(target=lambda: gate.info("%s", "line"))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()
    gate.open.set()
    reader.join(5)


# -- the modes ---------------------------------------------------------------------------------------------


def test_all_logs_every_line_in_order_across_streams(recorded):
    logger, lines = recorded
    live = TaskLog(logger, LogPolicy("all"))
    live("stdout", b"1\n2\n")
    live("stderr", b"e\n")
    live("stdout", b"3\n")
    live.flush()
    assert lines == ["[stdout] 1", "[stdout] 2", "[stderr] e", "[stdout] 3"]
    assert live.left_out == [0, 0]


def test_head_tail_logs_the_first_and_last_lines_and_counts_the_rest(recorded):
    logger, lines = recorded
    live = TaskLog(logger, LogPolicy("head_tail", lines=3))
    for i in range(1, 101, 7):  # pieces that do not fall on the kept lines' edges
        live("stdout", _seq(i, min(i + 6, 100)))
    live("stderr", b"the end\n")
    live.flush()
    assert lines == [
        "[stdout] 1",
        "[stdout] 2",
        "[stdout] 3",
        "[... 95 lines (279B) of stdout not logged: log_output='head_tail' logs the first and last 3 lines; "
        "the result keeps the end of each stream ...]",
        "[stdout] 99",
        "[stdout] 100",
        "[stderr] the end",
    ]
    assert sum(len(f"{i}\n") for i in range(4, 99)) == 279
    assert live.left_out == [95, 279]


def test_head_tail_with_fewer_lines_than_both_ends_logs_them_all(recorded):
    logger, lines = recorded
    live = TaskLog(logger, LogPolicy("head_tail", lines=3))
    live("stdout", _seq(1, 6))
    live.flush()
    assert lines == [f"[stdout] {i}" for i in range(1, 7)]


def test_none_logs_a_count_only(recorded):
    logger, lines = recorded
    live = TaskLog(logger, LogPolicy("none"))
    live("stdout", _seq(1, 10))
    live("stderr", b"warning\n")
    live.flush()
    assert lines == [
        "The command printed 10 lines (21B) of stdout and 1 line (8B) of stderr, not logged: log_output='none'"
    ]


def test_the_byte_ceiling_holds_in_every_mode(recorded):
    logger, lines = recorded
    for mode in ("all", "head_tail"):
        lines.clear()
        live = TaskLog(logger, LogPolicy(mode, lines=1000, max_bytes=100))
        for i in range(1, 1001, 50):
            live("stdout", _seq(i, i + 49))
        live.flush()
        shown = [line.split(" ", 1)[1] for line in lines if line.startswith("[stdout] ")]
        assert sum(len(s) + 1 for s in shown) <= 100
        assert shown == [str(i) for i in range(1, len(shown) + 1)]  # the first lines, whole
        notes = [line for line in lines if line.startswith("[... ")]
        assert sum(int(note.split()[1]) for note in notes) == 1000 - len(shown)  # each note counts its part
        assert all("log_output_max_bytes=100 was reached" in note for note in notes)


# -- settings ----------------------------------------------------------------------------------------------


def test_the_policy_comes_from_the_argument_else_the_connection_else_the_default(add_connection):
    hook = FakeSandboxHook()
    assert log_policy({}, hook, hook) == LogPolicy("all", 100, None)
    add_connection("chatty", "sandbox_local", extra={"log_output": "head_tail", "log_output_max_bytes": "4096"})
    assert log_policy({}, None, "chatty") == LogPolicy("head_tail", 100, 4096)
    assert log_policy({"log_output": "none"}, None, "chatty") == LogPolicy("none", 100, 4096)
    add_connection("sandbox_default", "sandbox", extra={"log_output_lines": 7})  # the hook's default connection
    assert log_policy({}, hook, hook) == LogPolicy("all", 7, None)
    add_connection("typo", "sandbox_local", extra={"log_output": "some"})
    with pytest.raises(ValueError, match="Connection 'typo' extra 'log_output' must be one of 'all', 'head_tail'"):
        log_policy({}, None, "typo")


def test_the_operator_refuses_a_bad_setting_when_the_dag_is_parsed():
    with pytest.raises(ValueError, match="log_output must be one of"):
        SandboxOperator(task_id="t", command="true", log_output="most")
    with pytest.raises(ValueError, match="log_output_lines must be a whole number from 1 to 1000"):
        SandboxOperator(task_id="t", command="true", log_output_lines=0)


def test_the_result_keeps_its_tails_exact_whatever_the_log_leaves_out(tmp_path, monkeypatch):
    import sandbox_provider.operators.sandbox as operator_module

    made: list[TaskLog] = []

    def small(logger, policy):
        made.append(TaskLog(logger, policy, queue_lines=10))
        return made[-1]

    monkeypatch.setattr(operator_module, "TaskLog", small)
    hook = FakeSandboxHook(str(tmp_path / "fake"))
    op = SandboxOperator(
        task_id="t", backend=hook, command="seq 1 20000", timeout=60, log_output="head_tail", log_output_lines=5
    )
    result = op.execute(_context())
    assert result["stdout"] == tail_text(_seq(1, 20000).decode(), 2000)
    assert made[0].seen["stdout"] == [20000, len(_seq(1, 20000))]
    assert made[0].left_out[0] == 20000 - 10


def test_the_operator_logs_each_line_while_the_command_runs(tmp_path, monkeypatch):
    """The first line reaches the log before the command ends: the command waits for the test to see it."""
    import sandbox_provider.operators.sandbox as operator_module

    hook = FakeSandboxHook(str(tmp_path / "fake"))
    gate = tmp_path / "gate"
    logged: list[tuple[str, bool]] = []

    class Watched(TaskLog):
        def _log_lines(self, stream, block, continued):
            super()._log_lines(stream, block, continued)
            for line in block.decode().splitlines():
                logged.append((f"[{stream}] {line}", gate.exists()))
                if line == "line 1":
                    gate.write_text("go")  # only now may the command go on

    monkeypatch.setattr(operator_module, "TaskLog", Watched)
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command=f"echo line 1; while [ ! -e {gate} ]; do sleep 0.05; done; echo line 2; echo err >&2",
        timeout=60,
    )
    result = op.execute(_context())
    assert logged[0] == ("[stdout] line 1", False)  # logged while the command still waited
    assert sorted(line for line, _ in logged) == ["[stderr] err", "[stdout] line 1", "[stdout] line 2"]
    assert result["stdout"] == "line 1\nline 2\n" and result["stderr"] == "err\n"  # the tails stay


def test_inline_logs_as_each_call_returns_and_leaves_nothing_out(recorded):
    """The triggerer's relay: the sandbox keeps the output, so the reader may wait, and must not move past a line unlogged."""
    logger, lines = recorded
    live = TaskLog(logger, queue_lines=2, inline=True)
    live("stdout", _seq(1, 10))
    assert lines == [f"[stdout] {i}" for i in range(1, 11)]  # already logged, all ten past a queue of two
    live("stdout", b"unended")
    live.flush()
    assert lines[-1] == "[stdout] unended" and live.left_out == [0, 0]
    assert live._writer is None
