"""
The Islo backend: sandboxes as microVMs on Islo's hosted platform, through the ``islo`` SDK.

- **Network**: Islo turns a sandbox's outbound access on or off, nothing finer.
  ``block_network=True`` maps to ``internet_enabled=False`` and ``block_network=False`` to ``True``;
  hostname and address allowlists are refused, since honouring only the block would drop the hosts
  asked for. ``PATH`` in ``spec.env`` is refused too: Islo sets ``PATH`` itself.
- **Not attachable**: Islo keeps no metadata with a sandbox to carry the owner and holder stamps,
  so an owner is refused.
- **Lifetime**: ``sandbox_timeout`` seconds, sent as Islo's ``delete_after``, which counts from
  creation, not from last use (so a long job needs a long one); ``pause_after_idle`` pauses an idle sandbox, and with
  ``auto_resume="on_activity"`` the next command resumes it.
- **Commands**: Islo runs a command asynchronously and keeps at most 1 MiB of each stream, and does
  not stop a command at its deadline. So every command runs under the guest program
  ``run_with_deadline.sh`` (deadline enforced in the sandbox, tails replayed, what was cut reported
  as truncation), is started with one exec request that is never sent again once it may have
  reached Islo (a lost answer or a 5xx; the SDK's own retries are off), and is polled with backoff.
  If no result arrives by the deadline plus a grace, the sandbox is deleted and the result says so.
- **Files**: reads, exports and writes stream through Islo's file API; listings go through the shell.

The ``islo`` SDK is imported on first use, so Dag files that build the hook parse without it.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from sandbox_provider.hooks.forms.islo import FORM
from sandbox_provider.hooks.hosted.deadline_run import parse_status, replay, wrapper_argv
from sandbox_provider.hooks.hosted.service import (
    abandon_runaway,
    call,
    check_conn_id,
    check_service_url,
    discard,
    load_connection,
)
from sandbox_provider.hooks.islo import driver
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import (
    CountingReader,
    ShellFiles,
    check_export_size,
    checked_size,
    write_through_temp,
)
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import DEFAULT_WORKDIR, SandboxSpec, check_byte_count, check_path, check_workdir

log = logging.getLogger(__name__)

__all__ = ["IsloSandboxBackend", "IsloSandboxHook"]

#: Islo keeps at most 1 MiB of each stream of a command; the replayed tails stay under it.
STREAM_KEEP = 1024 * 1024 - 4096
#: Seconds from SIGTERM to SIGKILL at a command's deadline, inside the sandbox.
KILL_AFTER = 5
#: Seconds past a command's deadline (and its kill) to wait for Islo's result before deleting the sandbox.
RESULT_GRACE = 30.0
#: Seconds a new sandbox may take to be ready once Islo accepted it. The create request itself is
#: retried for at most the connection's request_timeout.
CREATE_BUDGET = 180.0
#: Seconds a delete may take, retries included.
DELETE_BUDGET = 60.0
#: Times an exec request is sent when Islo shows it had no effect (no connection, or 429).
EXEC_ATTEMPTS = 4
#: Polling a command's result: first and longest pause, and growth, in seconds.
POLL_FIRST, POLL_LONGEST, POLL_GROWTH = 0.2, 2.0, 1.5
#: Islo's exec states that mean "not finished yet".
RUNNING = frozenset({"pending", "queued", "starting", "running"})
#: Islo's sandbox states that pass on their own on the way to ``running``.
STARTING = frozenset({"starting", "pending", "creating", "provisioning", "resuming"})
DOWNLOAD_CHUNK = 64 * 1024


class IsloSandboxHook(ShellFiles, SandboxHook):
    """
    Provision sandboxes on Islo.

    Connection (type ``sandbox_islo``, default id ``sandbox_islo_default``; when that default is not
    defined, the SDK's environment variables ``ISLO_API_KEY``, ``ISLO_BASE_URL`` and
    ``ISLO_COMPUTE_URL`` are used): ``password`` the API key, ``host`` the compute API URL, extras
    for the settings below.

    :param islo_conn_id: the Airflow connection to read.
    :param workdir: working directory of commands and relative paths; default ``/workspace``.
    :raises ValueError: for a setting of the wrong type or out of bounds.
    """

    form = FORM
    name = "islo"
    display_name = "Islo"
    capabilities = Capabilities(
        egress_hosts=False,
        egress_cidrs=False,
        network=NetworkReach(
            blocked="has no outbound network access: Islo has turned the sandbox's internet access off",
            open="has outbound internet access, turned on by Islo for the whole sandbox: no host or port is narrowed",
        ),
        advice=(
            "Islo turns a sandbox's outbound access on or off and cannot narrow it to hosts or address ranges, so "
            "keeping only the block would drop what you asked for: drop the allowlists and keep "
            "SandboxSpec(block_network=True) for no network, pass block_network=False for open egress, or use a "
            "backend that enforces allowlists (Modal). Islo keeps no metadata with a sandbox to record an owner: "
            "drop owner and use the sandbox in the task that creates it, or use an attachable backend (local, "
            "Docker, Modal)."
        ),
    )

    def __init__(
        self,
        islo_conn_id: str = FORM.default_conn_name,
        *,
        image: str | None = None,
        vcpus: int | None = None,
        memory_mb: int | None = None,
        disk_gb: int | None = None,
        sandbox_timeout: int | None = None,
        pause_after_idle: int | None = None,
        auto_resume: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = None,
        workdir: str = DEFAULT_WORKDIR,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.islo_conn_id = check_conn_id(islo_conn_id, "islo_conn_id")
        self._args = self.settings.arguments(locals())
        if base_url is not None:
            check_service_url(base_url, "base_url")
        self.workdir = check_workdir(workdir)
        self._lock = threading.Lock()
        self._settings_obj: dict[str, Any] | None = None
        #: The API key and compute URL the connection gives (None each: the SDK's environment variables).
        self._service: tuple[str | None, str | None] = (None, None)
        self._client_obj: Any = None
        # Deadlines read these; tests swap them for a scripted clock.
        self._monotonic: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    # -- connection ------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is None:
            found = load_connection(self, self.islo_conn_id, fallback="ISLO_API_KEY and ISLO_COMPUTE_URL")
            settings = found.resolve(self.settings, self._args)
            if settings["base_url"]:
                settings["base_url"] = check_service_url(settings["base_url"], "base_url")
            where = f"The host of connection {found.conn_id!r}"
            self._service = (found.password, check_service_url(found.host, where) if found.host else None)
            self._settings_obj = settings
        return self._settings_obj

    def _new_http_client(self, timeout: float) -> Any:
        """The ``httpx.Client`` the SDK sends through; tests swap in a mock transport here."""
        import httpx

        return httpx.Client(timeout=timeout, follow_redirects=False)

    def _client(self) -> Any:
        with self._lock:
            if self._client_obj is None:
                islo = driver.import_islo()
                settings = self._resolved()
                api_key, compute_url = self._service
                if not (api_key or os.environ.get("ISLO_API_KEY")):
                    raise SandboxTerminalError(
                        f"No Islo API key: set the password of connection {self.islo_conn_id!r}, or ISLO_API_KEY "
                        "on the worker."
                    )
                timeout = self.patience(float(settings["request_timeout"]))
                self._client_obj = islo.Islo(
                    api_key=api_key,
                    base_url=settings["base_url"],
                    compute_url=compute_url,
                    timeout=timeout,
                    httpx_client=self._new_http_client(timeout),
                )
            return self._client_obj

    def _call(self, fn: Callable[[], Any], *, budget: float, retry=driver.transient, attempts=None) -> Any:
        return call(
            fn,
            until=self._monotonic() + self.patience(budget),
            retry=retry,
            retry_after=driver.retry_after,
            clock=self._monotonic,
            sleep=self._sleep,
            attempts=attempts,
        )

    def _options(self, **extra: Any) -> dict[str, Any]:
        return {**driver.NO_RETRIES, **extra}

    # -- the contract ----------------------------------------------------------------------------------

    def _refusal(self, spec: SandboxSpec) -> str | None:
        if spec.env and "PATH" in spec.env:
            return (
                "SandboxSpec.env sets PATH, but Islo overwrites it with its own in every command, so the value would "
                "be lost. Drop PATH from env and call programs by full path, or set PATH at the start of the "
                "command (PATH=/opt/tool/bin:$PATH; ...)."
            )
        return None

    def _provision(self, request: ProvisionRequest) -> str:
        islo = driver.import_islo()
        from islo.types import AutoResumePolicy, LifecyclePolicy

        settings = self._resolved()
        spec = request.spec
        lifecycle = LifecyclePolicy(
            delete_after=math.ceil(request.lifetime),
            pause_after_idle=settings["pause_after_idle"],
            auto_resume=AutoResumePolicy(settings["auto_resume"]),
        )
        fields = {
            "name": request.name,
            "image": settings["image"],
            "vcpus": settings["vcpus"],
            "memory_mb": settings["memory_mb"],
            "disk_gb": settings["disk_gb"],
            "env": dict(spec.env) if spec.env else None,
            "workdir": request.workdir,
            "internet_enabled": not spec.block_network,
            "lifecycle": lifecycle,
        }
        fields = {k: v for k, v in fields.items() if v is not None}
        client = self._client()
        sandboxes = client.sandboxes
        resent: list[bool] = []
        reached: list[bool] = []  # an attempt that may have made a sandbox (anything driver.unsent does not rule out)

        def create() -> Any:
            try:
                return sandboxes.create_sandbox(**fields, request_options=self._options())
            except BaseException as err:
                # Our name is new; a conflict after a resend means the first attempt created it.
                if resent and isinstance(err, islo.core.api_error.ApiError) and driver.status_of(err) == 409:
                    return sandboxes.get_sandbox(request.name, request_options=self._options())
                if not driver.unsent(err):
                    reached.append(True)
                raise
            finally:
                resent.append(True)

        created = None
        try:
            created = self._call(create, budget=float(self._resolved()["request_timeout"]))
            self._wait_ready(request.name, created, deadline=self._monotonic() + self.patience(CREATE_BUDGET))
        except BaseException as err:
            # Delete what may exist under the name: never a sandbox Islo refused to make, nor another's, and
            # nothing when no request got through.
            if created is not None or not isinstance(err, Exception) or (reached and driver.transient(err)):
                discard(self._destroy, request.name, log)
            if isinstance(err, SandboxError) or not isinstance(err, Exception):
                raise
            raise driver.translate(err, "creating the sandbox") from err
        return request.name

    def _wait_ready(self, handle: str, sandbox: Any, *, deadline: float) -> None:
        pause = POLL_FIRST
        while True:
            status = str(sandbox.status or "unknown").lower()
            if status == "running" and not sandbox.deleted_at:
                return
            if status not in STARTING or sandbox.deleted_at:
                raise SandboxTerminalError(
                    f"Islo reports the new sandbox {handle} as {status!r}, not running; it was deleted. Try again, "
                    "or check the image and the account's limits."
                )
            if self._monotonic() + pause >= deadline:
                raise SandboxTerminalError(
                    f"Islo's sandbox {handle} was still {status!r} after {CREATE_BUDGET:g} s; it was deleted."
                )
            self._sleep(pause)
            pause = min(pause * POLL_GROWTH, POLL_LONGEST)
            sandbox = self._call(
                lambda: self._client().sandboxes.get_sandbox(handle, request_options=self._options()),
                budget=max(0.0, deadline - self._monotonic()),
            )

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        keep = min(output.out.limit, STREAM_KEEP) or 1
        argv = wrapper_argv(command, deadline=timeout, kill_after=KILL_AFTER, keep_bytes=keep, login=False)
        sandboxes = self._client().sandboxes
        try:
            started = self._call(
                lambda: sandboxes.exec_in_sandbox(
                    handle,
                    command=argv,
                    workdir=self.workdir,
                    timeout_secs=math.ceil(timeout),
                    request_options=self._options(),
                ),
                budget=timeout,
                retry=driver.unsent,
                attempts=EXEC_ATTEMPTS,
            )
        except Exception as err:
            raise self._exec_error(err, handle) from err
        # The deadline counts from the moment Islo took the command, so a slow start costs it nothing.
        result = self._poll(handle, started.exec_id, until=self._monotonic() + timeout + KILL_AFTER + RESULT_GRACE)
        if result is None or str(result.status).lower() == "timeout":
            return abandon_runaway(
                self._destroy,
                handle,
                output,
                timeout,
                ends="Islo deletes it at the end of its lifetime (sandbox_timeout)",
            )
        run = parse_status(result.stdout or "", result.stderr or "")
        if run is None:
            output.stdout(result.stdout or "")
            output.stderr(result.stderr or "")
            if result.truncated:
                output.out.truncated = output.err.truncated = True
            if result.exit_code is None:
                output.stderr(f"\nIslo reported the command as {result.status!r} without an exit status.\n")
            return RunOutcome(exit_code=-1 if result.exit_code is None else int(result.exit_code))
        replay(run, output, keep)
        return RunOutcome(exit_code=run.exit_code, timed_out=run.timed_out)

    def _exec_error(self, err: BaseException, handle: str) -> SandboxError:
        if driver.status_of(err) == 409:
            try:
                status = self._client().sandboxes.get_sandbox(handle, request_options=self._options()).status
            except Exception:  # the first failure is the one to report
                status = None
            if status == "paused":
                return SandboxTerminalError(
                    f"Islo paused sandbox {handle} after pause_after_idle seconds without activity, and auto_resume "
                    "is 'never', so it cannot run commands. Use auto_resume='on_activity' or a longer pause_after_idle."
                )
        return driver.translate(err, "starting a command", handle, maybe_ran=not driver.unsent(err))

    def _poll(self, handle: str, exec_id: str, *, until: float) -> Any:
        """
        The finished exec result, or None if Islo still said "running" at ``until``. Failures to ask
        are retried until then; if the last one failed too, the outcome is unknown, which is terminal.
        """
        sandboxes = self._client().sandboxes
        pause = POLL_FIRST
        while True:
            failure: Exception | None = None
            try:
                result = sandboxes.get_exec_result(handle, exec_id, request_options=self._options())
            except Exception as err:
                if not driver.transient(err):
                    raise driver.translate(err, "reading a command's result", handle) from err
                failure, result = err, None
            if result is not None and str(result.status).lower() not in RUNNING:
                return result
            if self._monotonic() + pause >= until:
                if failure is not None:
                    raise SandboxTerminalError(
                        f"Islo did not answer for the result of a command in sandbox {handle} until its deadline "
                        f"({driver.error_message(failure)}); it may still be running."
                    ) from failure
                return None
            self._sleep(pause)
            pause = min(pause * POLL_GROWTH, POLL_LONGEST)

    leftovers_bound = (
        "Islo deletes each sandbox at the end of its lifetime (sandbox_timeout, sent as delete_after), "
        "so what a killed worker leaves ends then."
    )

    def _destroy(self, handle: str) -> None:
        islo = driver.import_islo()
        sandboxes = self._client().sandboxes

        def delete() -> None:
            try:
                sandboxes.delete_sandbox(handle, request_options=self._options())
            except islo.core.api_error.ApiError as err:
                if not driver.is_not_found(err):
                    raise

        try:
            self._call(delete, budget=DELETE_BUDGET)
        except Exception as err:
            raise driver.translate(err, "deleting the sandbox", handle) from err

    # -- files -----------------------------------------------------------------------------------------

    def _guest_path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, check_path(path)))

    def _checked_size(self, handle: str, path: str, max_bytes: int | None, verb: str) -> int:
        """The size of the regular file at ``path``, checked in the sandbox (missing, directory, too large)."""
        limit = "-" if max_bytes is None else int(max_bytes)
        result = self._shell(handle, guest.shell_command("file.sh", path, limit, "check"), max_output_bytes=4096)
        return checked_size(result, path, int(max_bytes or 0), verb)

    def _download(self, handle: str, path: str, sink: Callable[[bytes], object], max_bytes: int) -> int:
        """Stream the file into ``sink``; stop past ``max_bytes`` and return the bytes seen (``max_bytes + 1`` then)."""
        sandboxes = self._client().sandboxes
        seen = 0
        chunk = max(1, min(DOWNLOAD_CHUNK, int(max_bytes) + 1))
        try:
            for piece in sandboxes.download_file(
                handle, path=self._guest_path(path), request_options=self._options(chunk_size=chunk)
            ):
                if seen + len(piece) > max_bytes:
                    return max_bytes + 1
                sink(piece)
                seen += len(piece)
        except SandboxError:
            raise
        except Exception as err:
            if driver.status_of(err) in (400, 404):
                self._checked_size(handle, path, None, "reading")  # says what is wrong with the path
            raise driver.translate(err, f"reading {path!r}", handle) from err
        return seen

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`; streamed through Islo's file API, stopped past ``max_bytes``."""
        handle = self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        parts: list[bytes] = []
        seen = self._download(handle, path, parts.append, int(max_bytes))
        if seen > max_bytes:
            size = self._checked_size(handle, path, None, "reading")
            raise SandboxFileTooLargeError(path, size, int(max_bytes))
        return b"".join(parts)

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`; streamed through Islo's file API in 64 KiB pieces."""
        handle = self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        size = self._checked_size(handle, path, int(max_bytes), "exporting")
        copied = self._download(handle, path, stream.write, int(max_bytes))
        if copied > max_bytes:
            raise SandboxFileTooLargeError(path, copied, int(max_bytes))
        check_export_size(path, size, copied)
        return copied

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        See :meth:`SandboxHook.import_file`: streamed through Islo's upload to a temporary sibling, then
        renamed over ``path`` in the sandbox.
        """
        handle = self.check_handle(handle)
        check_path(path)
        counted = CountingReader(source)

        def upload(temp: str) -> int:
            try:
                self._client().sandboxes.upload_file(
                    handle,
                    path=self._guest_path(temp),
                    file=("upload", counted, "application/octet-stream"),
                    request_options=self._options(),
                )
            except Exception as err:
                raise driver.translate(err, f"writing {path!r}", handle) from err
            return counted.total

        return write_through_temp(
            start=lambda: self._temp_sibling(handle, path, path),
            fill=upload,
            commit=lambda temp: self._write_step(handle, path, "commit", temp, path),
            abort=lambda temp: self._abort_temps(handle, temp),
        )


#: The hook under the name the public guide uses.
IsloSandboxBackend = IsloSandboxHook
