"""``SandboxOperator``: run a shell command in an isolated sandbox, with files in and files out."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowSkipException, TaskDeferred

from sandbox_provider.engine.lineage import SandboxReport, emit_asset_events, plan_assets
from sandbox_provider.engine.options import SessionOptions, check_attachable
from sandbox_provider.engine.output import mask_stream, mask_text, tail_text
from sandbox_provider.engine.session import SandboxSession
from sandbox_provider.engine.task_log import TaskLog, log_policy
from sandbox_provider.engine.transfer import DEFAULT_MAX_EXPORT_BYTES
from sandbox_provider.hooks import get_sandbox_hook
from sandbox_provider.sandbox.hook import SandboxHook
from sandbox_provider.sandbox.jobs import DetachedJob
from sandbox_provider.sandbox.output import format_size
from sandbox_provider.sandbox.settings import TASK_SETTINGS
from sandbox_provider.sandbox.spec import (
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_positive,
)
from sandbox_provider.triggers.sandbox import DEFAULT_POLL_INTERVAL, SandboxCommandTrigger, check_deferrable

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.sdk import Asset, AssetAlias, Context

log = logging.getLogger(__name__)

__all__ = ["SandboxCommandError", "SandboxOperator"]

#: Default command deadline, in seconds.
DEFAULT_TIMEOUT = 1800.0
#: Default bytes of each output stream the backend keeps (the tail), per command.
DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
#: Characters of each stream kept in the XCom and in a failure message.
TAIL_CHARS = 2000


#: Why ``on_kill`` destroys the sandbox, as the failure of a command still running in it says.
STOPPED = (
    "the task was stopped while it ran (marked failed or cleared in Airflow, or its worker shut down), and its "
    "on_kill destroyed the sandbox"
)


class SandboxCommandError(AirflowException):
    """The command in the sandbox exited non-zero, timed out, or lost its sandbox."""


def _deferrable(value: Any) -> bool:
    """``deferrable=``, or the ``[sandbox] default_deferrable`` option for None."""
    if value is None:
        from airflow.sdk.configuration import conf

        return conf.getboolean("sandbox", "default_deferrable", fallback=False)
    if not isinstance(value, bool):
        raise ValueError(
            f"deferrable must be True, False or None (the [sandbox] default_deferrable option); got {value!r}."
        )
    return value


def _check_exit_codes(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    codes = [value] if isinstance(value, int) else list(value) if isinstance(value, Collection) else None
    if codes is None or isinstance(value, (str, bytes)):
        raise ValueError(f"skip_on_exit_code must be an exit status or a list of them, got {value!r}.")
    bad = [c for c in codes if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255]
    if bad:
        raise ValueError(
            f"skip_on_exit_code holds {bad!r}; give exit statuses from 1 to 255 (0 is success, which never skips)."
        )
    return frozenset(codes)


def _check_command_and_backend(command: Any, backend: Any, attach_to: Any, keep_sandbox: Any) -> None:
    """:raises ValueError: for a command or backend the operator cannot use, saying what to give instead."""
    if command is None:
        if keep_sandbox is not True:
            raise ValueError(
                "command is required; it may be None only with keep_sandbox=True, to provision a sandbox "
                "for later tasks without running anything."
            )
    elif not isinstance(command, str) or not command.strip():
        raise ValueError(f"command must be a non-empty shell command, got {command!r}.")
    if not (backend is None or isinstance(backend, SandboxHook) or (isinstance(backend, str) and backend.strip())):
        raise ValueError(
            "backend must be a sandbox hook, the id of a sandbox connection, or None for the local "
            f"backend; got {backend!r}."
        )
    if isinstance(backend, SandboxHook) and attach_to is not None:
        check_attachable(backend)


class SandboxOperator(BaseOperator):
    """
    Run a shell ``command`` in a sandbox: provision it (or attach to one), stage files in, run,
    export files out after success, and destroy it (or release or keep it).

    The command runs through ``sh -c`` in the sandbox's working directory (``/workspace`` on the
    local backend). A non-zero exit fails the task with the tail of standard error, unless the
    status is listed in ``skip_on_exit_code``.

    The task log follows the sandbox's life: where it was provisioned and until when, each file
    staged in and exported (size, seconds), the command (masked), and its output line by line as it
    arrives, ``[stdout] ...`` and ``[stderr] ...``, masked with Airflow's secret masker, as
    ``log_output`` says; then the exit status, how long it ran, and what was destroyed. Lines already
    logged stay when the task is killed. The command never waits for the log: lines the log cannot
    keep up with are counted and left out of it, never out of the tails (``max_output_bytes``) kept
    in memory for the XCom and a failure.

    Building the operator touches no connection: ``backend`` is resolved when the task runs.

    :param command: the shell command (templated). May be None only with ``keep_sandbox=True``,
        to provision and stage a sandbox for later tasks without running anything.
    :param backend: a :class:`~sandbox_provider.sandbox.hook.SandboxHook` instance, the id of an
        Airflow connection of a sandbox type, or None (default) for the local bubblewrap backend.
    :param spec: what the sandbox must be (network, environment, owner); default ``SandboxSpec()``,
        which blocks the network. Not allowed with ``attach_to``.
    :param files: ``{sandbox path: text or bytes}`` written into the sandbox before the command.
    :param inputs: ``{sandbox path: storage URL}`` streamed into the sandbox before the command
        (templated); any URL ``ObjectStoragePath`` opens (``s3://``, ``gs://``, ``file:///``). An
        Airflow ``Asset`` may stand for its URI; it is added to the task's inlets.
    :param exports: ``{sandbox path: storage URL}`` copied out after the command succeeds
        (templated). All or nothing: a failed copy changes no destination. An Airflow ``Asset`` may
        stand for its URI: it is added to the task's outlets, and its event carries ``bytes``,
        ``file_count``, ``backend``, ``handle`` and ``sandbox_path``. A sandbox path ending in ``/`` (or
        a glob) makes an Asset a directory.
    :param exports_as_assets: True makes every literal export URL an ``Asset`` outlet too (a template
        is refused: its Asset is unknown when the Dag is parsed); an ``AssetAlias`` is added to the
        outlets and the rendered URLs are emitted through it. Default False.
    :param input_conn_id: Airflow connection for the input URLs.
    :param export_conn_id: Airflow connection for the export URLs.
    :param timeout: seconds before the command's process tree is killed; default 1800.
    :param max_output_bytes: bytes of each output stream kept (the tail); default 1 MiB.
    :param max_export_bytes: the largest file one export copies, in bytes; default 1 GiB.
    :param skip_on_exit_code: exit status, or statuses, that skip the task instead of failing it.
    :param log_output: what of the command's output the task log gets: ``"all"`` (every line the log
        keeps up with), ``"head_tail"`` (the first and last ``log_output_lines``, and a count of the
        rest) or ``"none"`` (a count). Default: the connection's ``log_output`` extra, else ``"all"``.
    :param log_output_lines: lines at each end with ``"head_tail"``, 1 to 1000. Default: the
        connection's extra, else 100.
    :param log_output_max_bytes: the most bytes of output the task logs, in any mode. Default: the
        connection's extra, else no ceiling.
    :param attach_to: handle of a sandbox an earlier task provisioned with ``keep_sandbox=True``
        (templated), e.g. ``"{{ ti.xcom_pull(task_ids='provision') }}"``. Needs an attachable backend.
    :param sandbox_owner: with ``attach_to``, the owner the sandbox must carry (default: this Dag
        run). With ``keep_sandbox=True``, the owner stamped on the new sandbox (default: this Dag run).
        Airflow's own ``owner`` (the task's owner in the UI, often set in ``default_args``) is separate.
    :param deferrable: start the command detached in the sandbox and free the worker slot while it runs:
        the task defers to :class:`~sandbox_provider.triggers.sandbox.SandboxCommandTrigger`, which relays
        the output to the task log from the triggerer, and resumes on a worker to read the result,
        export and tear down, with the same result and XCom. Needs a backend whose sandboxes a
        triggerer can check on (Docker, Modal, OpenSandbox, Kubernetes; not the local one). Default: the
        ``[sandbox] default_deferrable`` option, False unless set.
    :param poll_interval: with ``deferrable``, seconds between two checks while the command prints
        nothing; default 5.
    :param keep_sandbox: None (default) destroys a sandbox this task provisioned and releases one it
        attached to. True leaves the sandbox standing for later tasks and returns its handle as the
        XCom; on an attachable backend a new sandbox is stamped with ``sandbox_owner`` unless ``spec.owner``
        is set. False destroys the sandbox even when attached: for the task that collects and cleans up.
        A failed task never leaves a sandbox it provisioned behind.
    :returns: (XCom) with ``keep_sandbox=True``, the handle; otherwise
        ``{"exit_code": int, "stdout": str, "stderr": str, "exports": {sandbox path: URL}}`` where the
        outputs are tails of at most 2000 characters.
    :raises ValueError: at construction, for any bad static argument; at run time, for a rendered
        value that is bad (an export URL that is not a URL), before anything is provisioned.
    :raises SandboxCommandError: on a non-zero exit, a timeout, or a sandbox that ended.
    """

    template_fields: Sequence[str] = ("command", "inputs", "exports", "attach_to")
    template_fields_renderers: ClassVar[dict[str, str]] = {
        "command": "bash",
        "inputs": "json",
        "exports": "json",
    }
    ui_color = "#e6f2ea"

    def __init__(
        self,
        *,
        command: str | None,
        backend: SandboxHook | str | None = None,
        spec: SandboxSpec | None = None,
        files: Mapping[str, str | bytes] | None = None,
        inputs: Mapping[str, str | Asset] | None = None,
        exports: Mapping[str, str | Asset] | None = None,
        input_conn_id: str | None = None,
        export_conn_id: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
        skip_on_exit_code: int | Collection[int] | None = None,
        attach_to: str | None = None,
        sandbox_owner: str | None = None,
        keep_sandbox: bool | None = None,
        exports_as_assets: bool | AssetAlias = False,
        deferrable: bool | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        log_output: str | None = None,
        log_output_lines: int | None = None,
        log_output_max_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_command_and_backend(command, backend, attach_to, keep_sandbox)
        self._assets = plan_assets(inputs, exports, exports_as_assets)
        self.add_inlets([a for a in self._assets.inlets if a not in self.inlets])
        self.add_outlets([a for a in self._assets.outlets if a not in self.outlets])
        self.exports_as_assets = exports_as_assets
        self.deferrable = _deferrable(deferrable)
        if self.deferrable and not isinstance(backend, str):
            check_deferrable(backend)  # a connection id is checked when the task runs, before provisioning
        self.poll_interval = float(check_positive(poll_interval, "poll_interval"))
        #: The task-log settings given here (None: from the connection, else the default).
        self.log_settings = dict(
            TASK_SETTINGS.check_args(
                {
                    "log_output": log_output,
                    "log_output_lines": log_output_lines,
                    "log_output_max_bytes": log_output_max_bytes,
                }
            )
        )
        self._options = SessionOptions(
            spec=spec,
            attach_to=attach_to,
            sandbox_owner=sandbox_owner,
            files=files or {},
            inputs=self._assets.inputs,
            exports=self._assets.exports,
            input_conn_id=input_conn_id,
            export_conn_id=export_conn_id,
            max_export_bytes=max_export_bytes,
            keep=keep_sandbox,
            templated=True,
        )
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        check_byte_count(max_export_bytes, "max_export_bytes")
        self._keep_arguments(command, backend, spec, timeout, max_output_bytes, max_export_bytes)
        self.skip_on_exit_code = _check_exit_codes(skip_on_exit_code)
        self._session: SandboxSession | None = None

    def _keep_arguments(
        self,
        command: str | None,
        backend: SandboxHook | str | None,
        spec: SandboxSpec | None,
        timeout: float,
        max_output_bytes: int,
        max_export_bytes: int,
    ) -> None:
        """Keep the checked arguments as the operator's attributes (the templated ones included)."""
        options = self._options
        self.command = command
        self.backend = backend
        self.spec = spec
        self.files = options.files
        self.inputs = options.inputs
        self.exports = options.exports
        self.input_conn_id = options.input_conn_id
        self.export_conn_id = options.export_conn_id
        self.timeout = float(timeout)
        self.max_output_bytes = int(max_output_bytes)
        self.max_export_bytes = int(max_export_bytes)
        self.attach_to = options.attach_to
        self.sandbox_owner = options.sandbox_owner
        self.keep_sandbox = options.keep

    # -- what a subclass may change ----------------------------------------------------------------------

    def _prepare(self, context: Context) -> tuple[str | None, Mapping[str, str | bytes]]:
        """Return the command to run and the files to write in first."""
        return self.command, self.files

    def _collect(self, session: SandboxSession, result: SandboxExecResult | None) -> Any:
        """Read what the task returns out of the sandbox, after a successful command, before teardown."""
        return None

    def _read_back(self) -> str | None:
        """The file ``_collect`` reads first, if any: a backend may fetch it with the command."""
        return None

    def _xcom(self, session: SandboxSession, result: SandboxExecResult | None, collected: Any) -> Any:
        """Shape the task's return value."""
        if self.keep_sandbox is True:
            return self._kept_handle
        assert result is not None
        return {
            "exit_code": result.exit_code,
            "stdout": tail_text(mask_stream(result.stdout, cut=result.stdout_truncated), TAIL_CHARS),
            "stderr": tail_text(mask_stream(result.stderr, cut=result.stderr_truncated), TAIL_CHARS),
            "exports": {record.path: record.url for record in session.export_records},
        }

    # -- running -----------------------------------------------------------------------------------------

    def _new_session(self, context: Context, files: Mapping[str, str | bytes]) -> SandboxSession:
        # The templated fields are rendered by now: check them again, before anything is provisioned.
        options = self._options.rendered(
            attach_to=self.attach_to, inputs=self.inputs, exports=self.exports, files=files
        )
        return SandboxSession(get_sandbox_hook(self.backend), options, context=context)

    def execute(self, context: Context) -> Any:
        command, files = self._prepare(context)
        if command is not None and (not isinstance(command, str) or not command.strip()):
            raise ValueError(
                f"command rendered to {command!r}, which is no command to run; check the template and the values "
                "it reads."
            )
        session = self._new_session(context, files)
        if self.deferrable and command is not None:
            check_deferrable(session.hook)
        self._session = session
        self._live = TaskLog(self.log, log_policy(self.log_settings, session.hook, self.backend))
        self._ran = command
        deferred = False
        result = None
        try:
            session.open()
            if command is None:
                session.ensure()
            elif self.deferrable:
                self._defer(session, command)
            else:
                try:
                    result = session.run(
                        command,
                        timeout=self.timeout,
                        max_output_bytes=self.max_output_bytes,
                        on_output=self._live,
                        read_back=self._read_back(),
                    )
                finally:
                    self._live.flush()
            return self._conclude(context, session, result)
        except TaskDeferred:
            deferred = True
            raise
        finally:
            if deferred:
                session.suspend()
            else:
                self._close(session, succeeded=False)

    def _defer(self, session: SandboxSession, command: str) -> None:
        """Start ``command`` detached and defer to the trigger; raises ``TaskDeferred``."""
        job = session.start_detached(command, timeout=self.timeout, max_output_bytes=self.max_output_bytes)
        hook = session.hook
        handle = session.handle
        assert handle is not None
        attached = session.attach_mode and self.keep_sandbox is not False
        trigger = SandboxCommandTrigger(
            hook_class=f"{type(hook).__module__}:{type(hook).__qualname__}",
            hook_arguments=hook.detached_arguments(),
            handle=handle,
            job=job.id,
            deadline=job.started_at + job.timeout,
            poll_interval=self.poll_interval,
            on_kill_action="stop" if attached else "destroy",
            holder=session.holder if attached else None,
            resume={"timeout": job.timeout, "started_at": job.started_at, **self._deferred_state()},
        )
        self.log.info("Deferring while the command runs; the triggerer relays its output to this log")
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context: Context, event: Mapping[str, Any]) -> Any:
        """Resume once the deferred command ended (or its sandbox or deadline did): collect, export, tear down."""
        deferred = {**event["resume"], "handle": event["handle"], "job": event["job"]}
        self._restore_deferred_state(deferred)
        options = self._options.rendered(attach_to=self.attach_to, inputs=self.inputs, exports=self.exports, files={})
        session = SandboxSession.resume(get_sandbox_hook(self.backend), options, deferred["handle"], context=context)
        self._session = session
        job = DetachedJob(
            id=deferred["job"], timeout=float(deferred["timeout"]), started_at=float(deferred["started_at"])
        )
        try:
            status = event.get("status")
            if status == "gone":
                raise SandboxCommandError(
                    f"The sandbox ended while the command ran; its files are gone.\n{event.get('message')}"
                )
            if status == "timeout":
                session.stop_detached(job)
                raise SandboxCommandError(
                    f"The command ran past its timeout of {job.timeout:g}s in sandbox {deferred['handle']}: "
                    f"{event.get('message')} It was stopped. Raise timeout= or make the command faster."
                )
            return self._conclude(
                context, session, session.collect_detached(job, max_output_bytes=self.max_output_bytes)
            )
        finally:
            self._close(session, succeeded=False)

    def _deferred_state(self) -> dict[str, Any]:
        """What a subclass needs back when the task resumes after deferring (JSON values)."""
        return {}

    def _restore_deferred_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`_deferred_state` gave, in the resumed task."""

    def _conclude(self, context: Context, session: SandboxSession, result: SandboxExecResult | None) -> Any:
        """After the command (if any): check its result, collect, then export and tear down; the XCom."""
        if result is not None:
            self._check_result(session, result, getattr(self, "_ran", None))
        collected = self._collect(session, result)
        self._kept_handle: str | None = session.handle
        handle = self._kept_handle
        self._close(session, succeeded=True)
        for record in session.export_records:
            self.log.info("Exported %s to %s (%d bytes)", record.path, record.url, record.size_bytes)
        emit_asset_events(context, self._assets, session.export_records, backend=session.hook.name, handle=handle)
        if self.keep_sandbox is True:
            self.log.info("Sandbox %s stays up for later tasks; attach with its handle", self._kept_handle)
        return self._xcom(session, result, collected)

    def _close(self, session: SandboxSession, *, succeeded: bool) -> None:
        """Export (after success) and destroy, release or keep; a closed session is left as it is."""
        if session.closed:
            return
        if not succeeded and self.keep_sandbox is True and not session.attach_mode:
            # Nobody receives the handle of a failed task: remove what this task provisioned.
            session.keep = None
        session.close(succeeded=succeeded)

    def _what_ran(self, command: str | None) -> str:
        """What ran, for a failure message: the command, masked and cut to a line's length."""
        if command is None:
            command = self.command if isinstance(self.command, str) else ""
        shown = " ".join(mask_text(command).split())
        return f"The command {shown if len(shown) <= 200 else shown[:200] + ' ...'!r}"

    def _check_result(self, session: SandboxSession, result: SandboxExecResult, command: str | None = None) -> None:
        handle = session.handle or "(ended)"
        what = self._what_ran(command)
        live = getattr(self, "_live", None)  # none when the task resumed after deferring: the triggerer logged
        lines, size = live.left_out if live is not None else (0, 0)
        if lines or size:
            self.log.info(
                "The task log left out %d line(s) of output (%s); the XCom and a failure keep the end of each stream",
                lines,
                format_size(size),
            )
        elif result.stdout_truncated or result.stderr_truncated:
            self.log.info(
                "Output was longer than max_output_bytes=%d: the log above has all of it, the XCom only its end",
                self.max_output_bytes,
            )
        masked_stderr = mask_stream(result.stderr, cut=result.stderr_truncated).rstrip()
        stderr_tail = tail_text(masked_stderr, TAIL_CHARS) or "(no output on standard error)"
        if result.sandbox_terminated:
            because = f" ({result.ended_because})" if result.ended_because else ""
            raise SandboxCommandError(
                f"The sandbox ended while the command ran{because}; its files are gone. {what} did not finish. "
                f"Last standard error:\n{stderr_tail}"
            )
        if result.timed_out:
            limit = result.applied_timeout or self.timeout
            raise SandboxCommandError(
                f"{what} ran past its timeout of {limit:g}s in sandbox {handle} and was killed. Raise "
                f"timeout= or make the command faster. Last standard error:\n{stderr_tail}"
            )
        if result.exit_code in self.skip_on_exit_code:
            raise AirflowSkipException(f"{what} exited with status {result.exit_code}; skipping the task.")
        if result.exit_code != 0:
            raise SandboxCommandError(
                f"{what} exited with status {result.exit_code} in sandbox {handle}. Last standard error:\n{stderr_tail}"
            )

    # -- lineage: called by the OpenLineage provider, when it is installed --------------------------------

    def _report(self) -> SandboxReport:
        """The running (or last) session's report; before one, what the arguments say (no connection is read)."""
        if self._session is not None:
            return self._session.report
        backend = self.backend if isinstance(self.backend, str) else get_sandbox_hook(self.backend)
        spec = None if self.attach_to is not None else self.spec or SandboxSpec()
        return SandboxReport.of(backend, spec, attached=self.attach_to is not None)

    def get_openlineage_facets_on_start(self) -> OperatorLineage:
        """The inputs and exports as OpenLineage datasets, and the ``sandbox`` run facet as far as it is known."""
        from sandbox_provider.engine.openlineage import operator_lineage

        return operator_lineage(inputs=self.inputs, exports=self.exports, report=self._report())

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """As on start, with what was exported (bytes, files) and how the sandbox and command ended."""
        from sandbox_provider.engine.openlineage import operator_lineage

        report = self._report()
        return operator_lineage(inputs=self.inputs, exports=self.exports, report=report, exported=report.exports)

    def on_kill(self) -> None:
        """Destroy the sandbox of the running task, whatever ``keep_sandbox`` says."""
        session = self._session
        if session is None:
            return
        live = getattr(self, "_live", None)
        if live is not None:
            live.flush(timeout=5.0)
        handle = session.handle
        session.keep = False
        try:
            session.close(succeeded=False, reason=STOPPED)
        except Exception:
            self.log.warning("Could not destroy sandbox %s after the task was killed", handle, exc_info=True)
        else:
            if handle:
                self.log.info("Task killed: destroyed sandbox %s", handle)
