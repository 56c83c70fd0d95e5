"""SandboxCommandTrigger over a backend whose sandboxes are host directories: relay, restarts, deadlines, kills."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.triggers import sandbox as trigger_module
from sandbox_provider.triggers.sandbox import MAX_LINE_BYTES, SandboxCommandTrigger, relayable


class DetachedFakeHook(FakeSandboxHook):
    """The fake backend, with detached commands, whose sandboxes another instance finds by directory."""

    name = "detached-fake"
    detached_commands = True

    def _dir(self, handle: str) -> str:
        path = os.path.join(self.root, handle)
        if not os.path.isdir(path):
            raise SandboxTerminalError(f"Sandbox {handle!r} does not exist.")
        self.env.setdefault(handle, {})
        return path

    def detached_arguments(self):
        return {"root": self.root}


@pytest.fixture
def hook(tmp_path):
    return DetachedFakeHook(root=str(tmp_path / "sandboxes"))


@pytest.fixture
def handle(hook):
    handle = hook.create()
    yield handle
    hook.destroy(handle)


class Recorder:
    """A logger that keeps what it is told, formatted: the trigger's log as the task log would show it."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def _keep(self, msg, *args, **kwargs):
        self.messages.append(str(msg) % args if args else str(msg))

    info = warning = error = debug = exception = _keep


@pytest.fixture
def caplog():  # noqa: F811 - what the trigger logs, kept by the triggers the tests make
    return Recorder()


def make_trigger(hook, handle, job, log=None, **kwargs):
    defaults = {
        "hook_class": f"{__name__}:DetachedFakeHook",
        "hook_arguments": hook.detached_arguments(),
        "handle": handle,
        "job": job.id,
        "deadline": job.started_at + job.timeout,
        "poll_interval": 0.2,
    }
    trigger = SandboxCommandTrigger(**{**defaults, **kwargs})
    if log is not None:
        trigger._log = log
    return trigger


def first_event(trigger, limit: float = 60):
    async def main():
        async for event in trigger.run():
            return event.payload
        return None

    return asyncio.run(asyncio.wait_for(main(), limit))


def relayed(log: Recorder) -> list[str]:
    return [message for message in log.messages if message.startswith("[std")]


async def relay_partly(trigger, log, count):
    """
    Run ``trigger`` until it relayed ``count`` lines and then polled once more (that poll records the
    lines as logged, and finds nothing new: the command waits at its gate), then cancel it, as a
    triggerer that goes away between batches does.
    """
    polls = 0
    poll = DetachedFakeHook.poll

    def counted(self, *args, **kwargs):
        nonlocal polls
        polls += 1
        return poll(self, *args, **kwargs)

    DetachedFakeHook.poll = counted
    try:

        async def run():
            async for _ in trigger.run():
                break

        task = asyncio.ensure_future(run())
        deadline = time.monotonic() + 60
        while len(relayed(log)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(relayed(log)) == count, f"within 60 s: {relayed(log)}"
        seen = polls
        while polls < seen + 2 and time.monotonic() < deadline:  # the one under way, then a whole one
            await asyncio.sleep(0.02)
        assert polls >= seen + 2, "within 60 s the trigger did not poll again"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        DetachedFakeHook.poll = poll


def gated_lines(gate) -> str:
    """Lines 1 to 4, then (once ``gate`` exists) lines 5 to 12: a command the test relays part of."""
    return (
        'for i in 1 2 3 4; do echo "line $i"; done; '
        f"while [ ! -e {gate} ]; do sleep 0.05; done; "
        'for i in $(seq 5 12); do echo "line $i"; sleep 0.05; done'
    )


def end_job(job) -> None:
    """Stop a job of a sandbox the test destroyed (the fake's jobs are host processes)."""
    from sandbox_provider.sandbox.jobs import stop_command

    subprocess.run(["sh", "-c", stop_command(job.id)], check=False)


def test_lines_are_relayed_in_order_and_the_event_says_how_it_ended(hook, handle, caplog):
    job = hook.start_detached(
        handle,
        'for i in 1 2 3; do echo "out $i"; sleep 0.3; done; echo bad >&2; printf tail; exit 4',
        timeout=30,
        max_output_bytes=1000,
    )
    event = first_event(make_trigger(hook, handle, job, caplog, resume={"call_dir": "x"}))
    assert event["status"] == "ended" and event["exit_code"] == 4
    assert event["resume"] == {"call_dir": "x"} and event["handle"] == handle and event["job"] == job.id
    lines = relayed(caplog)
    assert [line for line in lines if line.startswith("[stdout]")] == [
        "[stdout] out 1",
        "[stdout] out 2",
        "[stdout] out 3",
        "[stdout] tail",
    ]
    assert "[stderr] bad" in lines


def test_a_restarted_trigger_resumes_after_the_last_line_relayed(hook, handle, caplog, tmp_path):
    gate = tmp_path / "go"
    job = hook.start_detached(handle, gated_lines(gate), timeout=30, max_output_bytes=1000)

    asyncio.run(relay_partly(make_trigger(hook, handle, job, caplog), caplog, 4))
    before = relayed(caplog)
    assert len(before) == 4
    gate.touch()
    # The new trigger is built from the arguments the task deferred with (cursor at the start).
    event = first_event(make_trigger(hook, handle, job, caplog))
    assert event["status"] == "ended"
    assert relayed(caplog) == [f"[stdout] line {i}" for i in range(1, 13)], before


def test_without_the_kept_cursor_a_restart_would_relay_lines_twice(hook, handle, caplog, tmp_path):
    # The positive control of the case above: the same restart, with the sandbox's record removed.
    gate = tmp_path / "go"
    job = hook.start_detached(handle, gated_lines(gate), timeout=30, max_output_bytes=1000)
    asyncio.run(relay_partly(make_trigger(hook, handle, job, caplog), caplog, 4))
    before = relayed(caplog)
    gate.touch()
    os.remove(f"/tmp/airflow-sandbox-job.{job.id}/kept")
    first_event(make_trigger(hook, handle, job, caplog))
    assert relayed(caplog) == before + [f"[stdout] line {i}" for i in range(1, 13)]


class Killed(BaseException):
    """What a SIGKILL does to the trigger: it stops where it is, no cleanup, no further call to the sandbox."""


async def stop_after_a_batch(trigger, log, *, graceful: bool, lines: int = 3):
    """
    Run ``trigger`` until it has logged a batch holding the ``lines``-th line, and stop it at once, before
    its next poll records that batch: killed (nothing more runs), or shut down (cancelled, then cleanup()
    as the triggerer calls it).
    """
    relay = trigger._relay
    stop = asyncio.Event()

    def relay_then_stop(state, task_log):
        moved = relay(state, task_log)
        if len(relayed(log)) >= lines:
            if not graceful:
                raise Killed
            stop.set()
        return moved

    trigger._relay = relay_then_stop
    poll = trigger._poll

    async def poll_unless_stopped(*args, **kwargs):
        if stop.is_set():
            await asyncio.sleep(3600)  # cancelled here, as a shutdown finds it
        return await poll(*args, **kwargs)

    trigger._poll = poll_unless_stopped

    async def run():
        async for _ in trigger.run():
            break

    task = asyncio.ensure_future(run())
    if graceful:
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await trigger.cleanup()
    else:
        with pytest.raises(Killed):
            await task


SLOW_LINES = 'for i in $(seq 1 12); do echo "line $i"; sleep 0.2; done'


def test_a_trigger_killed_with_a_batch_in_flight_repeats_it_under_a_warning_and_loses_nothing(hook, handle, caplog):
    job = hook.start_detached(handle, SLOW_LINES, timeout=30, max_output_bytes=1000)
    asyncio.run(stop_after_a_batch(make_trigger(hook, handle, job, caplog), caplog, graceful=False))
    before = relayed(caplog)
    assert 3 <= len(before) < 12
    first_event(make_trigger(hook, handle, job, caplog))
    warnings = [i for i, m in enumerate(caplog.messages) if "stopped between logging output and recording" in m]
    assert len(warnings) == 1, caplog.messages
    after = [m for m in caplog.messages[warnings[0] :] if m.startswith("[std")]
    # The killed batch follows the warning again; everything before it was recorded; nothing is lost.
    repeated = before[len(before) - (len(before) + len(after) - 12) :]
    assert repeated and after[: len(repeated)] == repeated
    assert before + after[len(repeated) :] == [f"[stdout] line {i}" for i in range(1, 13)]
    nbytes = sum(len(line.removeprefix("[stdout] ")) + 1 for line in repeated)
    assert (
        f"the next {nbytes} bytes of standard output and 0 of standard error follow again"
        in caplog.messages[warnings[0]]
    )


def test_without_the_in_flight_record_a_killed_trigger_repeats_its_batch_unannounced(hook, handle, caplog, monkeypatch):
    # The control of the case above: the kill really falls between logging a batch and recording it.
    poll = DetachedFakeHook.poll
    monkeypatch.setattr(DetachedFakeHook, "poll", lambda self, *a, **k: poll(self, *a, **{**k, "in_flight": False}))
    job = hook.start_detached(handle, SLOW_LINES, timeout=30, max_output_bytes=1000)
    asyncio.run(stop_after_a_batch(make_trigger(hook, handle, job, caplog), caplog, graceful=False))
    before = relayed(caplog)
    first_event(make_trigger(hook, handle, job, caplog))
    lines = relayed(caplog)
    assert len(lines) > 12 and sorted(set(lines)) == sorted(f"[stdout] line {i}" for i in range(1, 13))
    assert lines[len(before)] in before  # a repeat ...
    assert not any("stopped between logging output" in m for m in caplog.messages)  # ... with no word of it


def test_a_trigger_shut_down_with_a_batch_logged_records_it_and_nothing_repeats(hook, handle, caplog):
    job = hook.start_detached(handle, SLOW_LINES, timeout=30, max_output_bytes=1000)
    asyncio.run(stop_after_a_batch(make_trigger(hook, handle, job, caplog), caplog, graceful=True))
    assert 3 <= len(relayed(caplog)) < 12
    first_event(make_trigger(hook, handle, job, caplog))
    assert relayed(caplog) == [f"[stdout] line {i}" for i in range(1, 13)]
    assert not any("stopped between logging output" in m for m in caplog.messages)


def test_a_command_past_its_deadline_and_grace_fires_a_timeout(hook, handle, monkeypatch):
    monkeypatch.setattr(trigger_module, "DEADLINE_GRACE", 0.5)
    job = hook.start_detached(handle, "sleep 30", timeout=30, max_output_bytes=1000)
    try:
        event = first_event(make_trigger(hook, handle, job, deadline=time.time()))
        assert event["status"] == "timeout" and "after its deadline" in event["message"]
    finally:
        hook.stop(handle, job)


def test_a_sandbox_that_is_gone_fires_gone(hook, handle):
    job = hook.start_detached(handle, "sleep 30", timeout=30, max_output_bytes=1000)
    hook.stop(handle, job)
    shutil.rmtree(os.path.join(hook.root, handle))
    event = first_event(make_trigger(hook, handle, job))
    assert event["status"] == "gone" and handle in event["message"]


def test_on_kill_destroys_the_sandbox(hook, handle):
    job = hook.start_detached(handle, "sleep 30", timeout=30, max_output_bytes=1000)
    try:
        asyncio.run(make_trigger(hook, handle, job).on_kill())
        assert not os.path.isdir(os.path.join(hook.root, handle))
    finally:
        end_job(job)


def test_on_kill_of_an_attached_sandbox_stops_the_command_and_releases(hook, handle):
    job = hook.start_detached(handle, "sleep 30", timeout=30, max_output_bytes=1000)
    released = []
    hook_class = type("Releasing", (DetachedFakeHook,), {"release": lambda self, h, *, holder: released.append(h)})
    globals()["Releasing"] = hook_class
    trigger = make_trigger(hook, handle, job, hook_class=f"{__name__}:Releasing", on_kill_action="stop", holder="d/r/t")
    asyncio.run(trigger.on_kill())
    state = hook.poll(handle, job)
    assert state.stopped and state.exit_code == 137
    assert released == [handle] and os.path.isdir(os.path.join(hook.root, handle))


@pytest.mark.parametrize(("task_state", "destroyed"), [("deferred", False), ("failed", True), ("success", True)])
def test_before_airflow_3_3_cleanup_ends_the_work_only_when_the_task_left_deferred(
    hook, handle, monkeypatch, task_state, destroyed
):
    monkeypatch.setattr(trigger_module, "_USER_KILLS_CALL_ON_KILL", False)
    job = hook.start_detached(handle, "sleep 30", timeout=30, max_output_bytes=1000)
    trigger = make_trigger(hook, handle, job)

    async def state():
        return task_state

    monkeypatch.setattr(trigger, "_task_state", state)
    try:
        asyncio.run(trigger.cleanup())
        assert os.path.isdir(os.path.join(hook.root, handle)) is not destroyed
    finally:
        end_job(job)


def test_serialize_round_trips():
    trigger = SandboxCommandTrigger(
        hook_class="m:C", hook_arguments={"a": 1}, handle="h", job="0" * 32, deadline=5.0, cursor=[3, 4]
    )
    path, kwargs = trigger.serialize()
    assert path == "sandbox_provider.triggers.sandbox.SandboxCommandTrigger"
    assert SandboxCommandTrigger(**kwargs).serialize() == (path, kwargs)
    assert kwargs["cursor"] == [3, 4]
    with pytest.raises(ValueError, match="job id"):
        SandboxCommandTrigger(hook_class="m:C", hook_arguments={}, handle="h", job="../x", deadline=5.0)


def test_only_whole_lines_are_relayed_before_the_end():
    assert relayable(b"a\nb\npart", final=False) == 4
    assert relayable(b"a\nb\npart", final=True) == 8
    assert relayable(b"x" * (MAX_LINE_BYTES + 5), final=False) == MAX_LINE_BYTES
    assert relayable(b"x" * 10, final=False) == 0


def test_a_collected_command_says_its_seconds_run_to_the_collection(hook, caplog_records):
    """
    The end of a detached command is known only when its result is read, after the trigger's polls
    and the task's resumption: the line says so instead of calling that time the command's (issue 28;
    a 10 s command deferred in a real deployment read "exited with status 0 after 22.1s").
    """
    from sandbox_provider.sandbox import SandboxSession

    with SandboxSession(hook) as session:
        job = session.start_detached("echo done", timeout=30, max_output_bytes=100)
        while not hook.poll(session.handle, job.id).ended:
            time.sleep(0.05)
        time.sleep(1.0)  # the task resumes a while after the command ended
        result = session.collect_detached(job, max_output_bytes=100)
    assert result.ok and result.stdout == "done\n"
    line = next(m for m in caplog_records() if m.startswith("The command exited with status 0"))
    assert "its result was collected" in line and "after it started" in line, line
    assert float(line.split("collected ")[1].split("s ")[0]) >= 1.0, line  # the wait is in it, and said to be


@pytest.fixture
def caplog_records(request):
    import logging

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    logger = logging.getLogger("sandbox_provider.engine.session")
    handler = Keep(logging.INFO)
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    request.addfinalizer(lambda: (logger.removeHandler(handler), logger.setLevel(previous)))
    return lambda: kept
