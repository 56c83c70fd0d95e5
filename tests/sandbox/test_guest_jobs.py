"""The guest programs of detached commands (job_start, job_run, job_poll, job_stop), on the host under plain sh."""

from __future__ import annotations

import subprocess
import time

import pytest

from sandbox_provider.sandbox import guest, jobs
from sandbox_provider.sandbox.errors import SandboxError
from sandbox_provider.sandbox.jobs import JobCursor, parse_poll

SEGMENT = 16


def sh(program: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", guest.program(program), program, *map(str, args)], capture_output=True)


def start(directory, command, *, deadline=30.0, keep=3):
    hundredths = int(deadline * 100)
    done = sh(
        "job_start.sh", directory, f"{deadline:.3f}", hundredths, SEGMENT, keep, guest.program("job_run.sh"), command
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"airflow-sandbox-job started\n"


def poll(directory, since=(0, 0), max_bytes=10_000, keep=False):
    mode = keep if isinstance(keep, str) else "keep" if keep else "-"
    done = sh("job_poll.sh", directory, SEGMENT, since[0], since[1], max_bytes, mode)
    assert done.returncode == 0, done.stderr
    return parse_poll(done.stdout, None if since[0] < 0 else JobCursor(*since), "host")


def wait_ended(directory):
    for _ in range(300):
        state = poll(directory)
        if state.ended:
            return state
        time.sleep(0.05)
    pytest.fail("the job never ended")


def test_output_status_and_counts_come_back_from_any_offset(tmp_path):
    job = tmp_path / "job"
    start(job, "printf 'one\\ntwo\\n'; printf 'err\\n' >&2; printf 'three'; exit 5")
    state = wait_ended(job)
    assert (state.exit_code, state.timed_out, state.stopped) == (5, False, False)
    assert state.stdout == b"one\ntwo\nthree" and state.stderr == b"err\n"
    assert state.totals == JobCursor(13, 4) and state.newlines == JobCursor(2, 1)
    later = poll(job, since=(4, 4))
    assert later.stdout == b"two\nthree" and later.stderr == b"" and later.cursor == JobCursor(13, 4)
    assert later.skipped == JobCursor(0, 0)


def test_the_kept_output_is_bounded_and_a_reader_behind_is_told_what_it_missed(tmp_path):
    job = tmp_path / "job"
    start(job, "seq 1 100", keep=3)  # 292 bytes: segments 0 to 18 of 16 bytes, the last 3 kept
    state = wait_ended(job)
    segments = sorted(p.name for p in job.iterdir() if p.name.startswith("out.0"))
    assert len(segments) == 3
    assert state.totals.stdout == 292
    assert (
        state.skipped.stdout == 16 * SEGMENT
        and state.stdout == b"".join(f"{i}\n".encode() for i in range(1, 101))[16 * SEGMENT :]
    )
    assert state.newlines.stdout == 100  # counted as the segments finished, before they were removed


def test_the_tails_mode_reads_the_last_bytes(tmp_path):
    job = tmp_path / "job"
    start(job, "seq 1 20; echo e >&2")
    wait_ended(job)
    state = poll(job, since=(-6, -6), max_bytes=6)
    assert state.stdout == b"19\n20\n" and state.stderr == b"e\n"


def test_a_poll_that_keeps_its_cursor_records_the_furthest_one(tmp_path):
    job = tmp_path / "job"
    start(job, "seq 1 5")
    wait_ended(job)
    assert poll(job, since=(4, 0), keep=True).kept_cursor == JobCursor(4, 0)
    assert poll(job, since=(2, 0), keep=True).kept_cursor == JobCursor(4, 0)  # never backwards
    assert poll(job, since=(6, 0)).kept_cursor == JobCursor(4, 0)  # only when asked


def test_a_recording_poll_marks_what_it_returns_in_flight_until_the_next_record(tmp_path):
    job = tmp_path / "job"
    start(job, "seq 1 5; echo e >&2")  # 10 bytes of stdout, 2 of stderr
    wait_ended(job)
    assert poll(job).in_flight == JobCursor(0, 0)  # no record yet
    poll(job, since=(2, 0), max_bytes=4, keep=True)  # hands on bytes 2..6 of stdout and 0..2 of stderr
    after = poll(job, since=(0, 0))
    assert (after.kept_cursor, after.in_flight) == (JobCursor(2, 0), JobCursor(6, 2))
    poll(job, since=(6, 2), max_bytes=1, keep="commit")  # handed on: nothing in flight
    after = poll(job, since=(0, 0))
    assert (after.kept_cursor, after.in_flight) == (JobCursor(6, 2), JobCursor(6, 2))
    poll(job, since=(4, 0), max_bytes=4, keep=True)  # behind the record: records nothing
    assert poll(job).in_flight == JobCursor(6, 2)


def test_a_command_past_its_deadline_is_killed_with_what_it_left_in_its_group(tmp_path):
    job = tmp_path / "job"
    marker = tmp_path / "late"
    start(job, f"(sleep 3; touch {marker}) & echo begun; sleep 30", deadline=1.0)
    state = wait_ended(job)
    assert state.timed_out and state.exit_code in (124, 137) and state.stdout == b"begun\n"
    time.sleep(3)
    assert not marker.exists()


def test_stop_kills_the_command_and_marks_the_job_stopped(tmp_path):
    job = tmp_path / "job"
    start(job, "sleep 30")
    assert sh("job_stop.sh", job).returncode == 0
    state = poll(job)
    assert state.stopped and state.exit_code == 137 and not state.timed_out
    assert sh("job_stop.sh", job).returncode == 0  # again: no error
    assert sh("job_stop.sh", tmp_path / "none").returncode == jobs.NO_JOB_STATUS
    assert sh("job_poll.sh", tmp_path / "none", SEGMENT, 0, 0, 10, "-").returncode == jobs.NO_JOB_STATUS


def test_a_job_directory_that_exists_is_refused(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    done = sh("job_start.sh", job, "1.000", 100, SEGMENT, 3, guest.program("job_run.sh"), "true")
    assert done.returncode == jobs.START_FAILED_STATUS and b"cannot make the job directory" in done.stderr


def test_output_that_is_not_the_programs_is_refused():
    with pytest.raises(SandboxError, match="Could not read the state"):
        parse_poll(b"hello\n", JobCursor(), "h")
    text = b"airflow-sandbox-job running\nkept 0 0\nout 0 3 0\n!!!\nerr 0 0 0\n\n"
    with pytest.raises(SandboxError, match="damaged"):
        parse_poll(text, JobCursor(), "h")


def test_job_ids_and_cursors_are_checked():
    assert len(jobs.new_job_id()) == 32
    for bad in ("../etc", "A" * 32, 5, None):
        with pytest.raises(ValueError, match="job id"):
            jobs.check_job_id(bad)
    assert JobCursor.from_value([1, 2]) == JobCursor(1, 2)
    for bad in ([1], [-1, 0], "1,2", [True, 0]):
        with pytest.raises(ValueError, match="two byte offsets"):
            JobCursor.from_value(bad)
