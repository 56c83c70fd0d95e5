"""
The staging line's seconds are staging's (issue 28): a task whose files go in with the command's own
launch said ``Staged 1 file(s) ... (97.7KB in 60.2s)`` for a 60 s command, after the command's output.
Files staged in a step of their own are timed alone; files that go in with the launch are announced
before it, with no seconds claimed.
"""

from __future__ import annotations

import logging
import re
import time
from unittest import mock

import sandbox_provider.operators.sandbox as operator_module
from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.engine.task_log import TaskLog
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.operators.sandbox import SandboxOperator
from sandbox_provider.sandbox import SandboxSession

#: The seconds a staging line claims: ``(<size> in <seconds>s)``.
CLAIMED = re.compile(r" in (\d+\.\d)s\)")
#: How long the slow hook takes to write the files in, and the command after it runs.
IMPORT_SECONDS, COMMAND_SECONDS = 0.6, 2.5


class SlowImports(FakeSandboxHook):
    """A fake backend whose file writes take IMPORT_SECONDS."""

    def import_batch(self, handle, entries):
        time.sleep(IMPORT_SECONDS)
        return super().import_batch(handle, entries)


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_files_staged_on_their_own_report_the_seconds_of_their_writing(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with SandboxSession(SlowImports(str(tmp_path / "sandboxes")), files={"a.txt": "a"}) as session:
        session.ensure()  # stages as a step of its own
        result = session.run(f"sleep {COMMAND_SECONDS}; cat a.txt", timeout=30, max_output_bytes=100)
    assert result.ok and result.stdout == "a"
    staged = [line for line in _messages(caplog) if line.startswith("Staged ")]
    assert len(staged) == 1, _messages(caplog)
    claimed = float(CLAIMED.search(staged[0]).group(1))
    # The writing's own seconds (rounded to a tenth), far from the command's that came after them.
    assert IMPORT_SECONDS - 0.05 <= claimed < COMMAND_SECONDS, staged[0]


@requires_bwrap
def test_files_that_go_in_with_the_launch_are_announced_before_it_with_no_seconds(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="sandbox_provider")
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"), uid_lease_dir=str(tmp_path / "ids"))
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command=f"sleep {COMMAND_SECONDS}; wc -c < a.txt; echo ran",
        files={"a.txt": "x" * 100_000},
        timeout=60,
    )
    context = {"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1)}
    # One record, in order, of the engine's lines and of the command's lines as the task log gets them.
    both = Recorder()
    transfer = logging.getLogger("sandbox_provider.engine.transfer")

    class Recorded(TaskLog):
        def _log_lines(self, stream, block, continued):
            super()._log_lines(stream, block, continued)
            both.lines.extend(f"[{stream}] {line}" for line in block.decode().splitlines())

    monkeypatch.setattr(operator_module, "TaskLog", Recorded)
    transfer.addHandler(both)
    try:
        result = op.execute(context)
    finally:
        transfer.removeHandler(both)
    assert result["stdout"] == "100000\nran\n"
    messages = both.lines
    staging = [i for i, line in enumerate(messages) if "file(s) into sandbox" in line]
    assert len(staging) == 1, messages
    line = messages[staging[0]]
    assert line.startswith("Staging 1 file(s) into sandbox") and "with the command's own launch" in line, line
    assert "97.7KB" in line and not CLAIMED.search(line), line  # what goes in, and no seconds it cannot know
    ran = [i for i, text in enumerate(messages) if text == "[stdout] ran"]
    assert ran and staging[0] < ran[0], messages  # said before the command's output, not after it


@requires_bwrap
def test_the_provisioning_line_says_where_a_local_sandbox_lives(tmp_path, caplog):
    # One line per sandbox made: the engine's, with the backend's words for where it is; the local
    # hook itself logs nothing more on a create.
    caplog.set_level(logging.INFO)
    hook = LocalSandboxHook(state_root=str(tmp_path / "state"), uid_lease_dir=str(tmp_path / "ids"))
    with SandboxSession(hook) as session:
        handle = session.ensure()
        directory = tmp_path / "state" / handle
        assert directory.is_dir()
    lines = [line for line in _messages(caplog) if handle in line and "destroy" not in line.lower()]
    assert len(lines) == 1, _messages(caplog)
    assert lines[0].startswith(f"Provisioned sandbox {handle} on backend local (in {directory} on this worker); ")


def test_a_backend_without_words_for_where_gets_the_plain_line(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with SandboxSession(FakeSandboxHook(str(tmp_path / "sandboxes"))) as session:
        handle = session.ensure()
    provisioned = [line for line in _messages(caplog) if line.startswith("Provisioned sandbox")]
    assert len(provisioned) == 1 and provisioned[0].startswith(f"Provisioned sandbox {handle} on backend fake; ")
