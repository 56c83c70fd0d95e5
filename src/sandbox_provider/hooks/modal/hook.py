"""
The Modal backend: sandboxes on Modal's hosted platform, for Dags that outgrow one worker.

Sandboxes are created under a Modal app through the credentials of an Airflow ``modal``
connection (from apache-airflow-providers-modal), or the worker's own Modal configuration. Their
handles are Modal sandbox ids (``sb-...``), which any task holding the same credentials can use,
so this backend is attachable: the owner, holder, expiry, network and working-directory stamps
ride on Modal sandbox tags.

The ``modal`` SDK is imported on first use, never when this module is imported, so Dag files
that build a :class:`ModalSandboxHook` parse on machines without the ``modal`` extra.
"""

from __future__ import annotations

import io
import logging
import posixpath
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from sandbox_provider.hooks.modal import driver
from sandbox_provider.hooks.modal.driver import MAX_BACKOFF  # noqa: F401 - part of this module's API
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import check_export_size, reported_size
from sandbox_provider.sandbox.hook import (
    FILE_OP_TIMEOUT,
    STREAM_CHUNK_BYTES,
    Capabilities,
    OutputSink,
    ProvisionRequest,
    RunOutcome,
    SandboxHook,
)
from sandbox_provider.sandbox.output import StreamDrain, TailBuffer
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
    EXPIRES_AT_TAG,
    WORKDIR_TAG,
    AttachedSandbox,
    SandboxSpec,
    check_byte_count,
    check_positive,
    check_workdir,
)

log = logging.getLogger(__name__)

__all__ = ["SANDBOX_MARKER_TAG", "ModalSandboxBackend", "ModalSandboxHook"]

#: Tag every sandbox of this backend carries, with the value ``"true"``, so
#: ``modal.Sandbox.list(tags={"airflow_sandbox": "true"})`` finds them all.
SANDBOX_MARKER_TAG = "airflow_sandbox"

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_APP_NAME = "airflow-sandbox"
DEFAULT_SANDBOX_TIMEOUT = 3600
#: Modal ends a sandbox after at most a day.
MAX_SANDBOX_TIMEOUT = 24 * 3600
#: A shorter lifetime would not fit one file operation.
MIN_SANDBOX_TIMEOUT = int(FILE_OP_TIMEOUT)


#: Seconds allowed for provisioning, retries of transient API errors included.
CREATE_BUDGET = 180.0
#: Seconds the output readers may run past a command's deadline before we stop waiting for them.
STREAM_GRACE = 30.0

T = TypeVar("T")


@dataclass
class _Tracked:
    """What this hook knows of one sandbox: the SDK object, its expiry (Unix seconds) and workdir."""

    sandbox: Any
    expires_at: float | None
    workdir: str


class ModalSandboxHook(Attachable, SandboxHook):
    """
    Run sandboxes on `Modal <https://modal.com/>`__.

    Nothing is looked up or sent to Modal until the first sandbox is created or used: the
    constructor only checks its arguments, so it is safe in a Dag file.

    :param modal_conn_id: an Airflow connection of type ``modal`` (token id as login, token secret as
        password, optional ``environment`` extra). Default ``"modal_default"``; when that
        connection is not defined the worker's own Modal configuration is used. ``None`` skips the
        connection and uses the worker's configuration (``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or
        ``~/.modal.toml``).
    :param image: a registry tag (default ``"python:3.12-slim"``) or a prepared ``modal.Image``.
    :param app_name: the Modal app sandboxes are created under. Default ``"airflow-sandbox"``.
    :param create_app_if_missing: create that app when it does not exist. Default True.
    :param sandbox_timeout: lifetime of each sandbox in seconds, 120 to 86400; Modal ends the sandbox
        when it runs out, even if the worker died. Default 3600.
    :param idle_timeout: seconds without a running command after which Modal ends the sandbox; None
        (default) turns it off. Not allowed with an owner (a sandbox waiting for another task).
    :param workdir: absolute working directory of commands and relative paths. Default ``/workspace``.
    :param cpu: CPU cores requested (Modal's default is 0.125).
    :param memory: memory requested, in MiB. Modal treats it as a request, not a ceiling.
    :param gpu: a Modal GPU type, e.g. ``"T4"`` or ``"A100:2"``.
    :param region: a Modal region name or a list of them.
    :param cloud: a Modal cloud provider name, e.g. ``"aws"``.
    :param tags: extra Modal tags for every sandbox, strings to strings, e.g. ``{"dag_id": "etl"}``;
        keys starting with ``airflow_`` are reserved.
    :param egress_enforcement: ``"strict"`` (default) refuses ``allow_egress_to``, which Modal can
        only match against the TLS server name; ``"sni"`` accepts that weaker check.
    :raises ValueError: for any argument out of range, when the hook is built.
    """

    conn_name_attr = "modal_conn_id"
    default_conn_name = "modal_default"
    conn_type = "modal"
    hook_name = "Sandbox (Modal)"

    name = "modal"
    display_name = "Modal"
    # Detached commands: the control programs run as commands (Sandbox.exec); what one starts in a
    # session of its own lives on in the sandbox after the exec returns, as a background process of a
    # container does.
    detached_commands = True
    capabilities = Capabilities(
        egress_hosts=True,
        egress_cidrs=True,
        max_command_seconds=MAX_SANDBOX_TIMEOUT,
        network=driver.NETWORK_REACH,
    )
    handle_pattern = re.compile(r"sb-[A-Za-z0-9_-]{1,128}")
    handle_shape = "a Modal sandbox id: those start with 'sb-'"
    handle_example = "sb-a1b2c3d4e5f6"

    def __init__(
        self,
        modal_conn_id: str | None = default_conn_name,
        *,
        image: Any = DEFAULT_IMAGE,
        app_name: str = DEFAULT_APP_NAME,
        create_app_if_missing: bool = True,
        sandbox_timeout: int = DEFAULT_SANDBOX_TIMEOUT,
        idle_timeout: int | None = None,
        workdir: str = DEFAULT_WORKDIR,
        cpu: float | None = None,
        memory: int | None = None,
        gpu: str | None = None,
        region: str | Sequence[str] | None = None,
        cloud: str | None = None,
        tags: Mapping[str, str] | None = None,
        egress_enforcement: str = "strict",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.modal_conn_id = driver.check_conn_id(modal_conn_id)
        self.image = driver.check_image(image)
        self.app_name = driver.check_app_name(app_name)
        self.create_app_if_missing = driver.check_flag(create_app_if_missing, "create_app_if_missing")
        self.sandbox_timeout = driver.whole_seconds(
            sandbox_timeout, "sandbox_timeout", low=MIN_SANDBOX_TIMEOUT, high=MAX_SANDBOX_TIMEOUT
        )
        self.idle_timeout = (
            None
            if idle_timeout is None
            else driver.whole_seconds(idle_timeout, "idle_timeout", low=1, high=self.sandbox_timeout)
        )
        self.workdir = check_workdir(workdir)
        self.cpu = check_positive(cpu, "cpu", allow_none=True)
        self.memory = driver.check_memory(memory)
        self.gpu = driver.check_optional_text(gpu, "gpu")
        self.region = driver.check_region(region)
        self.cloud = driver.check_optional_text(cloud, "cloud")
        self.tags = driver.check_user_tags(tags)
        self.egress_enforcement = driver.check_egress_enforcement(egress_enforcement)
        # Deadlines read these; tests swap them for a scripted clock.
        self._monotonic: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep
        self._modal_hook_instance: Any = None
        self._tracked: dict[str, _Tracked] = {}

    # -- credentials and calls -------------------------------------------------------------------------

    def _credential_source(self) -> str:
        if self.modal_conn_id is None:
            return "the worker's Modal configuration (MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)"
        return f"Airflow connection {self.modal_conn_id!r}"

    def get_conn(self) -> Any:
        """Return the ``ModalHook`` of apache-airflow-providers-modal that holds the credentials."""
        if self._modal_hook_instance is None:
            self._modal_hook_instance = driver.modal_hook_class()(modal_conn_id=self.modal_conn_id)
        return self._modal_hook_instance

    def _client(self) -> Any:
        return self._call("connecting to Modal", lambda: self.get_conn().client)

    def _call(
        self,
        action: str,
        fn: Callable[[], T],
        *,
        handle: str | None = None,
        budget: float = FILE_OP_TIMEOUT,
        retry: bool = True,
        on_error: Callable[[BaseException], T | None] | None = None,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """One SDK call, with transient errors retried for ``budget`` seconds; see :func:`driver.call`."""
        return driver.call(
            action,
            fn,
            handle=handle,
            budget=budget if retry else 0.0,
            on_error=on_error,
            passthrough=passthrough,
            translate=self._translate,
            monotonic=self._monotonic,
            sleep=self._sleep,
        )

    def _translate(self, err: BaseException, action: str, handle: str | None) -> SandboxError:
        """Map an error from the SDK or the Modal provider to this package's errors."""
        error = driver.translate(
            err, action, handle, conn_id=self.modal_conn_id, source=self._credential_source(), has_ended=self._has_ended
        )
        if handle is not None and isinstance(error, driver.Gone):
            self._tracked.pop(handle, None)
        return error

    def _has_ended(self, handle: str) -> bool:
        tracked = self._tracked.get(handle)
        if tracked is None:
            return False
        try:
            return tracked.sandbox.poll() is not None
        except Exception:  # noqa: BLE001 - a sandbox that cannot even be polled is taken as ended
            return True

    # -- provisioning ----------------------------------------------------------------------------------

    def _network_kwargs(self, spec: SandboxSpec) -> dict[str, Any]:
        """Return the network keywords for ``Sandbox.create``, or refuse what Modal cannot enforce."""
        return driver.network_kwargs(spec, self.egress_enforcement)

    def _refusal(self, spec: SandboxSpec) -> str | None:
        try:
            self._network_kwargs(spec)
        except SandboxTerminalError as err:
            return str(err)
        if spec.owner is not None and self.idle_timeout is not None:
            return (
                f"SandboxSpec names an owner, so a later task will attach to this sandbox, but this backend has "
                f"idle_timeout={self.idle_timeout}, and Modal would end the sandbox while it waits between tasks. "
                "Leave idle_timeout unset on the backend that provisions for attaching, and size sandbox_timeout "
                "to cover the wait."
            )
        return None

    def _lifetime_seconds(self) -> float:
        return float(self.sandbox_timeout)

    def _provision(self, request: ProvisionRequest) -> str:
        spec = request.spec
        network = self._network_kwargs(spec)
        modal = driver.import_modal()
        name = request.name
        expires_at = request.expires_at
        tags = {**self.tags, **request.stamps, SANDBOX_MARKER_TAG: "true"}
        client = self._client()
        hook = self.get_conn()
        app = self._call(
            f"looking up app {self.app_name!r}",
            lambda: hook.lookup_app(self.app_name, create_if_missing=self.create_app_if_missing),
        )
        image = modal.Image.from_registry(self.image) if isinstance(self.image, str) else self.image
        kwargs: dict[str, Any] = {
            "app": app,
            "name": name,
            "tags": tags,
            "image": image,
            "timeout": self.sandbox_timeout,
            "workdir": self.workdir,
            "client": client,
            **network,
            **driver.present(
                idle_timeout=self.idle_timeout,
                env=dict(spec.env) if spec.env else None,
                cpu=self.cpu,
                memory=self.memory,
                gpu=self.gpu,
                region=list(self.region) if isinstance(self.region, tuple) else self.region,
                cloud=self.cloud,
            ),
        }

        def already_made(err: BaseException) -> Any:
            # The name is new to this call, so finding it taken means an earlier attempt reached Modal and
            # its reply was lost (our retry, or the SDK's own retry inside one attempt): that sandbox is ours.
            if isinstance(err, modal.exception.AlreadyExistsError):
                return modal.Sandbox.from_name(
                    self.app_name, name, environment_name=hook.environment_name, client=client
                )
            return None

        sandbox = self._call(
            "creating a sandbox",
            lambda: modal.Sandbox.create(**kwargs),
            budget=CREATE_BUDGET,
            on_error=already_made,
        )
        handle = sandbox.object_id
        self._tracked[handle] = _Tracked(sandbox=sandbox, expires_at=expires_at, workdir=self.workdir)
        log.info(
            "Created Modal sandbox %s (%s) in app %s; it lives at most %ss",
            handle,
            name,
            self.app_name,
            self.sandbox_timeout,
        )
        return handle

    # -- finding sandboxes -----------------------------------------------------------------------------

    def _lookup(self, handle: str) -> _Tracked:
        """Return what is known of ``handle``, fetching it (and its stamps) from Modal the first time."""
        self.check_handle(handle)
        tracked = self._tracked.get(handle)
        if tracked is not None:
            return tracked
        self._client()
        hook = self.get_conn()
        sandbox = self._call("finding the sandbox", lambda: hook.get_sandbox(handle), handle=handle)
        tags = self._call("reading its tags", lambda: dict(sandbox.get_tags()), handle=handle)
        try:
            expires_at: float | None = float(tags[EXPIRES_AT_TAG])
        except (KeyError, ValueError):
            expires_at = None
        workdir = tags.get(WORKDIR_TAG) or self.workdir
        tracked = _Tracked(sandbox=sandbox, expires_at=expires_at, workdir=workdir)
        self._tracked[handle] = tracked
        return tracked

    def _remaining(self, tracked: _Tracked) -> float | None:
        if tracked.expires_at is None:
            return None
        return tracked.expires_at - time.time()

    def _remaining_lifetime(self, handle: str) -> float | None:
        return self._remaining(self._lookup(handle))

    def list_sandboxes(self, tags: Mapping[str, str] | None = None) -> list[str]:
        """
        Return the ids of this backend's sandboxes in ``app_name`` that carry every tag in ``tags``.

        With ``ModalSandboxHook(tags={"dag_id": "etl"})`` provisioning, ``list_sandboxes({"dag_id": "etl"})``
        finds what that Dag left standing.
        """
        wanted = {**driver.check_user_tags(tags), SANDBOX_MARKER_TAG: "true"}
        modal = driver.import_modal()
        client = self._client()
        hook = self.get_conn()
        app = self._call(f"looking up app {self.app_name!r}", lambda: hook.lookup_app(self.app_name))
        return self._call(
            "listing sandboxes",
            lambda: [sb.object_id for sb in modal.Sandbox.list(app_id=app.app_id, tags=wanted, client=client)],
        )

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """
        This provider's running sandboxes in ``app_name`` whose tags hold every item of ``stamps``
        (Modal filters by them): ``{handle: its tags}``.
        """
        wanted = {**{str(k): str(v) for k, v in stamps.items()}, SANDBOX_MARKER_TAG: "true"}
        modal = driver.import_modal()
        client = self._client()
        hook = self.get_conn()
        app = self._call(f"looking up app {self.app_name!r}", lambda: hook.lookup_app(self.app_name))
        found = self._call(
            "listing sandboxes", lambda: list(modal.Sandbox.list(app_id=app.app_id, tags=wanted, client=client))
        )

        def tags_of(sandbox: Any) -> dict[str, str]:
            return self._call("reading its tags", lambda: dict(sandbox.get_tags()), handle=sandbox.object_id)

        return {sandbox.object_id: tags_of(sandbox) for sandbox in found}

    # -- commands --------------------------------------------------------------------------------------

    def _deadline_for(self, handle: str, tracked: _Tracked, timeout: float) -> tuple[int, bool]:
        """Return the whole seconds to give a command and whether they were cut to the remaining lifetime."""
        try:
            return driver.deadline_seconds(timeout, self._remaining(tracked), handle)
        except SandboxTerminalError:
            self._tracked.pop(handle, None)
            raise

    def _exec(self, tracked: _Tracked, handle: str, script: str, seconds: int, action: str) -> Any:
        return self._call(
            action,
            lambda: tracked.sandbox.exec("sh", "-c", script, timeout=seconds, workdir=tracked.workdir, text=False),
            handle=handle,
            retry=False,  # a retried exec could run the command twice
        )

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        # Modal kills the command at the deadline, in whole seconds; the sandbox and its files
        # survive a timeout. ``sandbox_terminated`` when the sandbox died during the command.
        output.whole_lines = True
        tracked = self._lookup(handle)
        seconds, clamped = self._deadline_for(handle, tracked, timeout)
        started = self._monotonic()
        process = self._exec(tracked, handle, command, seconds, "starting a command")
        stdout, stderr = StreamDrain(process.stdout, output.stdout), StreamDrain(process.stderr, output.stderr)
        stdout.start()
        stderr.start()
        died: BaseException | None = None
        exit_code = -1
        try:
            exit_code = int(process.wait())
        except Exception as err:  # noqa: BLE001 - sorted below
            died = err
        for reader in (stdout, stderr):
            reader.join(seconds + STREAM_GRACE)
        stuck = stdout.is_alive() or stderr.is_alive()
        timed_out, terminated = driver.classify_run(
            died or stdout.error or stderr.error,
            exit_code,
            elapsed=self._monotonic() - started,
            seconds=seconds,
            ended=lambda: self._has_ended(handle),
            translate=lambda err: self._translate(err, "running a command", handle),
        )
        if not terminated and (timed_out or exit_code >= 128):
            terminated = (timed_out and clamped) or self._has_ended(handle)
        if terminated:
            self._tracked.pop(handle, None)
            log.warning("Modal sandbox %s ended during a command", handle)
        if stuck:
            output.out.truncated = output.err.truncated = True
        return RunOutcome(
            exit_code=exit_code, timed_out=timed_out, sandbox_terminated=terminated, applied_timeout=float(seconds)
        )

    def detached_arguments(self) -> dict[str, Any]:
        """The credentials' connection, the app and the workdir: what finds a sandbox by its id again."""
        return {"modal_conn_id": self.modal_conn_id, "app_name": self.app_name, "workdir": self.workdir}

    # -- files -----------------------------------------------------------------------------------------

    def _abs(self, tracked: _Tracked, path: str) -> str:
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"{path!r} is not a path.")
        return posixpath.normpath(posixpath.join(tracked.workdir, path))

    def _stream_file(self, handle: str, path: str, sink: IO[bytes], *, max_bytes: int, verb: str) -> tuple[int, int]:
        """
        Copy the regular file at ``path`` into ``sink`` through one command; return (size, bytes copied).

        The guest sends at most ``max_bytes + 1`` bytes (``head -c``), so no more than that crosses the wire.
        """
        check_byte_count(max_bytes, "max_bytes")
        tracked = self._lookup(handle)
        target = self._abs(tracked, path)
        script = guest.shell_command("file.sh", target, int(max_bytes), "head")
        budget = FILE_OP_TIMEOUT + max_bytes / (4 * 1024 * 1024)
        seconds, _ = self._deadline_for(handle, tracked, budget)
        process = self._exec(tracked, handle, script, seconds, f"{verb} {path!r}")
        tail = TailBuffer(64 * 1024)
        errors = StreamDrain(process.stderr, tail.write)
        errors.start()
        copied = 0
        exc = sys.modules["modal"].exception
        try:
            for chunk in process.stdout:
                copied += len(chunk)
                if copied > max_bytes:
                    raise SandboxFileTooLargeError(path, copied, max_bytes)
                sink.write(chunk)
            code = int(process.wait())
        except SandboxError:
            raise
        except exc.Error as err:
            raise self._translate(err, f"{verb} {path!r}", handle) from err
        errors.join(STREAM_GRACE)
        stderr = tail.text(whole_lines=True)
        error = driver.file_copy_error(
            code,
            stderr,
            handle=handle,
            path=path,
            verb=verb,
            seconds=seconds,
            max_bytes=int(max_bytes),
            ended=lambda: self._has_ended(handle),
        )
        if isinstance(error, SandboxTerminalError):
            self._tracked.pop(handle, None)
        if error is not None:
            raise error
        return int(reported_size(stderr) or 0), copied

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path``; relative paths resolve in the workdir.

        At most ``max_bytes + 1`` bytes leave the sandbox, whatever the file's size (Modal's own
        ``read_bytes`` has no limit, so the copy goes through ``head -c``).

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, a directory or not a regular file.
        """
        buffer = io.BytesIO()
        self._stream_file(handle, path, buffer, max_bytes=max_bytes, verb="reading")
        return buffer.getvalue()

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Stream the regular file at ``path`` into ``stream``; return the bytes copied.

        One command sends the raw bytes; memory holds one chunk at a time.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed during the copy.
        """
        size, copied = self._stream_file(handle, path, stream, max_bytes=max_bytes, verb="exporting")
        check_export_size(path, size, copied)
        return copied

    def write_file(self, handle: str, path: str, data: bytes) -> None:
        """
        Write ``data`` to ``path`` with Modal's filesystem API, creating parent directories.

        :raises SandboxError: if the path cannot be written (a directory there, say).
        """
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SandboxError(f"write_file takes bytes or text, got {type(data).__name__}.")
        tracked = self._lookup(handle)
        target = self._abs(tracked, path)
        self._call(
            f"writing {path!r}",
            lambda: tracked.sandbox.filesystem.write_bytes(bytes(data), target),
            handle=handle,
        )

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into ``path``; return the bytes written.

        The stream is spooled to a temporary file on the worker in 1 MiB pieces and uploaded with
        Modal's ``copy_from_local``, so memory stays bounded however large the input is.
        """
        tracked = self._lookup(handle)
        target = self._abs(tracked, path)
        with tempfile.NamedTemporaryFile(prefix="airflow-sandbox-upload-") as spool:
            total = driver.spool(source, spool, STREAM_CHUNK_BYTES)
            self._call(
                f"writing {path!r}",
                lambda: tracked.sandbox.filesystem.copy_from_local(spool.name, target),
                handle=handle,
            )
        return total

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """
        List the directory at ``path`` with Modal's filesystem API as sorted ``(name, is_directory)`` pairs.

        A symbolic link is listed as not a directory.

        :raises SandboxError: if ``path`` is missing or not a directory.
        """
        tracked = self._lookup(handle)
        target = self._abs(tracked, path)
        entries = self._call(f"listing {path!r}", lambda: tracked.sandbox.filesystem.list_files(target), handle=handle)
        return driver.listing(entries)

    # -- tags and teardown -----------------------------------------------------------------------------

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """
        Return the sandbox's Modal tags.

        :raises SandboxTerminalError: if the sandbox is gone or has ended.
        """
        tracked = self._lookup(handle)
        code = self._call("checking the sandbox", lambda: tracked.sandbox.poll(), handle=handle)
        if code is not None:
            self._tracked.pop(handle, None)
            raise SandboxTerminalError(
                f"Sandbox {handle!r} has ended (exit status {code}); its files are gone. Provision a new one."
            )
        return self._call("reading its tags", lambda: dict(tracked.sandbox.get_tags()), handle=handle)

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's Modal tags with ``tags``."""
        tracked = self._lookup(handle)
        self._call("writing its tags", lambda: tracked.sandbox.set_tags(dict(tags)), handle=handle)

    def attach(self, handle: str, *, owner: str, holder: str) -> AttachedSandbox:
        """Claim a sandbox another task provisioned; see :meth:`SandboxHook.attach`."""
        self.check_handle(handle)
        try:
            attached = super().attach(handle, owner=owner, holder=holder)
        except SandboxError:
            self._tracked.pop(handle, None)
            raise
        tracked = self._tracked.get(handle)
        if tracked is not None:
            if attached.workdir:
                tracked.workdir = attached.workdir
            if attached.remaining_lifetime is not None:
                tracked.expires_at = time.time() + attached.remaining_lifetime
        return attached

    def release(self, handle: str, *, holder: str) -> None:
        """Clear our holder stamp and forget the sandbox; it keeps running."""
        try:
            super().release(handle, holder=holder)
        finally:
            self._tracked.pop(handle, None)

    def _destroy(self, handle: str) -> None:
        # Ask Modal to end the sandbox without waiting for it to stop. A sandbox that is already gone is
        # fine; any other failure is logged with the handle and not raised: Modal ends the sandbox at its
        # sandbox_timeout anyway.
        tracked = self._tracked.pop(handle, None)
        exc = driver.import_modal().exception
        gone = (exc.NotFoundError, exc.SandboxTerminatedError)
        try:
            if tracked is None:
                self._client()
                hook = self.get_conn()
                sandbox = self._call(
                    "finding the sandbox", lambda: hook.get_sandbox(handle), handle=handle, passthrough=gone
                )
            else:
                sandbox = tracked.sandbox
            self._call("ending the sandbox", lambda: sandbox.terminate(), handle=handle, passthrough=gone)
        except gone:
            log.info("Modal sandbox %s was already gone", handle)
        except SandboxError as err:
            log.warning("Could not end Modal sandbox %s; Modal ends it at its lifetime: %s", handle, err)
        else:
            log.info("Asked Modal to end sandbox %s", handle)


#: The name the public guide uses for this backend.
ModalSandboxBackend = ModalSandboxHook
