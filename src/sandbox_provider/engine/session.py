"""
The session engine: one object owns one sandbox's life for one job, for every consumer.

``SandboxOperator``, ``@task.sandbox`` and ``SandboxToolset`` all drive a sandbox through
:class:`SandboxSession`, so provisioning, attaching, staging, exporting and teardown behave the
same everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sandbox_provider.engine import metrics
from sandbox_provider.engine.lineage import SandboxReport, report_hook_lineage
from sandbox_provider.engine.options import SessionOptions
from sandbox_provider.engine.output import mask_text
from sandbox_provider.engine.transfer import (
    ExportRecord,
    check_input,
    export_files,
    export_targets,
    log_staged,
    stage_batch,
    stage_entries,
)
from sandbox_provider.engine.watch import SupervisorWatch, supervisor_pid
from sandbox_provider.sandbox.batch import ImportEntry
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.hook import OutputCallback, SandboxHook, check_command
from sandbox_provider.sandbox.jobs import DetachedJob
from sandbox_provider.sandbox.output import format_time
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    MAP_INDEX_TAG,
    OWNER_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
    AttachedSandbox,
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_positive,
    dag_run_owner,
    trace_stamps,
)

log = logging.getLogger(__name__)

__all__ = ["SandboxSession", "task_holder"]

_RELEASE_ATTEMPTS = 3
#: Characters of a command shown in the task log.
_COMMAND_CHARS = 2000


def task_holder(context: Mapping[str, Any]) -> str:
    """
    Return the holder token of the running task: ``"<dag_id>/<run_id>/<task_id>"``, plus
    ``"[<map_index>]"`` for a mapped task. The try number is left out, so a retry is the same holder.
    """
    ti = context["ti"]
    holder = f"{ti.dag_id}/{ti.run_id}/{ti.task_id}"
    map_index = getattr(ti, "map_index", -1)
    if isinstance(map_index, int) and map_index >= 0:
        holder += f"[{map_index}]"
    return holder


class SandboxSession:
    """
    Provision (or attach to) one sandbox, stage its inputs, run work in it, then export and tear down.

    Nothing is provisioned until the first call that needs the sandbox (:meth:`ensure`). Use it as a
    context manager (``with`` or ``async with``); leaving the block calls :meth:`close` with whether
    the block succeeded.

    :param hook: the backend.
    :param options: what to do with the sandbox (:class:`SessionOptions`); or give its fields as
        keyword arguments instead (``spec``, ``attach_to``, ``files``, ``inputs``, ``exports``, ...),
        with ``owner`` for its ``sandbox_owner``. Checked, with the backend, before anything is provisioned.
    :param spec: the spec to provision with; None means ``SandboxSpec()`` (no network, no env).
    :param attach_to: handle of a sandbox another task provisioned; needs an attachable backend.
    :param owner: the owner the attached sandbox must carry. Default: the current Dag run
        (:func:`dag_run_owner`).
    :param holder: who holds the sandbox while attached. Default: the current task (:func:`task_holder`).
    :param files: ``{sandbox path: text or bytes}`` written in right after provisioning.
    :param inputs: ``{sandbox path: storage URL}`` streamed in right after provisioning.
    :param input_conn_id: Airflow connection for the input URLs.
    :param exports: ``{sandbox path: storage URL}`` copied out when the session closes after success.
    :param export_conn_id: Airflow connection for the export URLs.
    :param max_export_bytes: the largest file an export copies, in bytes (default 1 GiB).
    :param keep: what happens to the sandbox at close. None (default): destroy one this session
        provisioned, release one it attached to. True: leave it standing (and released). False:
        destroy it even when attached, for a task that collects and cleans up.
    :param context: the Airflow task context, for the default owner and holder.
    :param clock: monotonic clock in seconds, injectable for tests.
    :raises ValueError: on bad arguments, before anything is provisioned.
    """

    def __init__(
        self,
        hook: SandboxHook,
        options: SessionOptions | None = None,
        *,
        holder: str | None = None,
        context: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owner: str | None = None,
        **fields: Any,
    ) -> None:
        if not isinstance(hook, SandboxHook):
            raise ValueError(f"A sandbox session needs a SandboxHook, got {type(hook).__name__}.")
        if options is None:
            if fields.get("attach_to") is not None:  # a handle that rendered to nothing is terminal
                fields["attach_to"] = SessionOptions().rendered(attach_to=fields["attach_to"]).attach_to
            options = SessionOptions(sandbox_owner=owner, **fields)
        elif owner is not None or fields:
            raise ValueError("Pass either options or the separate keyword arguments, not both.")
        try:
            options.check_backend(hook)
        except SandboxTerminalError:
            metrics.count("sandbox.refusals", hook)
            raise
        self.hook = hook
        self.options = options
        self.attach_mode = options.attach_mode
        self.spec = options.provision_spec(hook, context)
        self.attach_to = options.attach_to
        self.files = options.files
        self.inputs = options.inputs
        self.exports = options.exports
        self.input_conn_id = options.input_conn_id
        self.export_conn_id = options.export_conn_id
        self.max_export_bytes = options.max_export_bytes
        self.keep = options.keep
        self._owner = options.sandbox_owner if self.attach_mode else None
        self._context = context
        self._holder = holder
        self._clock = clock
        self._lock = threading.RLock()
        self._handle: str | None = None
        self._attached: AttachedSandbox | None = None
        self._expires_at: float | None = None
        self._ended = False
        self._closed = False
        self._closed_because: str | None = None
        self._storage_checked = False
        self._pending: list[ImportEntry] = []
        self._watch: SupervisorWatch | None = None
        self.export_records: list[ExportRecord] = []
        #: What this session did with its sandbox (handle, network, exit status, exports), for lineage.
        self.report = SandboxReport.of(hook, self.spec, attached=self.attach_mode)
        self._inputs_reported = False

    # -- identity ------------------------------------------------------------------------------------

    def _identity(self) -> tuple[str, str]:
        context = self._context
        if context is None and (self._owner is None or self._holder is None):
            try:
                from airflow.sdk import get_current_context

                context = get_current_context()
            except Exception:
                context = None
        owner = self._owner or (dag_run_owner(context) if context else None)
        if not owner:
            raise SandboxTerminalError(
                "attach_to needs an owner. Outside a running task, pass owner=... matching the "
                "SandboxSpec.owner the sandbox was provisioned with."
            )
        holder = self._holder or (task_holder(context) if context else owner)
        return owner, holder

    def _trace(self) -> dict[str, str]:
        """The stamps naming the running task instance and try; empty outside a task."""
        return trace_stamps(self._context)

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def handle(self) -> str | None:
        """The sandbox's handle, or None before anything was provisioned or attached."""
        return self._handle

    @property
    def holder(self) -> str | None:
        """Who holds the attached sandbox (set once attached); None when this session provisioned it."""
        return self._holder if self.attach_mode else None

    @property
    def closed(self) -> bool:
        """The session was closed (or suspended): nothing more runs in it."""
        return self._closed

    @property
    def attached(self) -> AttachedSandbox | None:
        """What attaching reported (remaining lifetime, network, workdir), in attach mode."""
        return self._attached

    def open(self) -> None:
        """
        Check what the constructor could not, before provisioning (:meth:`check_storage`); then
        attach, in attach mode, so a wrong owner or holder fails before any work.

        :raises ValueError: naming the entry to fix.
        :raises SandboxTerminalError: for a destination or input the transfer cannot use.
        """
        self.check_storage()
        if self.attach_mode:
            self.ensure()

    def check_storage(self) -> None:
        """
        Check every export destination and input source on the worker's side, needing no sandbox: a
        filesystem for each URL's scheme exists (and its connection resolves); no destination is a
        directory, device, pipe or socket, or lies below a file, or is one file with another once symlinks
        are followed; each ``file://`` input exists, is a regular file, and lies in ``[sandbox]
        file_input_dirs`` when that is set; every member of a directory input is listed and checked the
        same way (:func:`~sandbox_provider.engine.transfer.stage_entries`), and what is staged later is
        that list. Runs once; :meth:`ensure` runs it if :meth:`open` did not.

        :raises ValueError: naming the entry to fix.
        :raises SandboxTerminalError: for a destination or input the transfer cannot use.
        """
        if self._storage_checked:
            return
        export_targets(self.exports, conn_id=self.export_conn_id)
        for path, url in self.inputs.items():
            check_input(url, self.input_conn_id, f"inputs[{path!r}]")
        try:
            self._pending = stage_entries(self.files, self.inputs, conn_id=self.input_conn_id)
        except SandboxTerminalError:
            raise
        except SandboxError as err:
            raise SandboxTerminalError(f"Could not read the inputs to stage: {err}") from err
        self._storage_checked = True

    def ensure(self, *, defer: bool = False) -> str:
        """
        Return the sandbox's handle, provisioning or attaching on first use, then staging inputs.

        :param defer: leave the files and inputs for the next :meth:`run` to stage in the command's
            own launch (one sandbox launch fewer on backends that can); any other use stages them first.

        :raises SandboxTerminalError: if provisioning, attaching or staging fails, or the session
            is closed, or an attached sandbox ended.
        """
        with self._lock:
            if self._closed:
                raise SandboxTerminalError("This sandbox session is closed; open a new one.")
            if self._handle is not None:
                if self._pending and not defer:
                    self._stage_pending(self._handle)
                return self._handle
            if self._ended:
                raise SandboxTerminalError(
                    f"Not attached to sandbox {self.attach_to!r}: the sandbox ended, and a sandbox another task "
                    "owns is not replaced."
                )
            self.check_storage()
            handle = self._attach() if self.attach_mode else self._provision()
            if self._closed:
                # Closed while provisioning (on_kill runs in the thread it interrupts): tear down
                # what was just made, and let nothing run in it.
                self._handle = None
                because = self._closed_because
                self._teardown(handle, because)
                raise SandboxTerminalError(
                    f"The session was closed while sandbox {handle} was being provisioned"
                    + (
                        f", because {because}; the sandbox was destroyed."
                        if because
                        else "; the sandbox was destroyed."
                    )
                )
            self._watch_supervisor()
            if not defer:
                self._stage_pending(handle)
            return handle

    def _stage_pending(self, handle: str) -> None:
        """Write the files and inputs not staged yet, in one batch."""
        entries, self._pending = self._pending, []
        if not entries:
            return
        try:
            with metrics.timed("stage", self.hook):
                stage_batch(self.hook, handle, entries)
        except SandboxError as err:
            raise SandboxTerminalError(f"Could not stage the inputs of sandbox {handle}: {err}") from err
        self._report_inputs()

    def _report_inputs(self) -> None:
        """Tell Airflow's hook lineage which storage URLs were staged in, once."""
        if self.inputs and not self._inputs_reported:
            self._inputs_reported = True
            report_hook_lineage(self.hook, inputs=[url for url in self.inputs.values() if isinstance(url, str)])

    def _attach(self) -> str:
        owner, holder = self._identity()
        try:
            with metrics.timed("attach", self.hook):
                attached = self.hook.attach(self.attach_to, owner=owner, holder=holder)
        except SandboxTerminalError:
            raise
        except SandboxError as err:
            raise SandboxTerminalError(
                f"Could not attach to sandbox {self.attach_to!r} on backend {self.hook.name!r}: {err}"
            ) from err
        self._attached = attached
        self.report.attached_to(attached)
        self._holder = holder
        if attached.remaining_lifetime is not None:
            self._expires_at = self._clock() + attached.remaining_lifetime
        self._handle = attached.handle
        left = "an unknown part" if attached.remaining_lifetime is None else f"{attached.remaining_lifetime:.0f}s"
        log.info(
            "Attached to sandbox %s on backend %s as %s; %s of its lifetime remain",
            attached.handle,
            self.hook.name,
            holder,
            left,
        )
        return attached.handle

    def _provision(self) -> str:
        self._end_earlier_tries()
        try:
            with metrics.timed("create", self.hook):
                handle = self.hook.create(spec=self.spec)
        except SandboxTerminalError:
            raise
        except SandboxError as err:
            raise SandboxTerminalError(f"Could not provision a sandbox on backend {self.hook.name!r}: {err}") from err
        self._handle = handle
        self.report.provisioned(self.hook, handle)
        self._log_provisioned(handle)
        return handle

    def _log_provisioned(self, handle: str) -> None:
        expires = self.hook._known_expiry.get(handle)
        lifetime = (
            f"; its lifetime ends in {max(0.0, expires - time.time()):.0f}s, at {format_time(expires)}"
            if expires is not None
            else ""
        )
        where = self.hook.location(handle)
        log.info(
            "Provisioned sandbox %s on backend %s%s%s; %s",
            handle,
            self.hook.name,
            f" ({where})" if where else "",
            lifetime,
            _network_words(self.spec or SandboxSpec()),
        )

    def _earlier_tries(self) -> tuple[str, dict[str, dict[str, str]]]:
        """``(this try, {handle: stamps})`` of the sandboxes earlier tries of this task instance left."""
        stamps = self._trace()
        current = stamps.get(TRY_NUMBER_TAG, "")
        wanted = {key: stamps[key] for key in (DAG_ID_TAG, RUN_ID_TAG, TASK_ID_TAG, MAP_INDEX_TAG) if key in stamps}
        if not current.isdigit() or int(current) <= 1 or len(wanted) < 4:
            return current, {}
        try:
            found = self.hook.find_sandboxes(wanted)
        except NotImplementedError:
            log.info(
                "This is try %s; the %s backend cannot look for sandboxes earlier tries left running, so any stay "
                "until their lifetime ends.",
                current,
                self.hook.name,
            )
            return current, {}
        except Exception:
            log.warning("Could not look for sandboxes earlier tries of this task left running", exc_info=True)
            return current, {}
        earlier = {
            handle: tags
            for handle, tags in found.items()
            if tags.get(TRY_NUMBER_TAG, "").isdigit() and int(tags[TRY_NUMBER_TAG]) < int(current)
        }
        if not earlier:
            log.info(
                "This is try %s; no earlier try of this task left a sandbox running on backend %s",
                current,
                self.hook.name,
            )
        return current, earlier

    def _end_earlier_tries(self) -> None:
        """
        End the sandboxes earlier tries of this task instance left running (a killed worker, a lost
        supervisor), found by their creation stamps. Sandboxes that carry an owner are for other tasks
        to attach to, and stay.
        """
        current, earlier = self._earlier_tries()
        ended = 0
        for handle, tags in sorted(earlier.items(), key=lambda item: (int(item[1][TRY_NUMBER_TAG]), item[0])):
            number = tags[TRY_NUMBER_TAG]
            if tags.get(OWNER_TAG):
                log.info(
                    "Leaving sandbox %s of try %s as it is: it carries owner %r, for later tasks to attach to.",
                    handle,
                    number,
                    tags[OWNER_TAG],
                )
                continue
            try:
                self.hook.destroy(handle, reason=f"try {current} of the same task ended what try {number} left running")
            except Exception:
                log.warning("Could not end sandbox %s, left running by try %s", handle, number, exc_info=True)
                continue
            ended += 1
            log.info(
                "Ended sandbox %s on backend %s, which try %s of this task left running", handle, self.hook.name, number
            )
        metrics.count_leftovers_swept(self.hook, ended)
        if earlier and not ended:
            log.info(
                "This is try %s; no earlier try of this task left a sandbox running on backend %s",
                current,
                self.hook.name,
            )

    def _watch_supervisor(self) -> None:
        """End the sandbox if this task process loses its supervisor (see :mod:`~sandbox_provider.engine.watch`)."""
        if self._watch is not None:
            return
        pid = supervisor_pid()
        if pid is not None:
            self._watch = SupervisorWatch(pid, self._supervisor_gone).start()

    def _supervisor_gone(self) -> None:
        handle = self._handle
        watch = self._watch
        ending = "the task process stops" if self.attach_mode else "the sandbox is destroyed"
        message = (
            f"The supervisor (pid {watch and watch.pid}) of task {task_holder(self._context) if self._context else '?'} "
            f"exited while sandbox {handle} on backend {self.hook.name} was in use; {ending}"
        )
        # The task log went with its relay, the supervisor: the worker that started the supervisor hears it too.
        log.warning("%s", message)
        if watch is not None:
            watch.tell_worker(message)
        if self.attach_mode:
            # Another task's sandbox: never ended here. The command stops with the task process.
            return
        self.keep = False
        self.close(succeeded=False, reason="the task's supervisor exited, so nobody would see or stop its work")

    def remaining_lifetime(self) -> float | None:
        """Seconds left for an attached sandbox, by the local clock; None when unknown."""
        if self._expires_at is None:
            return None
        return max(0.0, self._expires_at - self._clock())

    def run(
        self,
        command: str,
        *,
        timeout: float,
        max_output_bytes: int,
        on_output: OutputCallback | None = None,
        read_back: str | None = None,
    ) -> SandboxExecResult:
        """
        Run ``command`` in the sandbox (provisioning it first if needed).

        The backend clamps the timeout to the lifetime the sandbox has left.

        :param on_output: called with ``("stdout" | "stderr", bytes)`` as output arrives; its ``flush()``,
            if it has one (:class:`~sandbox_provider.engine.task_log.TaskLog` does), when the command ended.
        :param read_back: a file read right after with :meth:`read_file` (see ``SandboxHook.run_command``).

        :raises SandboxTerminalError: if the sandbox ended, or an attached one stopped mid-command.
        """
        # Checked here too, before the first command provisions the sandbox.
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        check_command(command)
        handle = self.ensure(defer=True)
        with self._lock:
            stage, self._pending = self._pending, []
        log.info("Running in sandbox %s (timeout %gs): %s", handle, float(timeout), _shown(command))
        started = self._clock()
        try:
            with metrics.timed("run", self.hook, clock=self._clock, staged="true" if stage else "false"):
                result = self._run_staged(
                    handle, command, stage, float(timeout), int(max_output_bytes), on_output, read_back
                )
        finally:
            flush = getattr(on_output, "flush", None)
            if callable(flush):
                flush()  # a last line without a newline goes to the log before how the command ended
        self._ran(result, self._clock() - started)
        if stage:
            self._report_inputs()
        if result.sandbox_terminated:
            with self._lock:
                self._handle = None
                if self.attach_mode:
                    self._ended = True
                    raise SandboxTerminalError(
                        f"The sandbox this task attached to, {self.attach_to!r}, stopped while running a command. "
                        "The task that provisioned it decides its lifetime, so nothing can replace it here."
                    )
        return result

    def _ran(self, result: SandboxExecResult, seconds: float, *, collected: bool = False) -> None:
        """
        Log, count and record how a command ended, ``seconds`` after it started. ``collected``: a
        detached command whose end is not known, only when its result was read (``seconds`` then
        include the trigger's polls and the task's resumption), which the line says.
        """
        if collected:
            log.info(
                "%s; its result was collected %.1fs after it started (the trigger's polls and the task's "
                "resumption included)",
                _ending(result),
                seconds,
            )
        else:
            log.info("%s after %.1fs", _ending(result), seconds)
        if result.timed_out:
            metrics.count("sandbox.timeouts", self.hook)
        if result.sandbox_terminated:
            metrics.count("sandbox.failures", self.hook, step="run")
        self.report.exit_code = None if result.timed_out or result.sandbox_terminated else result.exit_code
        self.report.timed_out = result.timed_out
        self.report.command_seconds = round(seconds, 3)

    # -- detached commands (deferrable tasks) -------------------------------------------------------

    def start_detached(self, command: str, *, timeout: float, max_output_bytes: int) -> DetachedJob:
        """
        Start ``command`` detached in the sandbox (provisioning and staging first if needed), for a
        task that defers while it runs; see :meth:`SandboxHook.start_detached`. Then :meth:`suspend`.

        :raises SandboxTerminalError: if the sandbox cannot be had, or the command cannot start.
        """
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        check_command(command)
        handle = self.ensure()
        try:
            job = self.hook.start_detached(handle, command, timeout=float(timeout), max_output_bytes=max_output_bytes)
        except SandboxTerminalError:
            raise
        except SandboxError as err:
            raise SandboxTerminalError(str(err)) from err
        log.info(
            "Started in sandbox %s, detached as job %s (timeout %gs): %s", handle, job.id, job.timeout, _shown(command)
        )
        return job

    def suspend(self) -> str | None:
        """
        Leave the sandbox as it is for another process to :meth:`resume` (the task defers): no export,
        no teardown; this process stops watching its supervisor. Returns the handle.
        """
        with self._lock:
            self._closed = True
            handle = self._handle
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        return handle

    @classmethod
    def resume(
        cls,
        hook: SandboxHook,
        options: SessionOptions,
        handle: str,
        *,
        context: Mapping[str, Any] | None = None,
        holder: str | None = None,
    ) -> SandboxSession:
        """
        The session a task :meth:`suspend`-ed, picked up again in a new process once its detached
        command ended: its sandbox ``handle`` stands as it was (inputs staged, attached in attach
        mode, as ``holder``); :meth:`close` exports and tears down as usual.

        :raises SandboxTerminalError: for a handle the backend cannot name.
        """
        session = cls(hook, options, context=context, holder=holder)
        session._handle = hook.check_handle(handle)
        session._storage_checked = True  # checked, and staged, before the task deferred
        if session.attach_mode:
            session._holder = session._identity()[1]
        session._watch_supervisor()
        return session

    def collect_detached(self, job: DetachedJob, *, max_output_bytes: int) -> SandboxExecResult:
        """
        The result of detached ``job`` once it ended (exit status, tails), logged as :meth:`run` logs it.

        :raises SandboxTerminalError: when the sandbox is gone, or holds no such job.
        """
        handle = self.ensure()
        try:
            result = self.hook.job_result(handle, job.id, max_output_bytes=max_output_bytes, timeout=job.timeout)
        except SandboxTerminalError:
            with self._lock:
                self._handle = None
            raise
        except SandboxError as err:
            raise SandboxTerminalError(str(err)) from err
        self._ran(result, max(0.0, time.time() - job.started_at), collected=True)
        return result

    def stop_detached(self, job: DetachedJob) -> None:
        """Stop detached ``job`` (a deferred command that outlived its deadline, say); errors are logged."""
        handle = self._handle
        if handle is None:
            return
        try:
            self.hook.stop(handle, job.id)
        except Exception:
            log.warning("Could not stop job %s in sandbox %s", job.id, handle, exc_info=True)

    def _run_staged(self, handle, command, stage, timeout, max_output_bytes, on_output, read_back) -> SandboxExecResult:
        """The command, with the files and inputs still to stage written in by the same launch."""
        asked = {"read_back": read_back} if read_back is not None else {}
        if not stage:
            return self.hook.run_command(
                handle, command, timeout=timeout, max_output_bytes=max_output_bytes, on_output=on_output, **asked
            )
        # Staging shares the command's launch, so its own seconds are not known: the line says what goes in.
        log_staged(handle, stage, None)
        try:
            return self.hook.run_command(
                handle,
                command,
                timeout=timeout,
                max_output_bytes=max_output_bytes,
                on_output=on_output,
                stage=stage,
                **asked,
            )
        except SandboxTerminalError:
            raise
        except SandboxError as err:
            raise SandboxTerminalError(f"Could not stage the inputs of sandbox {handle}: {err}") from err

    def read_file(self, path: str, *, max_bytes: int) -> bytes:
        return self.hook.read_file(self.ensure(), path, max_bytes=max_bytes)

    def write_file(self, path: str, data: bytes) -> None:
        self.hook.write_file(self.ensure(), path, data)

    def list_directory(self, path: str = ".") -> list[tuple[str, bool]]:
        return self.hook.list_directory(self.ensure(), path)

    def close(self, *, succeeded: bool = True, reason: str | None = None) -> list[ExportRecord]:
        """
        End the session: export (after success only), then destroy, release, or keep the sandbox.

        Destroy and release failures are logged with the handle and never mask the job's own error.

        :param reason: why the sandbox is destroyed before its job is done (the task was stopped, say), as
            words that follow "destroyed because"; a command running in it then fails saying so.
        :returns: the exported files, in the order given.
        :raises SandboxTerminalError: if an export fails, or the run ended with no sandbox standing
            while files were to be exported.
        """
        with self._lock:
            if self._closed:
                return self.export_records
            self._closed = True
            self._closed_because = reason
            handle, self._handle = self._handle, None
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        try:
            if succeeded and self.exports:
                self._export(handle)
            return self.export_records
        finally:
            if handle is not None:
                self._teardown(handle, reason)

    def _export(self, handle: str | None) -> None:
        """Copy the exports out (see :func:`~sandbox_provider.engine.transfer.export_files`), timed and reported."""
        with metrics.timed("export", self.hook):
            if handle is None:
                names = ", ".join(repr(p) for p in self.exports)
                raise SandboxTerminalError(
                    f"The run ended with no sandbox standing, so none of the files it was to export exist: {names}."
                )
            self.export_records = export_files(
                self.hook,
                handle,
                self.exports,
                conn_id=self.export_conn_id,
                max_bytes=self.max_export_bytes,
                stamps=self._trace(),
            )
        self.report.exports = list(self.export_records)
        report_hook_lineage(self.hook, exports=self.export_records)

    def _teardown(self, handle: str, reason: str | None = None) -> None:
        destroy = (not self.attach_mode) if self.keep is None else (self.keep is False)
        if destroy:
            try:
                with metrics.timed("destroy", self.hook):
                    # Nothing of this task depends on the removal itself: it may finish after the result is sent.
                    self.hook.destroy(handle, reason=reason, wait=False)
                log.info("Destroyed sandbox %s on backend %s, with its files and processes", handle, self.hook.name)
            except Exception:
                log.warning(
                    "Failed to destroy sandbox %s on backend %s; it may need manual cleanup",
                    handle,
                    self.hook.name,
                    exc_info=True,
                )
            return
        if self.attach_mode and self._holder:
            self._release(handle, self._holder)
        else:
            log.info("Keeping sandbox %s on backend %s for a later task", handle, self.hook.name)

    def _release(self, handle: str, holder: str) -> None:
        for attempt in range(1, _RELEASE_ATTEMPTS + 1):
            try:
                self.hook.release(handle, holder=holder)
                return
            except SandboxTerminalError:
                log.info("Sandbox %s has ended; nothing to release", handle)
                return
            except Exception:
                if attempt == _RELEASE_ATTEMPTS:
                    log.warning("Could not release sandbox %s; holder %r is left on it", handle, holder, exc_info=True)
                    return
                time.sleep(1.0)

    # -- context managers ----------------------------------------------------------------------------

    def __enter__(self) -> SandboxSession:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(succeeded=exc_type is None)

    async def __aenter__(self) -> SandboxSession:
        await asyncio.to_thread(self.open)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await asyncio.to_thread(self.close, succeeded=exc_type is None)

    async def aensure(self) -> str:
        return await asyncio.to_thread(self.ensure)

    async def arun(self, command: str, *, timeout: float, max_output_bytes: int) -> SandboxExecResult:
        return await asyncio.to_thread(self.run, command, timeout=timeout, max_output_bytes=max_output_bytes)

    async def aread_file(self, path: str, *, max_bytes: int) -> bytes:
        return await asyncio.to_thread(self.read_file, path, max_bytes=max_bytes)

    async def awrite_file(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self.write_file, path, data)

    async def alist_directory(self, path: str = ".") -> list[tuple[str, bool]]:
        return await asyncio.to_thread(self.list_directory, path)


def _shown(command: str) -> str:
    """The command as the task log shows it: masked, and cut after :data:`_COMMAND_CHARS` characters."""
    shown = mask_text(command)
    if len(shown) > _COMMAND_CHARS:
        shown = shown[:_COMMAND_CHARS] + f" [... {len(shown) - _COMMAND_CHARS} more characters]"
    return shown


def _network_words(spec: SandboxSpec) -> str:
    """What the spec lets the sandbox reach, in a few words for the log."""
    if not spec.block_network:
        return "it has an open network"
    allowed = [*(spec.allow_egress_to or ()), *(spec.allow_egress_to_cidrs or ())]
    if not allowed:
        return "it has no network"
    return "its network reaches only " + ", ".join(allowed)


def _ending(result: SandboxExecResult) -> str:
    """How a command ended, in a few words for the log."""
    if result.sandbox_terminated:
        return "The sandbox ended while the command ran"
    if result.timed_out:
        return "The command ran past its deadline and was killed"
    return f"The command exited with status {result.exit_code}"
