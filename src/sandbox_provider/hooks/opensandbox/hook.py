"""
Sandboxes on an `OpenSandbox <https://github.com/opensandbox-group/OpenSandbox>`__ server, through the
``opensandbox`` SDK.

How the pieces map onto the server:

- **A sandbox** is one server sandbox (on its Docker runtime, a container ``sandbox-<id>``); the handle is
  the server's sandbox id. Its lifetime (``sandbox_timeout``, at least the server's 60 s) is the server's
  to enforce: it removes the sandbox at expiry even when the worker died, across server restarts too.
- **Stamps** (owner, holder, expiry, network, workdir, the task that made it) ride on the sandbox's
  metadata, which the server can patch after create, so the backend is attachable. Metadata follows
  Kubernetes label rules, so each stamp is stored base32-encoded in 63-character pieces. It is
  attribution, not a lock: anyone with the server's API key can rewrite it.
- **Network, fail-closed**: ``block_network=False`` sends no policy (no egress sidecar). Anything else
  sends a deny-by-default policy with one allow rule per host or address range, then reads back what the
  sandbox's egress sidecar enforces (``GET /policy``). Only the ``dns+nft`` mode drops traffic the policy
  does not allow (in ``dns`` mode, connections to IP addresses pass); any other answer destroys the
  sandbox and says what the server's operator must change.
- **The daemon's token**: each sandbox's execd gets an access token of its own in ``EXECD_ACCESS_TOKEN``
  (its environment at create; kept in the metadata for other workers), sent back on every request in
  execd's ``X-EXECD-ACCESS-TOKEN`` header through the SDK's connection headers.
- **Commands** run in the in-sandbox daemon (execd) through ``sh -c``, with execd's own timeout (sent in
  milliseconds), which kills the command's process group and keeps the sandbox. execd reports a timeout
  and a death by signal alike (``-1``): one at or past the deadline by both the worker's clock and
  execd's event stamps is the timeout (execd waits about a second after each command, so the worker's
  clock alone runs late), an earlier one a signal, reported as ``128 + n``. Output streams one line per
  event without what ended the line (an empty line comes as ``"\n"``); each is passed on live ended
  by a newline. The result then takes the exact bytes from the files execd spooled the output to
  (``/tmp/<execution id>.stdout`` and ``.stderr``), which are removed; where there are none, or one
  is not a regular file of root's (the daemon's), the streamed lines stand. There is no stdin.
- **Files** are native: a size check then a ranged download (never more than ``max_bytes`` + 1 bytes),
  streamed multipart uploads, directory listings.
"""

from __future__ import annotations

import io
import ipaddress
import logging
import math
import posixpath
import re
import shlex
import tempfile
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import IO, Any

from sandbox_provider.hooks.egress.rules import uncarved_guard
from sandbox_provider.hooks.forms.opensandbox import FORM
from sandbox_provider.hooks.opensandbox import driver
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import check_export_size, file_status_error
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook
from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG, check_byte_count, check_path

log = logging.getLogger(__name__)

__all__ = ["OpenSandboxBackend", "OpenSandboxHook"]

#: Seconds a command's stream may run past its deadline before the sandbox is treated as stalled.
STREAM_GRACE = 30.0
#: Bytes per piece when downloading.
CHUNK_BYTES = 1024 * 1024
#: Sources up to this size are spooled in memory when uploads go through the server's proxy.
SPOOL_MEMORY_BYTES = 8 * 1024 * 1024
#: The most entries one ``list_directory`` returns.
MAX_LIST_ENTRIES = 100_000


def _status_error(status: int, path: str) -> SandboxError:
    """The shared wording for a missing file, a directory or a file that is not regular."""
    error = file_status_error(status, path)
    assert error is not None, status
    return error


class _CountingReader(io.RawIOBase):
    """A binary reader over ``source`` that counts the bytes read (an upload's size)."""

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self._source.read(len(buffer))
        if not data:
            return 0
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)


class _LineEvents:
    """A command's execd line events passed on to the sink as output, counted per stream; the ``init`` stamp."""

    def __init__(self, output: OutputSink) -> None:
        self.output = output
        self.count = {"stdout": 0, "stderr": 0}
        self.began_ms: int | None = None

    def init(self, event: Any) -> None:
        self.began_ms = int(event.timestamp)

    def stdout(self, message: Any) -> None:
        self.count["stdout"] += 1
        self.output.stdout(driver.line_text(message.text))

    def stderr(self, message: Any) -> None:
        self.count["stderr"] += 1
        self.output.stderr(driver.line_text(message.text))


class OpenSandboxHook(Attachable, SandboxHook):
    """
    Provision sandboxes on an OpenSandbox server.

    Connection (type ``sandbox_opensandbox``, default id ``sandbox_opensandbox_default``): ``host`` and
    ``port`` of the server, ``schema`` ``http`` (default) or ``https``, the API key as ``password``;
    extras ``image``, ``cpu``, ``memory``, ``sandbox_timeout``, ``request_timeout``, ``ready_timeout``,
    ``use_server_proxy``, which the hook arguments below override. With ``opensandbox_conn_id=None``, or
    when the default connection is not defined, the SDK reads ``OPEN_SANDBOX_DOMAIN`` and
    ``OPEN_SANDBOX_API_KEY``.

    Nothing is contacted until a sandbox is created or used.

    :param opensandbox_conn_id: the Airflow connection to read, or None for the SDK's environment.
    :param transport: an ``httpx.BaseTransport`` for every request (a proxy, or a test's mock).
    :raises ValueError: for a setting of the wrong type or out of range, when the hook is built.
    """

    name = "opensandbox"
    display_name = "OpenSandbox"
    form = FORM
    # Detached commands: the control programs run as commands (execd ends a command's process group
    # only at its timeout or when its caller goes away; the runner is in a session of its own).
    detached_commands = True
    capabilities = Capabilities(
        egress_hosts=True,
        egress_cidrs=True,
        advice="Use SandboxSpec(block_network=False) for an open network.",
    )
    handle_pattern = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
    handle_shape = "an OpenSandbox sandbox id: letters, digits, '-', '_' or '.'"
    handle_example = "21011912-89b7-4abf-abb7-e6f63212b66a"

    def __init__(
        self,
        opensandbox_conn_id: str | None = FORM.default_conn_name,
        *,
        image: str | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        sandbox_timeout: float | None = None,
        request_timeout: float | None = None,
        ready_timeout: float | None = None,
        use_server_proxy: bool | None = None,
        transport: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if opensandbox_conn_id is not None and (not isinstance(opensandbox_conn_id, str) or not opensandbox_conn_id):
            raise ValueError(f"opensandbox_conn_id must be a connection id or None, got {opensandbox_conn_id!r}.")
        if isinstance(sandbox_timeout, int) and not isinstance(sandbox_timeout, bool):
            sandbox_timeout = float(sandbox_timeout)
        self.opensandbox_conn_id = opensandbox_conn_id
        self._args = self.settings.arguments(locals())
        self.transport = transport
        self._settings_obj: dict[str, Any] | None = None
        self._sandboxes: dict[str, Any] = {}
        self._manager_obj: Any = None
        self._lock = threading.Lock()
        self._where = "the OpenSandbox server"

    def _refusal(self, spec: Any) -> str | None:
        """
        The daemon's token variable in ``env``, and allowlist entries the egress sidecar cannot take:
        each must be a hostname or an address range.
        """
        if driver.TOKEN_ENV in (spec.env or {}):
            return (
                f"SandboxSpec.env sets {driver.TOKEN_ENV}, which the OpenSandbox backend sets itself: it is the "
                "access token of the sandbox's daemon, a new one per sandbox. Remove it from env."
            )
        for host in spec.allow_egress_to or ():
            if not driver.is_hostname(host):
                return (
                    f"allow_egress_to entry {host!r} is not a hostname. Give a bare name such as 'pypi.org' or "
                    "'*.example.com' (no scheme, port or path); put IP addresses in allow_egress_to_cidrs."
                )
        for cidr in spec.allow_egress_to_cidrs or ():
            if not driver.is_network(cidr):
                return (
                    f"allow_egress_to_cidrs entry {cidr!r} is not an address range. Write it as '203.0.113.0/24' "
                    "or a single address such as '203.0.113.7/32', with no host bits set."
                )
            guarded = uncarved_guard(ipaddress.ip_network(cidr.strip()))
            if guarded is not None:
                block, what = guarded
                return (
                    f"allow_egress_to_cidrs entry {cidr!r} covers {block} ({what}) without naming it, and the "
                    "OpenSandbox egress sidecar cannot leave that block out, so the sandbox would reach it. List "
                    f"narrower ranges that leave {block} out, or list {block} (or a range inside it) on its own "
                    "if the sandbox is meant to reach it."
                )
        return None

    # -- connection ------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is not None:
            return self._settings_obj
        extra: dict[str, Any] = {}
        found: dict[str, Any] = {"domain": None, "api_key": None, "protocol": None}
        conn = self._connection()
        if conn is not None:
            if not conn.host:
                raise SandboxTerminalError(
                    f"Connection {self.opensandbox_conn_id!r} has no host; set it to the OpenSandbox server's host "
                    "name, and its port."
                )
            host = conn.host.split("://", 1)[-1].rstrip("/")
            protocol = (conn.schema or "http").lower()
            if protocol not in ("http", "https"):
                raise SandboxTerminalError(
                    f"Connection {self.opensandbox_conn_id!r} has schema {conn.schema!r}; use http or https."
                )
            found = {"domain": f"{host}:{conn.port}" if conn.port else host, "api_key": conn.password or None}
            found["protocol"] = protocol
            extra = dict(conn.extra_dejson or {})
        try:
            settings = self.settings.resolve(self._args, extra, conn_id=self.opensandbox_conn_id)
        except ValueError as err:
            raise SandboxTerminalError(f"{err} Fix the extra or pass the setting to the hook.") from None
        settings.update(found)
        where = found["domain"] or "named by OPEN_SANDBOX_DOMAIN"
        self._where = f"the OpenSandbox server {where}"
        self._settings_obj = settings
        return settings

    def _connection(self) -> Any:
        if self.opensandbox_conn_id is None:  # no connection at all: the SDK's environment variables
            return None
        return self.connection_or_none(otherwise="OPEN_SANDBOX_DOMAIN and OPEN_SANDBOX_API_KEY")

    def _config(self, token: str | None = None) -> Any:
        deadline = self.patience(float(self._resolved()["request_timeout"])) if self.testing else None
        return driver.connection_config(self._resolved(), self.transport, token, deadline=deadline)

    def _manager(self) -> Any:
        with self._lock:
            if self._manager_obj is None:
                from opensandbox.sync.manager import SandboxManagerSync

                self._manager_obj = SandboxManagerSync.create(self._config())
            return self._manager_obj

    def _sandbox(self, handle: str) -> Any:
        """The SDK object for ``handle``: the cached one, or a reconnect (its wait is no command's)."""
        with self._lock:
            cached = self._sandboxes.get(handle)
        if cached is not None:
            return cached
        sdk = driver.import_sdk()
        settings = self._resolved()
        token = driver.token_of(self._metadata(handle))
        try:
            sandbox = sdk.SandboxSync.connect(
                handle,
                connection_config=self._config(token),
                connect_timeout=timedelta(seconds=float(settings["ready_timeout"])),
            )
        except Exception as err:
            if driver.status_of(err) == 401:  # the server took the API key a moment ago: the daemon refused
                raise self._token_refused(handle) from err
            raise driver.api_error(err, f"reconnecting to sandbox {handle!r}", self._where, handle) from err
        with self._lock:
            self._sandboxes[handle] = sandbox
        return sandbox

    def _token_refused(self, handle: str) -> SandboxTerminalError:
        return SandboxTerminalError(
            f"The daemon in sandbox {handle!r} refused the access token this worker sent (HTTP 401): the token kept "
            f"in the sandbox's metadata ({driver.TOKEN_KEY}) is missing or was changed. Provision a new sandbox."
        )

    def _forget(self, handle: str) -> None:
        with self._lock:
            sandbox = self._sandboxes.pop(handle, None)
        if sandbox is not None:
            sandbox.close()

    # -- lifecycle -------------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        sdk = driver.import_sdk()
        settings = self._resolved()
        spec = request.spec
        policy = driver.network_policy(spec)
        token = driver.new_token()
        config = self._config(token)
        try:
            sandbox = sdk.SandboxSync.create(
                settings["image"],
                timeout=timedelta(seconds=math.ceil(request.lifetime)),
                ready_timeout=timedelta(seconds=self.patience(float(settings["ready_timeout"]))),
                env={**dict(spec.env or {}), driver.TOKEN_ENV: token},
                metadata={
                    driver.NAME_KEY: request.name,
                    driver.TOKEN_KEY: token,
                    **driver.encode_stamps(request.stamps),
                },
                resource={"cpu": settings["cpu"], "memory": settings["memory"]},
                network_policy=policy,
                connection_config=config,
            )
        except Exception as err:
            raise self._create_error(err, policy is not None) from err
        handle = sandbox.id
        try:
            self.check_handle(handle)
            if policy is not None:
                self._check_enforced(sandbox, config, spec)
            from opensandbox.models.filesystem import WriteEntry

            sandbox.files.create_directories([WriteEntry(path=request.workdir, mode=755)])
        except BaseException:
            self._kill_quietly(handle)
            sandbox.close()
            raise
        with self._lock:
            self._sandboxes[handle] = sandbox
        log.info("Created OpenSandbox sandbox %s (%s) on %s", handle, request.name, self._where)
        return handle

    def _create_error(self, err: BaseException, with_policy: bool) -> SandboxTerminalError:
        mapped = driver.api_error(err, "creating a sandbox", self._where)
        message = str(mapped)
        if with_policy and (driver.status_of(err) or 500) >= 500:
            message += (
                " A SandboxSpec that limits the network needs the server's egress sidecar (its [egress] image, in "
                f"mode {driver.ENFORCING_MODE!r}); on a server without one, pass SandboxSpec(block_network=False)."
            )
        elif isinstance(mapped, SandboxError) and not isinstance(mapped, SandboxTerminalError):
            message += " Check the image, cpu, memory and sandbox_timeout (the server's maximum) settings."
        return SandboxTerminalError(message)

    def _check_enforced(self, sandbox: Any, config: Any, spec: Any) -> None:
        from opensandbox.exceptions import SandboxException

        try:
            readback = driver.policy_readback(sandbox, config)
        except (SandboxException, OSError) as err:
            log.warning("Could not read the egress policy of sandbox %s: %s", sandbox.id, err)
            readback = (None, None, set())
        refusal = driver.network_refusal(*readback, spec)
        if refusal:
            raise SandboxTerminalError(refusal)

    def _kill_quietly(self, handle: str) -> None:
        try:
            self._destroy(handle)
        except Exception:
            log.warning("Could not destroy OpenSandbox sandbox %s", handle, exc_info=True)

    def _destroy(self, handle: str) -> None:
        self._forget(handle)
        try:
            self._manager().kill_sandbox(handle)
        except Exception as err:
            if driver.status_of(err) == 404:
                return
            raise driver.api_error(err, f"destroying sandbox {handle!r}", self._where, handle) from err

    # -- commands --------------------------------------------------------------------------------------

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        from opensandbox.models.execd import RunCommandOpts
        from opensandbox.models.execd_sync import ExecutionHandlersSync

        sandbox = self._sandbox(handle)
        applied_ms = max(1, int(timeout * 1000))
        applied = applied_ms / 1000
        opts = RunCommandOpts(timeout=timedelta(milliseconds=applied_ms), working_directory=self.workdir)
        lines = _LineEvents(output)
        handlers = ExecutionHandlersSync(
            on_init=lines.init, on_stdout=lines.stdout, on_stderr=lines.stderr, skip_accumulation=True
        )
        done: dict[str, Any] = {}

        def call() -> None:
            try:
                done["execution"] = sandbox.commands.run(f"sh -c {shlex.quote(command)}", opts=opts, handlers=handlers)
            except BaseException as err:  # reported by the caller's thread
                done["error"] = err

        began = time.monotonic()
        worker = threading.Thread(target=call, daemon=True, name=f"opensandbox-run-{handle}")
        worker.start()
        worker.join(applied + STREAM_GRACE)
        elapsed = time.monotonic() - began
        if worker.is_alive():
            log.warning("Command in sandbox %s stalled past its deadline; destroying the sandbox", handle)
            self._kill_quietly(handle)
            return RunOutcome(exit_code=-1, timed_out=True, sandbox_terminated=True, applied_timeout=applied)
        if "error" in done:
            raise self._lost(handle, done["error"])
        code, timed_out, note = driver.exit_status(done["execution"], elapsed, applied, lines.began_ms)
        if code is None:
            raise self._lost(handle, None)
        self._exact_output(handle, sandbox, done["execution"].id, output, lines.count)
        if note and code == 1:
            output.stderr(f"{note}\n")
        return RunOutcome(exit_code=code, timed_out=timed_out, applied_timeout=applied)

    def _exact_output(self, handle: str, sandbox: Any, execution_id: Any, output: OutputSink, lines: dict) -> None:
        """
        Make the result hold the command's output byte for byte: execd spooled it to two files in the
        sandbox's ``/tmp``, read here (the tail the result keeps) and then removed. Where they cannot be
        read (a daemon that removes them itself), the output stays as the line events gave it.
        """
        paths = driver.spool_paths(execution_id)
        if not paths:
            return
        try:
            infos = sandbox.files.get_file_info(list(paths.values()))
        except Exception as err:
            log.debug("No output files of execution %s in sandbox %s: %s", execution_id, handle, err)
            return
        if not all(_daemons_file(infos.get(path)) for path in paths.values()):
            log.warning(
                "Kept the streamed output of execution %s in sandbox %s: a file at %s is not one the daemon made "
                "(a command's own process can make files there)",
                execution_id,
                handle,
                " or ".join(paths.values()),
            )
            return
        try:
            for stream, path in paths.items():
                size = int(infos[path].size)
                take, header = driver.tail_range(size, output.max_output_bytes)
                data = b""
                if take:
                    data = b"".join(sandbox.files.read_bytes_stream(path, chunk_size=CHUNK_BYTES, range_header=header))
                if len(data) != take:
                    continue
                ended = data.endswith((b"\n", b"\r")) or not data
                estimate = lines[stream] - (0 if ended else 1)  # every line event but an unended last one
                newlines = data.count(b"\n") if take == size else max(data.count(b"\n"), estimate)
                output.restate(stream, data, total_bytes=size, newlines=newlines)
        except Exception:
            log.debug("Kept the streamed output of execution %s in sandbox %s", execution_id, handle, exc_info=True)
        finally:
            try:
                sandbox.files.delete_files(list(paths.values()))
            except Exception as err:
                log.debug("Could not remove the output files %s of sandbox %s: %s", list(paths.values()), handle, err)

    def _lost(self, handle: str, err: BaseException | None) -> SandboxError:
        """The error for a command whose stream broke: terminal when the sandbox is gone, else retryable."""
        self._forget(handle)
        if err is not None and driver.status_of(err) == 401:
            return self._token_refused(handle)
        if err is not None and driver.status_of(err) not in (None, 404):
            return driver.api_error(err, "running a command", self._where, handle)
        try:
            state = str(self._manager().get_sandbox_info(handle).status.state)
        except Exception as info_err:
            if driver.status_of(info_err) != 404:
                return driver.api_error(info_err, "checking a sandbox after a command", self._where, handle)
            state = None
        if state is None or state.lower() != "running":
            now = "is gone" if state is None else f"is {state}"
            return SandboxTerminalError(
                f"Sandbox {handle!r} ended while the command ran (it {now} on {self._where}: its container was "
                "removed or its lifetime ran out), and the command's outcome is unknown. Provision a new sandbox."
            )
        return SandboxError(
            f"The output stream of the command in sandbox {handle!r} broke ({err or 'no outcome'}); the sandbox still "
            "runs, so the command may have finished. Check its effects before running it again."
        )

    # -- files -----------------------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        check_path(path)
        return driver.sandbox_path(self.workdir, path)

    def _file_error(self, err: BaseException, handle: str, path: str, verb: str) -> SandboxError:
        from opensandbox.exceptions import SandboxApiException

        if isinstance(err, SandboxApiException) and driver.status_of(err) == 404 and "FILE_NOT_FOUND" in str(err):
            return _status_error(guest.MISSING_STATUS, path)
        if isinstance(err, SandboxApiException) and driver.status_of(err) in (400, 500):
            return SandboxError(f"Could not finish {verb} {path!r}: {str(err).split(' | ')[0]}")
        return self._lost(handle, err)

    def _download(self, handle: str, path: str, sink: IO[bytes], max_bytes: int) -> tuple[int, int | None]:
        """Copy at most ``max_bytes`` of the file at ``path`` into ``sink``; return (bytes copied, size seen first)."""
        self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        sandbox, target = self._sandbox(handle), self._path(path)
        try:
            info = sandbox.files.get_file_info([target])[target]
        except Exception as err:
            raise self._file_error(err, handle, path, "reading") from err
        if info.entry_type == "directory":
            raise _status_error(guest.IS_DIR_STATUS, path)
        if info.entry_type not in ("file", "symlink"):
            raise _status_error(guest.NOT_REGULAR_STATUS, path)
        size = int(info.size) if info.entry_type == "file" else None
        if size is not None and size > max_bytes:
            raise SandboxFileTooLargeError(path, size, max_bytes)
        if size == 0:
            return 0, 0
        copied = 0
        try:
            for chunk in sandbox.files.read_bytes_stream(
                target, chunk_size=CHUNK_BYTES, range_header=f"bytes=0-{max_bytes}"
            ):
                copied += len(chunk)
                if copied > max_bytes:
                    raise SandboxFileTooLargeError(path, copied, max_bytes)
                sink.write(chunk)
        except SandboxError:
            raise
        except Exception as err:
            if driver.status_of(err) == 416:  # a range past the end: the link's target is empty
                return 0, size
            raise self._file_error(err, handle, path, "reading") from err
        return copied, size

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`: the size is checked first, and at most ``max_bytes`` + 1 move."""
        buffer = io.BytesIO()
        self._download(handle, path, buffer, int(max_bytes))
        return buffer.getvalue()

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`: streamed 1 MiB at a time."""
        copied, size = self._download(handle, path, stream, int(max_bytes))
        if size is not None:
            check_export_size(path, size, copied)
        return copied

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """Stream ``source`` into ``path`` (parents created, mode 644); return the bytes written."""
        self.check_handle(handle)
        sandbox, target = self._sandbox(handle), self._path(path)
        reader: Any = _CountingReader(source)
        spooled = None
        if self._resolved()["use_server_proxy"]:  # the server's proxy needs a Content-Length
            spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)
            while chunk := reader.read(CHUNK_BYTES):
                spooled.write(chunk)
            spooled.seek(0)
        try:
            sandbox.files.write_file(target, spooled or reader, mode=644)
        except Exception as err:
            raise self._file_error(err, handle, path, "writing") from err
        finally:
            if spooled is not None:
                spooled.close()
        return reader.count

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """See :meth:`SandboxHook.list_directory`."""
        from opensandbox.models.filesystem import DirectoryListEntry

        self.check_handle(handle)
        sandbox, target = self._sandbox(handle), self._path(path)
        try:
            entries = sandbox.files.list_directory(DirectoryListEntry(path=target, depth=1))
        except Exception as err:
            if driver.status_of(err) in (400, 404):
                raise SandboxError(f"{path!r} is not a directory in the sandbox.") from err
            raise self._file_error(err, handle, path, "listing") from err
        if len(entries) > MAX_LIST_ENTRIES:
            raise SandboxError(
                f"{path!r} holds more entries than one listing returns ({MAX_LIST_ENTRIES}); list part of it with a "
                "command such as find or ls piped to head."
            )
        return sorted((posixpath.basename(e.path), e.entry_type == "directory") for e in entries)

    # -- attach ----------------------------------------------------------------------------------------

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """
        The server's sandboxes that carry this provider's stamps (in their metadata), holding every item
        of ``stamps``: ``{handle: stamps}``. Reads every page of the server's listing.
        """
        from opensandbox.models.sandboxes import SandboxFilter

        found: dict[str, dict[str, str]] = {}
        page = 1
        while True:
            try:
                listed = self._manager().list_sandbox_infos(SandboxFilter(page=page, page_size=100))
            except Exception as err:
                raise driver.api_error(err, "listing sandboxes", self._where, None) from err
            for info in listed.sandbox_infos:
                tags = driver.decode_stamps(info.metadata)
                if EXPIRES_AT_TAG in tags and all(tags.get(key) == value for key, value in stamps.items()):
                    found[str(info.id)] = tags
            if not listed.pagination.has_next_page:
                return found
            page += 1

    def _metadata(self, handle: str) -> Mapping[str, str]:
        try:
            return self._manager().get_sandbox_info(handle).metadata or {}
        except Exception as err:
            raise driver.api_error(err, f"reading sandbox {handle!r}", self._where, handle) from err

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """The sandbox's stamps, decoded from its metadata. :raises SandboxTerminalError: if it is gone."""
        return driver.decode_stamps(self._metadata(handle))

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Make the sandbox's stamps ``tags`` with one metadata patch."""
        patch = driver.stamps_patch(self._metadata(handle), tags)
        if not patch:
            return
        try:
            self._manager().patch_sandbox_metadata(handle, patch)
        except Exception as err:
            raise driver.api_error(err, f"updating the stamps of sandbox {handle!r}", self._where, handle) from err

    def describe_network(self, spec: Any) -> str:
        """What a sandbox of ``spec`` can reach here, in words for a model (the toolset's description)."""
        if not spec.block_network:
            return "The sandbox can reach the network: the OpenSandbox server gave it no egress policy."
        hosts, cidrs = list(spec.allow_egress_to or ()), list(spec.allow_egress_to_cidrs or ())
        if not hosts and not cidrs:
            return (
                "The sandbox has no network access: its egress sidecar drops every connection and resolves no "
                "name, so installing packages or downloading anything will fail; work with what is installed."
            )
        reach = []
        if hosts:
            reach.append(f"the hosts {', '.join(hosts)} (DNS answers only these names; their addresses, any port)")
        if cidrs:
            reach.append(f"the address ranges {', '.join(cidrs)} (any port)")
        return (
            f"The sandbox can reach only {' and '.join(reach)}; its egress sidecar drops everything else, so "
            "installing packages from elsewhere will not work."
        )

    def _check_connection(self) -> str:
        return f"{super()._check_connection()} The server: {self._where}."


def _daemons_file(info: Any) -> bool:
    """
    Whether ``info`` (execd's file info) is a file owned by root, as the daemon's spool files are:
    one the command user made at that name (knowing the execution id from its own files, say, when
    ``TMPDIR`` sends the daemon's spool elsewhere) would hand the next task forged output.
    """
    return (
        info is not None
        and getattr(info, "owner", None) == "root"
        and getattr(info, "entry_type", None) in (None, "file")  # a link the command user made is its own
    )


#: The hook under the name the public guide uses.
OpenSandboxBackend = OpenSandboxHook
