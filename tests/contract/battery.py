"""
The contract battery: the same cases for every backend.

A backend's test module subclasses :class:`SandboxContract` (the class is not collected itself) and
provides a ``hook`` fixture; class attributes say what the backend accepts. Every case runs against
the real backend or its faithful stand-in, never against a mock of the hook.
"""

from __future__ import annotations

import dataclasses
import io
import shlex
import socket
import subprocess
import sys

import pytest

from sandbox_provider.sandbox import SandboxError, SandboxFileTooLargeError, SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.errors import SandboxHandleError

#: Every byte value, twice, and a NUL in the middle: what a binary-safe transfer must carry.
BINARY = bytes(range(256)) * 2 + b"\0tail"
#: The battery's cases each test class started in this run, to know when the whole battery ran.
_STARTED: dict[type, set[str]] = {}


def _connect_probe(port: int) -> str:
    """A Python program that says ``probe`` and then ``connected`` or ``blocked`` for 127.0.0.1:``port``."""
    return (
        "import socket\n"
        "print('probe', flush=True)\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n"
        "except OSError as err:\n"
        "    print('blocked', type(err).__name__)\n"
        "else:\n"
        "    print('connected')\n"
    )


def _accept_all(listener: socket.socket) -> int:
    """Accept and close the connections waiting on ``listener``; return how many there were."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def _lines(text: str) -> list[str]:
    """The lines of ``text`` whichever of LF, CRLF or CR ends each, a last one without an end included."""
    return text.replace("\r\n", "\n").replace("\r", "\n").splitlines()


class SandboxContract:
    """Subclass as ``TestXContract`` with a ``hook`` fixture; override the attributes below as needed."""

    #: The spec a plain sandbox is created with (sbx needs a declared host network policy, say).
    base_spec: SandboxSpec = SandboxSpec()
    #: Specs this backend must refuse before provisioning, with a regex their message matches.
    refused_specs: list[tuple[SandboxSpec, str]] = []
    #: A timeout short enough to test and long enough for the backend's round trip, in seconds.
    short_timeout: float = 2.0

    @pytest.fixture(autouse=True)
    def _started(self, request):
        _STARTED.setdefault(request.cls, set()).add(request.node.originalname)

    @pytest.fixture
    def sandbox(self, hook):
        handle = hook.create(spec=self.base_spec)
        yield handle
        hook.destroy(handle)

    def sh(self, hook, handle, command, *, timeout=60.0, max_output_bytes=64 * 1024, **kwargs):
        return hook.run_command(handle, command, timeout=timeout, max_output_bytes=max_output_bytes, **kwargs)

    # -- commands ------------------------------------------------------------------------------------

    def test_runs_with_exit_codes_and_both_streams(self, hook, sandbox):
        result = self.sh(hook, sandbox, "echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert not result.ok and not result.timed_out and not result.sandbox_terminated
        assert result.applied_timeout is not None and 0 < result.applied_timeout <= 60.0

    def test_env_reaches_the_command_and_nothing_of_the_worker(self, hook, monkeypatch):
        import dataclasses

        monkeypatch.setenv("WORKER_SECRET_FOR_CONTRACT", "must-not-leak")
        spec = dataclasses.replace(self.base_spec, env={"GREETING": "hello world", **(self.base_spec.env or {})})
        handle = hook.create(spec=spec)
        try:
            result = self.sh(hook, handle, 'printf %s "$GREETING"; env')
            assert result.ok, result
            assert result.stdout.startswith("hello world")
            assert "must-not-leak" not in result.stdout
        finally:
            hook.destroy(handle)

    def test_state_persists_between_commands(self, hook, sandbox):
        assert self.sh(hook, sandbox, "echo kept > state.txt").ok
        assert self.sh(hook, sandbox, "cat state.txt").stdout == "kept\n"

    def test_timeout_kills_and_the_sandbox_stays(self, hook, sandbox):
        result = self.sh(hook, sandbox, "sleep 60; echo never", timeout=self.short_timeout)
        assert result.timed_out and not result.ok
        assert "never" not in result.stdout
        assert self.sh(hook, sandbox, "echo alive").stdout == "alive\n"

    def test_output_flood_keeps_a_bounded_tail(self, hook, sandbox):
        result = self.sh(hook, sandbox, "yes line | head -n 300000; echo last", max_output_bytes=1000)
        assert result.ok, result
        assert len(result.stdout.encode()) <= 1000 and result.stdout_truncated
        assert result.stdout.endswith("last\n")

    def test_output_streams_as_it_arrives(self, hook, sandbox):
        seen: list[tuple[str, bytes]] = []
        result = self.sh(hook, sandbox, "echo one; echo two >&2", on_output=lambda s, d: seen.append((s, d)))
        assert result.ok
        assert b"".join(d for s, d in seen if s == "stdout") == b"one\n"
        assert b"".join(d for s, d in seen if s == "stderr") == b"two\n"

    #: What ``printf`` prints in the byte-for-byte case: blank lines, CRLF, lone CRs, no newline at the end.
    PRINTED = (
        "x\\n\\ny\\r\\nz",
        "\\n\\na\\n\\n\\nb\\n",
        "one\\r\\ntwo\\r\\n",
        "load 1\\rload 2\\rdone\\n",
        "\\r\\n\\r\\rend",
    )

    def test_output_comes_back_byte_for_byte(self, hook, sandbox):
        """Each stream's text is what the command printed, byte for byte; the live stream has the same lines."""
        for printed in self.PRINTED:
            expected = printed.encode().decode("unicode_escape")
            seen: list[tuple[str, bytes]] = []
            command = f"printf '{printed}'; printf '{printed}' >&2"
            result = self.sh(hook, sandbox, command, on_output=lambda s, d, seen=seen: seen.append((s, d)))
            assert result.ok, result
            assert (result.stdout, result.stderr) == (expected, expected), printed
            lines = expected.count("\n") + (not expected.endswith("\n"))
            assert (result.stdout_totals.bytes, result.stdout_totals.lines) == (len(expected), lines), printed
            assert (result.stderr_totals.bytes, result.stderr_totals.lines) == (len(expected), lines), printed
            assert not result.stdout_truncated and not result.stderr_truncated
            for stream in ("stdout", "stderr"):
                streamed = b"".join(d for s, d in seen if s == stream).decode()
                assert _lines(streamed) == _lines(expected), f"{stream} of {printed!r} streamed as {streamed!r}"

    def test_bad_commands_are_refused(self, hook, sandbox):
        for command in ("", "   ", "echo a\0b"):
            with pytest.raises(SandboxError):
                self.sh(hook, sandbox, command)

    # -- files ---------------------------------------------------------------------------------------

    def test_binary_write_read_round_trip(self, hook, sandbox):
        hook.write_file(sandbox, "deep/er/blob.bin", BINARY)
        assert hook.read_file(sandbox, "deep/er/blob.bin", max_bytes=len(BINARY)) == BINARY
        assert self.sh(hook, sandbox, "wc -c < deep/er/blob.bin").stdout.strip() == str(len(BINARY))

    def test_write_replaces_and_import_streams(self, hook, sandbox):
        hook.write_file(sandbox, "f.txt", b"first, longer content")
        hook.write_file(sandbox, "f.txt", b"second")
        assert hook.read_file(sandbox, "f.txt", max_bytes=100) == b"second"
        data = b"x" * (3 * 1024 * 1024 + 7)
        assert hook.import_file(sandbox, "big.bin", io.BytesIO(data)) == len(data)
        out = io.BytesIO()
        assert hook.export_file(sandbox, "big.bin", out, max_bytes=len(data)) == len(data)
        assert out.getvalue() == data

    def test_file_errors(self, hook, sandbox):
        self.sh(hook, sandbox, "mkdir -p d; printf 0123456789 > ten")
        with pytest.raises(SandboxError, match="does not exist"):
            hook.read_file(sandbox, "missing", max_bytes=10)
        with pytest.raises(SandboxError, match="is a directory"):
            hook.read_file(sandbox, "d", max_bytes=10)
        with pytest.raises(SandboxFileTooLargeError) as info:
            hook.read_file(sandbox, "ten", max_bytes=9)
        assert info.value.max_bytes == 9
        with pytest.raises(SandboxFileTooLargeError):
            hook.export_file(sandbox, "ten", io.BytesIO(), max_bytes=9)
        with pytest.raises(SandboxError):
            hook.list_directory(sandbox, "ten")

    def test_list_directory_sorted_with_kinds(self, hook, sandbox):
        self.sh(hook, sandbox, "mkdir -p l/sub && : > l/b.txt && : > 'l/a file'")
        assert hook.list_directory(sandbox, "l") == [("a file", False), ("b.txt", False), ("sub", True)]

    # -- lifecycle -----------------------------------------------------------------------------------

    def test_destroy_is_idempotent_and_final(self, hook):
        handle = hook.create(spec=self.base_spec)
        hook.destroy(handle)
        hook.destroy(handle)
        with pytest.raises(SandboxTerminalError):
            self.sh(hook, handle, "true")

    def test_a_task_stopped_mid_command_fails_saying_it_was_stopped(self, hook):
        """
        Airflow stops a running task (marked failed or cleared in the UI) with SIGTERM, whose handler
        calls the operator's ``on_kill`` on the task's main thread, in the middle of whatever it waits
        for: here, the command's output. The failure the task then reports names the stop, not a
        broken image or a vanished sandbox, and the sandbox is gone.
        """
        import os
        import signal
        import threading
        import time
        from unittest import mock

        from sandbox_provider.operators.sandbox import SandboxOperator

        op = SandboxOperator(
            task_id="stopped", backend=hook, command="echo started; sleep 600", spec=self.base_spec, timeout=600
        )
        seen: dict[str, str | None] = {}
        # The stop is sent only while the test's handler is in place: an execute that ended first (a
        # failure of its own) disarms it, so a late SIGTERM cannot end the whole test process.
        armed, arming = [True], threading.Lock()

        def stop_once_started() -> None:
            # Once the command runs: its first line streamed, or (on a backend that returns output only at
            # the end) three seconds into the run.
            running_since = None
            for _ in range(6000):
                live = getattr(op, "_live", None)
                session = op._session
                if live is not None and session is not None and session.handle:
                    running_since = running_since or time.monotonic()
                    if live.seen["stdout"][0] >= 1 or time.monotonic() - running_since >= 3:
                        with arming:
                            if armed[0]:
                                seen["handle"] = session.handle
                                os.kill(os.getpid(), signal.SIGTERM)
                        return
                with arming:
                    if not armed[0]:
                        return
                threading.Event().wait(0.05)

        context = {"ti": mock.MagicMock(dag_id="d", run_id="r", task_id="stopped", map_index=-1, try_number=1)}
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: op.on_kill())  # as Airflow's task runner does
        watcher = threading.Thread(target=stop_once_started, daemon=True)
        watcher.start()
        try:
            with pytest.raises(Exception) as failure:
                op.execute(context)
        finally:
            with arming:
                armed[0] = False
            signal.signal(signal.SIGTERM, previous)
            watcher.join(5)
        message = str(failure.value)
        assert seen.get("handle"), "the command never started"  # the stop came mid-command
        assert "the task was stopped while it ran" in message and "on_kill destroyed the sandbox" in message, message
        assert "image" not in message and "keeper" not in message, message
        with pytest.raises(SandboxTerminalError, match="this worker destroyed it because the task was stopped"):
            self.sh(hook, seen["handle"], "true")
        # Not only this hook's record: asked again without it, the backend itself finds no such sandbox.
        hook._destroyed_because.pop(seen["handle"])
        with pytest.raises(SandboxError):
            self.sh(hook, seen["handle"], "true")

    def test_bad_handles_are_refused_before_any_call(self, hook):
        for bad in ("", "None", "../../etc", "a b", "x/../y"):
            with pytest.raises(SandboxHandleError):
                self.sh(hook, bad, "true")
            with pytest.raises(SandboxHandleError):
                hook.destroy(bad)

    def test_refusals_happen_before_provisioning(self, hook, monkeypatch):
        made: list[object] = []
        monkeypatch.setattr(hook, "_provision", lambda request: made.append(request) or "never")
        for spec, message in self.refused_specs:
            with pytest.raises(SandboxTerminalError, match=message):
                hook.create(spec=spec)
        assert made == []

    # -- network -------------------------------------------------------------------------------------

    def test_a_blocked_sandbox_does_not_reach_the_worker(self, hook):
        """
        A backend that claims ``no_network`` (``Capabilities``' default) keeps a blocked sandbox off the
        worker's loopback, or fails to make it (``SandboxTerminalError``: the OpenSandbox test server has
        no egress sidecar); one that does not claim it refuses a blocked spec. This catches commands run
        in the worker's own network namespace; what else a backend's network lets through, its own
        tests probe (``tests/hooks/<backend>/``). The probe runs ``python3`` in the sandbox.
        """
        blocked = dataclasses.replace(
            self.base_spec, block_network=True, allow_egress_to=None, allow_egress_to_cidrs=None
        )
        if not hook.capabilities.no_network:
            with pytest.raises(SandboxTerminalError, match="cannot enforce a blocked network"):
                hook.create(spec=blocked)
            return
        with socket.create_server(("127.0.0.1", 0)) as listener:
            probe = _connect_probe(listener.getsockname()[1])
            on_worker = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
            assert on_worker.stdout.split() == ["probe", "connected"], on_worker  # the probe reaches it from here
            assert _accept_all(listener) == 1
            try:
                handle = hook.create(spec=blocked)
            except SandboxTerminalError:
                return  # nothing weaker was made
            try:
                result = self.sh(hook, handle, f"python3 -c {shlex.quote(probe)}")
            finally:
                hook.destroy(handle)
            reached = _accept_all(listener)
        assert result.stdout.startswith("probe"), f"the network case runs python3 in the sandbox: {result}"
        assert "connected" not in result.stdout and reached == 0, (
            f"{type(hook).__name__} claims no_network (Capabilities' default) but a command in a blocked sandbox "
            "connected to a listener on the worker's loopback: enforce it, or declare Capabilities(no_network=False) "
            f"and refuse blocked specs. Probe said: {result.stdout.strip()!r}"
        )

    # -- detached commands (deferrable tasks) ---------------------------------------------------------

    def test_detached_commands_run_on_and_are_read_by_offset_or_refused(self, hook, sandbox):
        import time

        if not hook.detached_commands:
            with pytest.raises(SandboxTerminalError, match="cannot run commands detached"):
                hook.start_detached(sandbox, "true", timeout=10, max_output_bytes=1024)
            return
        job = hook.start_detached(
            sandbox, "echo out1; echo err >&2; sleep 1; echo out2; exit 3", timeout=60, max_output_bytes=1024
        )
        assert 0 < job.timeout <= 60
        seen, cursor, deadline = b"", None, time.monotonic() + 60
        while time.monotonic() < deadline:
            state = hook.poll(sandbox, job, cursor)
            seen += state.stdout
            cursor = state.cursor
            if state.ended and state.caught_up:
                break
            time.sleep(0.3)
        assert (seen, state.exit_code, state.timed_out) == (b"out1\nout2\n", 3, False)
        assert hook.poll(sandbox, job, [5, 0]).stdout == b"out2\n"  # from any byte offset
        result = hook.job_result(sandbox, job, max_output_bytes=6, timeout=job.timeout)
        assert (result.exit_code, result.stdout, result.stderr) == (3, "\nout2\n", "err\n")
        assert result.stdout_truncated and result.stdout_totals.bytes == 10 and result.stdout_totals.lines == 2
        sleeper = hook.start_detached(sandbox, "sleep 60", timeout=60, max_output_bytes=1024)
        hook.stop(sandbox, sleeper)
        stopped = hook.poll(sandbox, sleeper)
        assert stopped.stopped and stopped.ended and not stopped.timed_out
        assert self.sh(hook, sandbox, "echo still here").stdout == "still here\n"

    # -- the settings table: last, since it judges what the cases above read ------------------------------

    def test_zz_every_setting_in_the_table_is_read(self, hook, request):
        cases = {name for name in vars(SandboxContract) if name.startswith("test_")}
        left = sorted(cases - _STARTED.get(request.cls, set()) - {request.node.originalname})
        if left:
            pytest.skip(f"the whole battery must run before this check; these cases did not: {', '.join(left)}")
        # The settings machinery records each name a hook reads from its resolved settings.
        unread = sorted(set(hook.settings.names) - hook.settings.read)
        assert unread == [], (
            f"{type(hook).__name__} never read the settings {unread} of its table while the battery ran: read "
            "each where it takes effect, or drop it from the table (hooks/forms/<backend>.py)."
        )
