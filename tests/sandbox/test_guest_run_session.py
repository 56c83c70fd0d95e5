"""
The session wrapper (guest program ``run_session.sh``), run for real under the host's ``/bin/sh``:
exit statuses, exact bytes, the deadline, the session sweep, reserved statuses and stalls.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pid_namespace import alive, carries_mark
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

pytestmark = pytest.mark.skipif(
    not (Path("/proc/self/stat").exists() and shutil.which("setsid")), reason="needs a Linux /proc and setsid"
)

PROGRAM = guest.program("run_session.sh")
#: Longest any one call may take before the test calls it hung (never reached when things work).
HANG = 60


def run(
    command: str | bytes, seconds: float | str = 30, *extra: str, env=None, **kwargs
) -> subprocess.CompletedProcess:
    data = command.encode() if isinstance(command, str) else command
    return subprocess.run(
        ["/bin/sh", "-c", PROGRAM, "airflow-run", str(seconds), *extra],
        input=data,
        capture_output=True,
        timeout=HANG,
        env=env,
        **kwargs,
    )


def wait_for_file(path: Path, deadline: float = HANG) -> str:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def pids_in(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()]


@pytest.fixture(autouse=True)
def _reap_leftovers(tmp_path, monkeypatch):
    """
    A failing test must not leave processes behind: kill every pid its command recorded that is still
    one of the test's own. A recorded pid whose process ended is free, and on a busy machine another
    process soon has it (pid_max is often 32768), so a pid alone is never reason to kill: the
    processes the test starts carry a mark in their environment, and only those are killed.
    """
    mark = f"SANDBOX_TEST_STARTED_BY={tmp_path}"
    monkeypatch.setenv(*mark.split("=", 1))
    yield
    for pidfile in tmp_path.glob("*.pids"):
        for pid in pids_in(pidfile):
            if carries_mark(pid, mark):
                os.kill(pid, signal.SIGKILL)


class TestStatusAndOutput:
    @pytest.mark.parametrize("code", [0, 1, 3, 124, 126, 255])
    def test_exit_status_is_the_commands(self, code):
        assert run(f"exit {code}").returncode == code

    def test_stdout_and_stderr_are_exact_bytes(self):
        result = run(r"printf 'a\000\377b\n'; printf 'e\001rr' >&2")
        assert result.stdout == b"a\x00\xffb\n"
        assert result.stderr == b"e\x01rr"

    def test_death_by_signal_is_128_plus_the_signal(self):
        assert run("kill -s KILL $$").returncode == 128 + signal.SIGKILL

    def test_a_multi_line_script_with_quotes_runs_as_written(self):
        script = (
            'x=\'it\'\'s\'\nif [ "$x" = its ]; then\n  echo "same $x"\nfi\necho "$0" | grep -q command && echo staged\n'
        )
        assert run(script).stdout == b"same its\nstaged\n"

    def test_stdin_of_the_command_is_empty(self):
        result = run("cat; echo end")
        assert result.stdout == b"end\n"

    def test_workdir(self, tmp_path):
        assert run("pwd", 30, str(tmp_path)).stdout.decode().strip() == str(tmp_path)

    def test_environment_file_is_sourced_before_the_command(self, tmp_path):
        envfile = tmp_path / "env"
        envfile.write_text("export GREETING='two\nlines '\"'\"' and a quote'\n")
        result = run('printf %s "$GREETING"', 30, "", str(envfile))
        assert result.stdout == b"two\nlines ' and a quote"

    def test_staging_leaves_no_temporary_directory(self, tmp_path):
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        assert run("echo $0", env=env).stdout.decode().startswith(str(tmp_path))
        run("sleep 30", 0.2, env=env)
        assert list(tmp_path.iterdir()) == []

    def test_a_command_of_a_megabyte_is_staged_whole(self):
        body = "x" * (1 << 20)
        assert run(f"printf %s '{body}' | wc -c").stdout.strip() == str(1 << 20).encode()


class TestDeadline:
    def test_a_command_within_its_deadline_is_not_cut(self):
        result = run("sleep 0.2; echo finished", 10)
        assert (result.returncode, result.stdout) == (0, b"finished\n")

    def test_deadline_kills_the_whole_tree_and_exits_124(self, tmp_path):
        pidfile = tmp_path / "tree.pids"
        command = f"""
        (trap '' TERM HUP INT; while :; do sleep 0.05; done) & echo $! >> {pidfile}
        (sh -c 'sleep 300 & echo $! >> {pidfile}; wait') & echo $! >> {pidfile}
        echo started; sleep 300
        """
        result = run(command, 0.5)
        assert result.returncode == 124
        assert result.stdout == b"started\n"
        assert len(pids_in(pidfile)) == 3
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == []

    def test_fractional_deadline(self):
        assert run("sleep 30", "0.3").returncode == 124

    def test_a_fork_loop_is_stopped(self, tmp_path):
        pidfile = tmp_path / "loop.pids"
        command = f"while :; do (echo $$ >/dev/null; sleep 5) & echo $! >> {pidfile}; done"
        result = run(command, 0.5)
        assert result.returncode == 124
        assert pids_in(pidfile), "the loop never started"
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == []

    def test_timer_fires_after_the_wrapper_was_stopped_past_its_deadline(self, tmp_path):
        """A stalled guest (SIGSTOP, CPU starvation) still ends the command once it runs again."""
        marker = tmp_path / "started"
        proc = subprocess.Popen(
            ["/bin/sh", "-c", PROGRAM, "airflow-run", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        proc.stdin.write(f"echo go > {marker}; sleep 300".encode())
        proc.stdin.close()
        wait_for_file(marker)
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=HANG) == 124
        proc.stdout.close()
        proc.stderr.close()


class TestSweep:
    def test_control_without_the_wrapper_a_background_job_outlives_its_shell(self, tmp_path):
        pidfile = tmp_path / "control.pids"
        subprocess.run(["/bin/sh", "-c", f"sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}"], check=True, timeout=HANG)
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == pids_in(pidfile)

    def test_background_jobs_do_not_hold_the_call_open_and_are_killed(self, tmp_path):
        pidfile = tmp_path / "bg.pids"
        result = run(
            f"sleep 300 & echo $! > {pidfile}; nohup sleep 300 >/dev/null 2>&1 & echo $! >> {pidfile}; echo ok", 120
        )
        assert (result.returncode, result.stdout) == (0, b"ok\n")
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == []

    def test_a_process_named_with_a_newline_is_swept_and_the_status_kept(self, tmp_path):
        # Its /proc stat line then spans two lines: read as one, it must not stop the sweep (which
        # would leave the process running and put the wrapper's own error in the output).
        pidfile = tmp_path / "renamed.pids"
        rename = (
            "import ctypes, os, time\n"
            "if os.fork() == 0:\n"
            "    ctypes.CDLL(None).prctl(15, b'x) S 1\\nevil', 0, 0, 0)\n"
            f"    open('{pidfile}.new', 'w').write(str(os.getpid()) + '\\n')\n"
            f"    os.rename('{pidfile}.new', '{pidfile}')\n"
            "    time.sleep(300)\n"
        )
        # The command ends only once the child has taken its name (it writes its pid after the rename):
        # ending sooner, on a loaded machine, would sweep before there is a newline in any stat line.
        renamed = f"i=0; until [ -s {pidfile} ] || [ $i -ge {HANG * 5} ]; do sleep 0.1; i=$((i+1)); done"
        result = run(
            f'python3 -c "{rename}" >/dev/null 2>&1 & {renamed}; '
            f"[ -s {pidfile} ] && echo partial || echo 'the child never renamed itself'; exit 3",
            120,
        )
        assert (result.returncode, result.stdout, result.stderr) == (3, b"partial\n", b"")
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == []

    def test_the_timer_does_not_outlive_a_quick_command(self):
        for _ in range(5):
            assert run("true", "297.25").returncode == 0
        timers = []
        for entry in Path("/proc").iterdir():
            try:
                if (
                    entry.name.isdigit()
                    and (entry / "cmdline").read_bytes() == b"sleep\x00297.25\x00"
                    and alive(int(entry.name))
                ):
                    timers.append(int(entry.name))
            except OSError:
                continue
        assert timers == []

    def test_the_command_runs_in_its_own_session(self):
        result = run("ps -o sid= -p $$; echo $$")
        sid, pid = result.stdout.split()
        assert sid == pid

    def test_terminating_the_wrapper_ends_the_command(self, tmp_path):
        pidfile = tmp_path / "term.pids"
        proc = subprocess.Popen(
            ["/bin/sh", "-c", PROGRAM, "airflow-run", "300"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proc.stdin.write(f"sleep 300 & echo $! > {pidfile}; wait".encode())
        proc.stdin.close()
        wait_for_file(pidfile)
        proc.terminate()
        assert proc.wait(timeout=HANG) == 143
        assert [pid for pid in pids_in(pidfile) if alive(pid)] == []


class TestReservedStatuses:
    @pytest.mark.parametrize("seconds", ["", "abc", "1.2.3", "-1", "."])
    def test_a_bad_deadline_is_125_with_a_marker(self, seconds):
        result = run("echo never", seconds)
        assert result.returncode == 125
        assert result.stdout == b""
        assert result.stderr.startswith(b"airflow-sandbox: ")

    def test_a_missing_workdir_is_125_with_a_marker(self, tmp_path):
        result = run("echo never", 30, str(tmp_path / "absent"))
        assert result.returncode == 125
        assert b"airflow-sandbox: cannot enter the working directory" in result.stderr

    def test_an_unreadable_environment_file_is_125_with_a_marker(self, tmp_path):
        result = run("echo never", 30, "", str(tmp_path / "absent"))
        assert result.returncode == 125
        assert b"airflow-sandbox: cannot read the environment file" in result.stderr
        assert result.stdout == b""

    def test_no_temporary_directory_is_125_with_a_marker(self, tmp_path):
        result = run("echo never", env={**os.environ, "TMPDIR": str(tmp_path / "absent")})
        assert result.returncode == 125
        assert b"airflow-sandbox: cannot create a temporary directory" in result.stderr

    def test_missing_setsid_is_127_with_a_marker(self, tmp_path):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in ("mktemp", "cat", "rm", "sleep"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        result = run("echo never", env={"PATH": str(bin_dir)})
        assert result.returncode == 127
        assert result.stderr.startswith(b"airflow-sandbox: setsid is missing")


class TestHostSide:
    def test_argv_runs_the_program_with_its_arguments(self, tmp_path):
        argv = guest.run_session_argv(0.25, str(tmp_path), "")
        assert argv[4:] == ["0.250", str(tmp_path), ""]
        result = subprocess.run(argv, input=b"pwd", capture_output=True, timeout=HANG)
        assert result.stdout.decode().strip() == str(tmp_path)

    def test_reserved_statuses_become_errors(self, tmp_path):
        missing = run("true", 30, str(tmp_path / "gone"))
        with pytest.raises(SandboxError, match="could not start the command: cannot enter") as caught:
            guest.check_run_session(missing.returncode, missing.stderr, "sb")
        assert not isinstance(caught.value, SandboxTerminalError)
        with pytest.raises(SandboxTerminalError, match="setsid"):
            guest.check_run_session(127, b"airflow-sandbox: setsid is missing\n", "sb")

    def test_a_command_of_its_own_exiting_125_or_127_is_just_a_status(self):
        guest.check_run_session(125, b"some error of the command\n", "sb")
        guest.check_run_session(127, b"sh: 1: nosuch: not found\n", "sb")
        guest.check_run_session(1, b"airflow-sandbox: looks like a marker\n", "sb")
