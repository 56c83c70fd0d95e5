"""
``SandboxCommandTrigger``: the triggerer's half of a deferred sandbox command.

A ``SandboxOperator`` (or ``@task.sandbox``) with ``deferrable=True`` provisions and stages on a
worker, starts its command detached in the sandbox
(:meth:`~sandbox_provider.sandbox.hook.SandboxHook.start_detached`) and defers to this trigger, which
polls the command through the same hook, in a thread, relays its new output lines to the task log
as they come, and fires once: when the command ended, when it outlived its deadline, or when the
sandbox is gone. The task then resumes on a worker, reads the result, exports and destroys.

Where the trigger stands in the output is kept in the sandbox, beside the output (Airflow keeps a
trigger's arguments as they were when the task deferred): each poll records, in the same call that
fetches the next output, how far the lines before were logged and which bytes it is about to log
(in flight). A trigger restarted on another triggerer resumes after the last line recorded as logged;
when the one before stopped with a batch in flight (killed between logging it and its next poll), the
batch follows again under a line saying how many bytes of it may already be in the log, so no line is
ever left out and a repeat is always announced. A triggerer that shuts down (a deploy, a restart)
records where it stood as it goes: nothing is in flight and nothing repeats. docs/deferrable.md
states the guarantee.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from sandbox_provider.engine.task_log import TaskLog
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.hook import SandboxHook
from sandbox_provider.sandbox.jobs import JobCursor, JobState, check_job_id

log = logging.getLogger(__name__)

__all__ = ["SandboxCommandTrigger", "check_deferrable", "detached_backends"]

#: Default seconds between two polls while a command prints nothing.
DEFAULT_POLL_INTERVAL = 5.0
#: Seconds past a command's deadline before the trigger stops waiting for the sandbox to end it.
DEADLINE_GRACE = 60.0
#: The longest piece of a line without a newline relayed at once, in bytes.
MAX_LINE_BYTES = 16 * 1024
#: Seconds a poll that failed for a reason that may pass (a network blip) is retried for, at most.
RETRY_SECONDS = 300.0

#: Whether this Airflow calls ``on_kill`` when a user acts on a deferred task (mark failed, clear):
#: Airflow 3.3 does; before it, only ``cleanup`` runs, on a user's action and on a triggerer restart alike.
_USER_KILLS_CALL_ON_KILL = "on_kill" in BaseTrigger.__dict__


def detached_backends() -> list[str]:
    """The display names of the backends that run commands detached, for messages."""
    from sandbox_provider.hooks import hook_classes

    return [cls.display_name for cls in hook_classes() if cls.detached_commands]


def check_deferrable(hook: SandboxHook | None) -> None:
    """
    :raises ValueError: unless ``hook``'s backend can run commands detached (None: the local
        backend, which cannot), naming the backends that can.
    """
    if hook is not None and hook.detached_commands:
        return
    name = "local" if hook is None else hook.display_name
    reason = hook.detached_refusal if hook is not None else _local_refusal()
    can = ", ".join(detached_backends())
    raise ValueError(
        f"deferrable=True needs a backend whose sandboxes a triggerer can check on, and the {name} backend's "
        f"cannot: {reason} Backends that can: {can}. Drop deferrable=True, or use one of them."
    )


def _local_refusal() -> str:
    from sandbox_provider.hooks.local import LocalSandboxHook

    return LocalSandboxHook.detached_refusal


def _merged(older: JobCursor, newer: JobCursor) -> JobCursor:
    return JobCursor(max(older.stdout, newer.stdout), max(older.stderr, newer.stderr))


def relayable(data: bytes, *, final: bool) -> int:
    """
    How many bytes of ``data`` (new output of one stream) to relay now: up to its last newline; all
    of it once the command ended (``final``), or when it holds no newline in :data:`MAX_LINE_BYTES`.
    """
    if final:
        return len(data)
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) >= MAX_LINE_BYTES:
        return MAX_LINE_BYTES
    return end


class SandboxCommandTrigger(BaseTrigger):
    """
    Poll a command started detached in a sandbox until it ends; relay its output to the task log.

    :param hook_class: the backend's hook class, ``"module:ClassName"`` (a ``SandboxHook``).
    :param hook_arguments: keyword arguments that build it (``SandboxHook.detached_arguments()``).
    :param handle: the sandbox's handle.
    :param job: the detached job's id.
    :param deadline: Unix time (seconds) the command's deadline passes; the sandbox kills it then.
    :param cursor: ``[stdout, stderr]`` byte offsets already relayed; default the start.
    :param poll_interval: seconds between polls while the command prints nothing; default 5.
    :param on_kill_action: what a user's mark-failed or clear does: ``"destroy"`` the sandbox
        (default), or ``"stop"`` only the command and release the sandbox (one attached from another task).
    :param holder: with ``"stop"``, the holder to release the sandbox as.
    :param resume: what the task needs back when it resumes (JSON values), returned in the event as it is.

    Fires one event, a dict: ``{"status": "ended" | "timeout" | "gone", "handle", "job", "message",
    "resume"}`` with ``"exit_code"`` for ``"ended"``.
    """

    def __init__(
        self,
        *,
        hook_class: str,
        hook_arguments: Mapping[str, Any],
        handle: str,
        job: str,
        deadline: float,
        cursor: list[int] | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        on_kill_action: str = "destroy",
        holder: str | None = None,
        resume: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if on_kill_action not in ("destroy", "stop"):
            raise ValueError(f"on_kill_action must be 'destroy' or 'stop', got {on_kill_action!r}.")
        self.hook_class = hook_class
        self.hook_arguments = dict(hook_arguments)
        self.handle = handle
        self.job = check_job_id(job)
        self.deadline = float(deadline)
        self.cursor = JobCursor.from_value(cursor)
        self.poll_interval = float(poll_interval)
        self.on_kill_action = on_kill_action
        self.holder = holder
        self.resume = dict(resume or {})
        self._fired = False
        self._hook_obj: SandboxHook | None = None
        self._failing_since: float | None = None
        self._work_ended = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "hook_class": self.hook_class,
                "hook_arguments": self.hook_arguments,
                "handle": self.handle,
                "job": self.job,
                "deadline": self.deadline,
                "cursor": self.cursor.to_list(),
                "poll_interval": self.poll_interval,
                "on_kill_action": self.on_kill_action,
                "holder": self.holder,
                "resume": self.resume,
            },
        )

    # -- the hook ------------------------------------------------------------------------------------

    def _hook(self) -> SandboxHook:
        if self._hook_obj is None:
            from sandbox_provider.hooks import hook_class

            cls = hook_class(self.hook_class)
            if not (isinstance(cls, type) and issubclass(cls, SandboxHook)):
                raise TypeError(f"{self.hook_class!r} is not a sandbox hook class.")
            self._hook_obj = cls(**self.hook_arguments)
        return self._hook_obj

    # -- running -------------------------------------------------------------------------------------

    def _event(self, status: str, message: str, **extra: Any) -> TriggerEvent:
        self._fired = True
        payload = {"status": status, "handle": self.handle, "job": self.job, "message": message, "resume": self.resume}
        return TriggerEvent({**payload, **extra})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        # Logged as relayed: the cursor moves past a line only once it is in the log.
        relay = TaskLog(self.log, max_line_bytes=MAX_LINE_BYTES, inline=True)
        self.log.info(
            "Waiting for the command in sandbox %s on backend %s (job %s); its output follows",
            self.handle,
            hook.name,
            self.job,
        )
        try:
            state = await self._poll(hook, self.cursor, keep=False, max_bytes=1)
        except SandboxTerminalError as err:
            yield self._event("gone", str(err))
            return
        if state is not None:
            self.cursor = _merged(self.cursor, state.kept_cursor)
            doubt = _merged(self.cursor, state.in_flight)
            if doubt != self.cursor:
                self.log.warning(
                    "The triggerer before this one stopped between logging output and recording it: the next %d "
                    "bytes of standard output and %d of standard error follow again, and may already be above",
                    doubt.stdout - self.cursor.stdout,
                    doubt.stderr - self.cursor.stderr,
                )
        while True:
            try:
                state = await self._poll(hook, self.cursor, keep=True)
            except SandboxTerminalError as err:
                yield self._event("gone", str(err))
                return
            if state is not None:
                moved = self._relay(state, relay)
                if state.ended and state.caught_up:
                    await self._settle_log()
                    yield self._event(
                        "ended", f"The command exited with status {state.exit_code}", exit_code=state.exit_code
                    )
                    return
                if moved:
                    continue  # more may wait; the next poll also records where this one left off
            if time.time() > self.deadline + DEADLINE_GRACE:
                await self._settle_log()
                yield self._event(
                    "timeout",
                    f"The command was still running {DEADLINE_GRACE:g}s after its deadline, which the sandbox did not "
                    "enforce.",
                )
                return
            await asyncio.sleep(self.poll_interval)

    async def _settle_log(self) -> None:
        """
        Before firing, one round trip to the triggerer's supervisor (it reads the task's state), so the
        supervisor has taken in the lines logged before it: it closes the trigger's log file when it hears
        the trigger finished, and lines still unread on its log socket then never reach the file (the last
        six lines of a batch were lost so under load). Best effort: outside a triggerer there is no round trip.
        """
        try:
            await self._task_state()
        except Exception as err:  # noqa: BLE001 - the event matters more than the wait
            self.log.debug("Could not reach the triggerer's supervisor before firing: %s", err)

    async def _poll(
        self, hook: SandboxHook, since: JobCursor, *, keep: bool, max_bytes: int | None = None
    ) -> JobState | None:
        """One poll in a thread; None after an error that may pass (logged), which is retried for a while."""
        kwargs: dict[str, Any] = {"keep_cursor": keep}
        if max_bytes is not None:
            kwargs["max_bytes"] = max_bytes
        try:
            return await asyncio.to_thread(hook.poll, self.handle, self.job, since, **kwargs)
        except SandboxTerminalError:
            raise
        except (SandboxError, OSError) as err:
            self._failing_since = self._failing_since or time.monotonic()
            if time.monotonic() - self._failing_since > RETRY_SECONDS:
                raise SandboxTerminalError(
                    f"Could not check on the command in sandbox {self.handle} for {RETRY_SECONDS:g}s: {err}"
                ) from err
            self.log.warning("Could not check on the command in sandbox %s (will retry): %s", self.handle, err)
            return None

    def _relay(self, state: JobState, relay: TaskLog) -> bool:
        """Log the whole lines of ``state`` and move the cursor past them; True when it moved."""
        self._failing_since = None
        final = state.ended
        moved = False
        cursor = self.cursor
        for stream, data, skipped, start in (
            ("stdout", state.stdout, state.skipped.stdout, state.cursor.stdout - len(state.stdout)),
            ("stderr", state.stderr, state.skipped.stderr, state.cursor.stderr - len(state.stderr)),
        ):
            if skipped:
                self.log.warning(
                    "[%s] ... %d bytes of output were written faster than they were relayed, and are no longer kept "
                    "in the sandbox",
                    stream,
                    skipped,
                )
            take = relayable(data, final=final and start + len(data) >= getattr(state.totals, stream))
            if take:
                relay(stream, data[:take])
                if not data[:take].endswith(b"\n"):
                    relay.flush()
            if take or skipped:
                moved = True
                cursor = dataclasses.replace(cursor, **{stream: start + take})
        self.cursor = cursor
        return moved

    # -- a user's action while deferred ----------------------------------------------------------------

    async def on_kill(self) -> None:
        """Airflow 3.3 and later: a user marked the deferred task failed or success, or cleared it."""
        if not self._fired:
            await asyncio.to_thread(self._end_work, "the task was marked failed, success or cleared while deferred")

    async def cleanup(self) -> None:
        """
        The trigger stops without having fired: a triggerer shutting down (the command runs on, and
        where the relay stands is recorded in the sandbox, nothing in flight), or a user's action.
        Before Airflow 3.3 this is the only call on a user's action too: the task's state tells them
        apart (still deferred: a shutdown).
        """
        if self._fired or self._work_ended:
            return
        if not _USER_KILLS_CALL_ON_KILL:
            try:
                state = await self._task_state()
            except Exception:
                self.log.warning(
                    "Could not read the task's state; leaving sandbox %s running", self.handle, exc_info=True
                )
                state = None
            if state is not None and state != "deferred":
                await asyncio.to_thread(self._end_work, f"the task is {state} while its command was deferred")
                return
        await asyncio.to_thread(self._record)

    def _record(self) -> None:
        """Record in the sandbox that the relay stands at the cursor, nothing in flight (best effort)."""
        try:
            self._hook().poll(self.handle, self.job, self.cursor, max_bytes=1, keep_cursor=True, in_flight=False)
        except Exception as err:  # noqa: BLE001 - shutting down: the next trigger resumes from the last record
            self.log.warning("Could not record where the relay stands in sandbox %s: %s", self.handle, err)

    async def _task_state(self) -> str | None:
        ti = getattr(self, "task_instance", None)
        if ti is None:
            return None
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        states = await asyncio.to_thread(
            RuntimeTaskInstance.get_task_states,
            dag_id=ti.dag_id,
            task_ids=[ti.task_id],
            run_ids=[ti.run_id],
            map_index=ti.map_index,
        )
        key = f"{ti.task_id}_{ti.map_index}" if ti.map_index is not None and ti.map_index >= 0 else ti.task_id
        value = states.get(ti.run_id, {}).get(key)
        return None if value is None else str(getattr(value, "value", value))

    def _end_work(self, why: str) -> None:
        self._work_ended = True
        hook = self._hook()
        try:
            if self.on_kill_action == "stop":
                hook.stop(self.handle, self.job)
                if self.holder:
                    hook.release(self.handle, holder=self.holder)
                self.log.info("Stopped the command in sandbox %s and released the sandbox: %s", self.handle, why)
            else:
                hook.destroy(self.handle)
                self.log.info("Destroyed sandbox %s: %s", self.handle, why)
        except Exception:
            self.log.warning("Could not end the work in sandbox %s (%s)", self.handle, why, exc_info=True)
