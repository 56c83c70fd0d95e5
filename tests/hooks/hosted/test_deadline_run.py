"""The guest program behind the Islo and Boat backends' commands, run for real under the host's ``sh``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from sandbox_provider.hooks.hosted.deadline_run import parse_status, wrapper_argv, wrapper_command

#: Bounds a broken wrapper's hang; no test's assertion depends on it.
HANG_GUARD = 60


@pytest.fixture
def guest(tmp_path):
    """A guest environment: its own HOME and TMPDIR, with the host's PATH."""
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    scratch.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(scratch), "LANG": "C.UTF-8"}
    return env


def run(env, command, *, deadline=30.0, kill_after=1, keep_bytes=4096, login=False, cwd=None):
    argv = wrapper_argv(command, deadline=deadline, kill_after=kill_after, keep_bytes=keep_bytes, login=login)
    proc = subprocess.run(argv, env=env, cwd=cwd or env["HOME"], capture_output=True, timeout=HANG_GUARD)
    stdout, stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    return proc.returncode, parse_status(stdout, stderr), stderr


def test_passes_output_and_exit_status_through(guest):
    code, status, _ = run(guest, "printf out; printf err >&2; exit 3")
    assert code == 3
    assert (status.exit_code, status.timed_out) == (3, False)
    assert (status.stdout, status.stderr) == ("out", "err")
    assert (status.stdout_bytes, status.stderr_bytes) == (3, 3)
    assert (status.stdout_newlines, status.stderr_newlines) == (0, 0)


def test_output_ending_in_a_newline_keeps_it(guest):
    _, status, _ = run(guest, "echo out; echo err >&2")
    assert (status.stdout, status.stderr) == ("out\n", "err\n")


def test_a_missing_command_is_127_and_not_a_timeout(guest):
    code, status, _ = run(guest, "no-such-command-anywhere")
    assert code == status.exit_code == 127
    assert not status.timed_out
    assert "not found" in status.stderr


def test_replays_only_the_tail_and_counts_everything(guest):
    _, status, _ = run(guest, "seq 1 100000; seq 1 50000 >&2", keep_bytes=12)
    assert status.stdout == "99999\n100000\n"[-12:]
    assert status.stderr == "49999\n50000\n"[-12:]
    assert status.stdout_bytes == len("".join(f"{i}\n" for i in range(1, 100001)))
    assert status.stderr_bytes == len("".join(f"{i}\n" for i in range(1, 50001)))
    assert (status.stdout_newlines, status.stderr_newlines) == (100000, 50000)


def test_the_deadline_stops_the_command(guest, tmp_path):
    marker = tmp_path / "after"
    code, status, _ = run(guest, f"echo started; sleep 30; touch {marker}", deadline=0.3)
    assert code == 124
    assert status.timed_out and status.exit_code == 124
    assert status.stdout == "started\n"
    assert not marker.exists()


def test_a_command_that_ignores_sigterm_is_killed(guest):
    code, status, _ = run(guest, "trap '' TERM; sleep 30", deadline=0.3, kill_after=1)
    assert code == 137
    assert status.timed_out


def test_the_deadline_kills_background_jobs_too(guest, tmp_path):
    pid_file = tmp_path / "pid"
    _, status, _ = run(guest, f"sleep 30 & echo $! > {pid_file}; wait", deadline=0.3)
    assert status.timed_out
    pid = int(pid_file.read_text())
    assert _gone(pid)


def test_exiting_124_early_is_not_a_timeout(guest):
    _, status, _ = run(guest, "exit 124", deadline=30)
    assert status.exit_code == 124 and not status.timed_out


def test_a_background_job_neither_holds_the_call_nor_outlives_the_command(guest, tmp_path):
    pid_file = tmp_path / "pid"
    code, status, _ = run(guest, f"sleep 30 & echo $! > {pid_file}; echo done")
    assert code == 0 and status.stdout == "done\n"
    assert _gone(int(pid_file.read_text()))


def test_a_process_that_left_the_group_is_not_chased(guest, tmp_path):
    pid_file = tmp_path / "pid"
    try:
        code, _, _ = run(guest, f"setsid sleep 30 & echo $! > {pid_file}; sleep 0.2")
        assert code == 0
        assert _alive(int(pid_file.read_text()))  # as documented: setsid escapes the kill
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_stdin_is_empty(guest):
    _, status, _ = run(guest, "cat; echo end")
    assert status.stdout == "end\n"


def test_the_scratch_directory_is_private_and_removed(guest):
    _, status, _ = run(guest, 'stat -c %a "$(dirname "$(readlink /proc/$$/fd/1)")"')
    assert status.stdout == "700\n"
    assert os.listdir(guest["TMPDIR"]) == []


def test_runs_in_the_working_directory_with_the_environment(guest, tmp_path):
    env = {**guest, "GREETING": "hello there"}
    _, status, _ = run(env, 'pwd; printf %s "$GREETING"', cwd=str(tmp_path))
    assert status.stdout == f"{tmp_path}\nhello there"


def test_plain_mode_skips_the_profile_and_login_mode_reads_it(guest):
    profile = os.path.join(guest["HOME"], ".profile")
    with open(profile, "w") as f:
        f.write("export FROM_PROFILE=yes\n")
    _, plain, _ = run(guest, 'echo "[${FROM_PROFILE-}]"')
    _, login, _ = run(guest, 'echo "[${FROM_PROFILE-}]"', login=True)
    assert plain.stdout == "[]\n"
    assert login.stdout == "[yes]\n"


def test_login_mode_without_bash_falls_back_to_sh(guest, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sh", "timeout", "mktemp", "chmod", "tail", "wc", "rm", "cat", "printf"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    with open(os.path.join(guest["HOME"], ".profile"), "w") as f:
        f.write("export FROM_PROFILE=yes\n")
    env = {**guest, "PATH": str(bindir)}
    _, status, _ = run(env, 'echo "$FROM_PROFILE $0"', login=True)
    _, with_bash, _ = run(guest, 'echo "$FROM_PROFILE $0"', login=True)
    assert status.stdout == "yes sh\n"
    assert with_bash.stdout == "yes bash\n"


def test_without_timeout_it_says_what_is_missing(guest, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sh").symlink_to(shutil.which("sh"))
    code, status, stderr = run({**guest, "PATH": str(bindir)}, "echo never")
    assert code == 125 and status is None
    assert "no 'timeout' command" in stderr


def test_sigterm_to_the_wrapper_stops_the_command_and_cleans_up(guest, tmp_path):
    pid_file = tmp_path / "pid"
    argv = wrapper_argv(f"echo $$ > {pid_file}; exec sleep 30", deadline=30, kill_after=1, keep_bytes=64, login=False)
    proc = subprocess.Popen(argv, env=guest, cwd=guest["HOME"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"))
        pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_GUARD)
        assert proc.returncode == 143
        assert _gone(pid)
        assert os.listdir(guest["TMPDIR"]) == []
    finally:
        proc.kill()


def test_status_line_parsing():
    assert parse_status("o", "e\nairflow-sandbox-status 0 0 1 1 0 0\n").stderr == "e"
    # the last status line wins, so a command cannot forge one that hides the real one
    forged = "airflow-sandbox-status 0 0 0 0 0 0\n"
    assert parse_status("", f"\n{forged}\nairflow-sandbox-status 9 1 0 31 0 2\n").exit_code == 9
    assert parse_status("", "no status here") is None
    assert parse_status("", "\nairflow-sandbox-status 0 0 1 1 0\n") is None
    assert parse_status("", "\nairflow-sandbox-status 0 0 1 1 0 x\n") is None


def test_the_deadline_is_rounded_up_to_hundredths():
    assert wrapper_argv("true", deadline=0.001, kill_after=5, keep_bytes=10, login=False)[4] == "1"
    assert wrapper_argv("true", deadline=2.5, kill_after=5, keep_bytes=10, login=False)[4] == "250"
    assert wrapper_argv("true", deadline=2.501, kill_after=5, keep_bytes=10, login=False)[4] == "251"


def test_wrapper_command_is_the_same_program_as_one_line(guest):
    line = wrapper_command("echo 'it''s'; exit 4", deadline=30, kill_after=1, keep_bytes=100, login=False)
    proc = subprocess.run(["sh", "-c", line], env=guest, capture_output=True, timeout=HANG_GUARD)
    status = parse_status(proc.stdout.decode(), proc.stderr.decode())
    assert (proc.returncode, status.stdout) == (4, "its\n")


def _wait_for(predicate, limit=HANG_GUARD):
    end = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("the wrapper never started the command")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs now (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited; a killed process takes a moment to be reaped."""
    end = time.monotonic() + HANG_GUARD
    while _alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True
