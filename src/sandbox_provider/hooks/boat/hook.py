"""
The Boat backend (formerly Ascii Box): sandboxes on Boat's hosted platform, through ``boat-sdk``.

- **Network**: Boat gives every sandbox open outbound access and has no setting to block or narrow
  it. So only ``SandboxSpec(block_network=False)`` is accepted: a spec that asks for no network or
  for an allowlist is refused before anything is provisioned.
- **Not attachable**: Boat keeps no metadata to carry the owner and holder stamps; an owner is refused.
- **Lifetime**: ``sandbox_timeout`` seconds, sent as Boat's ``ttl_seconds`` (Boat archives the
  sandbox then; snapshots are off, so its disk goes). Deletes are asynchronous: Boat accepts them and finishes later.
- **Commands**: Boat runs a command synchronously for at most 600 s and answers nothing until it
  ends. Each command runs under the guest program ``run_with_deadline.sh`` in a login shell, with
  its deadline (at most 585 s) enforced inside the sandbox and the tails of its output replayed
  from files; Boat's own deadline is set a little later. If Boat's deadline fires anyway, the
  in-sandbox kill failed, so the sandbox is deleted and the result says it ended. ``spec.env`` is
  given at creation and exported again at the start of every command, after the login profile.
  One command is one request: it is never sent again (the SDK's retries are off), whatever Boat
  answers or fails to.
- **Files**: writes go through Boat's file API, in pieces under its 5 MiB limit, for paths Boat
  accepts (under ``/home/user`` or ``/tmp``), and through the shell elsewhere; reads, exports and
  listings go through the shell (Boat's own read has no size limit), reads and exports in 4 MiB
  pieces so that each command's output stays under Boat's 8 MiB cap.

``boat-sdk`` is imported on first use, so Dag files that build the hook parse without it.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import posixpath
import re
import shlex
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO, Any, cast

from sandbox_provider.hooks.boat import driver
from sandbox_provider.hooks.forms.boat import FORM
from sandbox_provider.hooks.hosted.deadline_run import parse_status, replay, wrapper_command
from sandbox_provider.hooks.hosted.service import (
    abandon_runaway,
    call,
    check_conn_id,
    check_service_url,
    discard,
    load_connection,
)
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles, write_through_temp
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import SandboxSpec, check_byte_count, check_path

log = logging.getLogger(__name__)

__all__ = ["BoatSandboxBackend", "BoatSandboxHook"]

#: Boat's own cap on one command, in seconds.
BOAT_COMMAND_CAP = 600
#: Seconds from SIGTERM to SIGKILL at a command's deadline, inside the sandbox.
KILL_AFTER = 5
#: Seconds Boat's deadline comes after the in-sandbox deadline and its kill.
BOAT_MARGIN = 10
#: The longest deadline a command gets, so that Boat's own deadline stays within its cap.
MAX_COMMAND_SECONDS = BOAT_COMMAND_CAP - KILL_AFTER - BOAT_MARGIN
#: Bytes of each stream replayed at most: Boat keeps 8 MiB of each, and the status line must fit after it.
STREAM_KEEP = 8 * 1024 * 1024 - 64 * 1024
#: Raw bytes per native write: base64 and JSON make the request about 4/3 of it, under Boat's 5 MiB.
WRITE_CHUNK = 3 * 1024 * 1024
#: The directories Boat's file API writes under.
NATIVE_WRITE_ROOTS = ("/home/user", "/tmp")
HOME = "/home/user"
READY_STATES = frozenset({"ready", "idle", "running"})
ENDED_STATES = frozenset({"archiving", "archived", "error", "cancelled"})
POLL_FIRST, POLL_LONGEST = 0.5, 4.0
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class BoatSandboxHook(ShellFiles, SandboxHook):
    """
    Provision sandboxes on Boat. Every sandbox has open outbound network access.

    Connection (type ``sandbox_boat``, default id ``sandbox_boat_default``; when that default is not
    defined, ``BOAT_API_KEY`` and ``BOAT_BASE_URL`` on the worker are used): ``password`` the API key,
    ``host`` the API base URL (default ``https://boat.dev/api/v1``), extras for the settings below.

    :param boat_conn_id: the Airflow connection to read.
    :raises ValueError: for a setting of the wrong type or out of bounds.
    """

    form = FORM
    name = "boat"
    display_name = "Boat"
    capabilities = Capabilities(
        no_network=False,
        open_network=True,
        egress_hosts=False,
        egress_cidrs=False,
        max_command_seconds=MAX_COMMAND_SECONDS,
        network=NetworkReach(
            open="has open outbound network access, Boat's only mode: no host or port is narrowed",
        ),
        advice=(
            "Boat gives every sandbox open outbound access and cannot block or narrow it: pass "
            "SandboxSpec(block_network=False) to accept an open network, or use a backend that enforces the "
            "block (local, Docker, Modal or Islo)."
        ),
    )
    handle_pattern = re.compile(r"bx_[23456789abcdefghjkmnpqrstuvwxyz]{8}")
    handle_shape = "'bx_' followed by 8 lowercase letters and digits"
    handle_example = "bx_a2c4e6g8"
    workdir = HOME

    def __init__(
        self,
        boat_conn_id: str = FORM.default_conn_name,
        *,
        machine_type: str | None = None,
        sandbox_timeout: int | None = None,
        ready_timeout: float | None = None,
        request_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.boat_conn_id = check_conn_id(boat_conn_id, "boat_conn_id")
        self._args = self.settings.arguments(locals())
        self._lock = threading.Lock()
        self._settings_obj: dict[str, Any] | None = None
        #: The API key and the API base URL, from the connection or the environment.
        self._service: tuple[str, str] = ("", "")
        self._api_obj: Any = None
        #: spec.env by handle, exported again at the start of every command.
        self._env: dict[str, dict[str, str]] = {}
        # Deadlines read these; tests swap them for a scripted clock.
        self._monotonic: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    # -- connection ------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is None:
            found = load_connection(self, self.boat_conn_id, fallback="BOAT_API_KEY and BOAT_BASE_URL")
            settings = found.resolve(self.settings, self._args)
            api_key = found.password or os.environ.get("BOAT_API_KEY")
            if not api_key:
                raise SandboxTerminalError(
                    f"No Boat API key: set the password of connection {self.boat_conn_id!r}, or BOAT_API_KEY on "
                    "the worker."
                )
            where = f"The host of connection {found.conn_id!r}" if found.host else "BOAT_BASE_URL"
            url = found.host or os.environ.get("BOAT_BASE_URL") or driver.DEFAULT_BASE_URL
            self._service = (api_key, check_service_url(url, where))
            self._settings_obj = settings
        return self._settings_obj

    def _api(self) -> Any:
        with self._lock:
            if self._api_obj is None:
                self._resolved()
                api_key, base_url = self._service
                self._api_obj = driver.make_api(base_url, api_key)
            return self._api_obj

    @property
    def _request_timeout(self) -> float:
        return self.patience(float(self._resolved()["request_timeout"]))

    # -- the contract ----------------------------------------------------------------------------------

    def _refusal(self, spec: SandboxSpec) -> str | None:
        bad = sorted(name for name in spec.env or {} if not _SHELL_NAME.fullmatch(name))
        if bad:
            return (
                f"SandboxSpec.env names {bad!r} cannot be exported by a shell, which Boat's commands run in: use "
                "names of letters, digits and underscores that do not start with a digit."
            )
        return None

    def _provision(self, request: ProvisionRequest) -> str:
        boat_sdk = driver.import_boat()
        settings = self._resolved()
        env = dict(request.spec.env or {})
        body = boat_sdk.CreateSandboxRequest(
            type=settings["machine_type"],
            ttl_seconds=math.ceil(request.lifetime),
            env=env or None,
            no_env=True,
            snapshots=False,
            name=request.name,
        )
        deadline = self._monotonic() + self.patience(float(settings["ready_timeout"]))
        sandbox_id: str | None = None
        try:
            created = self._create(body, deadline)
            sandbox_id = created.sandbox.id
            self._wait_ready(sandbox_id, deadline)
        except BaseException as err:
            if sandbox_id:
                discard(self._destroy, sandbox_id, log)
            if isinstance(err, SandboxError):
                raise
            raise driver.translate(err, "creating the sandbox") from err
        self._env[sandbox_id] = env
        return sandbox_id

    def _create(self, body: Any, deadline: float) -> Any:
        """
        Create under one idempotency key. A lost answer or a 5xx is resent once with the same key (Boat
        then answers for the sandbox the first request made); a 409 saying that request is still being
        handled is asked again until ``deadline``.
        """
        key = str(uuid.uuid4())
        api = self._api()
        sent: list[int] = []

        def attempt() -> Any:
            sent.append(1)
            left = max(1.0, min(self._request_timeout, deadline - self._monotonic()))
            return api.create(idempotency_key=key, create_sandbox_request=body, _request_timeout=left)

        def again(err: BaseException) -> bool:
            status = driver.status_of(err)
            if status == 409:
                return driver.error_code(err) == "idempotency_in_progress"
            lost = status is None or status >= 500
            return lost and len(sent) < 2

        return call(
            attempt,
            until=deadline,
            retry=again,
            retry_after=driver.retry_after,
            clock=self._monotonic,
            sleep=self._sleep,
        )

    def _wait_ready(self, sandbox_id: str, deadline: float) -> None:
        api = self._api()
        pause = POLL_FIRST
        while True:
            left = max(1.0, min(self._request_timeout, deadline - self._monotonic()))
            response = call(
                lambda: api.get_without_preload_content(sandbox_id, _request_timeout=left),  # noqa: B023
                until=deadline,
                retry=lambda err: driver.status_of(err) is None,  # no answer: a GET may be asked again
                retry_after=driver.retry_after,
                clock=self._monotonic,
                sleep=self._sleep,
            )
            try:
                if response.status != 200:
                    raise SandboxTerminalError(
                        f"Boat answered HTTP {response.status} while waiting for sandbox {sandbox_id} to be ready."
                    )
                state = str((json.loads(response.data).get("sandbox") or {}).get("state"))
            finally:
                response.release_conn()
            if state in READY_STATES:
                return
            if state in ENDED_STATES:
                raise SandboxTerminalError(f"Boat's new sandbox {sandbox_id} ended as {state!r} before it was ready.")
            if self._monotonic() + pause >= deadline:
                raise SandboxTerminalError(
                    f"Boat's sandbox {sandbox_id} was still {state!r} at the end of ready_timeout; it was deleted. "
                    "Try again, or raise ready_timeout."
                )
            self._sleep(pause)
            pause = min(pause * 2, POLL_LONGEST)

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        boat_sdk = driver.import_boat()
        keep = min(output.out.limit, STREAM_KEEP) or 1
        exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in self._env.get(handle, {}).items())
        # exec: the guest program replaces Boat's shell, so what ends it reaches Boat as it happened.
        line = "exec " + wrapper_command(
            exports + command, deadline=timeout, kill_after=KILL_AFTER, keep_bytes=keep, login=True
        )
        boat_deadline = min(BOAT_COMMAND_CAP, math.ceil(timeout) + KILL_AFTER + BOAT_MARGIN)
        request = boat_sdk.CommandRequest(command=line, cwd=self.workdir, timeout_seconds=boat_deadline)
        try:
            answer = self._api().command(handle, request, _request_timeout=boat_deadline + self._request_timeout)
        except Exception as err:
            raise driver.translate(err, "running a command", handle, maybe_ran=True) from err
        result = answer.actual_instance
        if result.timed_out:
            return abandon_runaway(
                self._destroy,
                handle,
                output,
                timeout,
                ends="Boat archives it at the end of its lifetime (sandbox_timeout)",
            )
        run = parse_status(result.stdout or "", result.stderr or "")
        if run is None:
            output.stdout(result.stdout or "")
            output.stderr(result.stderr or "")
            if result.exit_code is None:
                why = "it ran out of memory" if result.oom_killed else f"signal {result.signal or 'unknown'}"
                output.stderr(f"\nBoat reported no exit status for the command ({why}).\n")
            code = -1 if result.exit_code is None else int(result.exit_code)
        else:
            replay(run, output, keep)
            code = run.exit_code
        if result.stdout_truncated:
            output.out.truncated = True
        if result.stderr_truncated:
            output.err.truncated = True
        return RunOutcome(exit_code=code, timed_out=bool(run and run.timed_out))

    leftovers_bound = (
        "Boat archives each sandbox at the end of its lifetime (sandbox_timeout, sent as ttl_seconds), "
        "so what a killed worker leaves ends then."
    )

    def _destroy(self, handle: str) -> None:
        """Ask Boat to delete the sandbox. Boat accepts and finishes later: it may be listed a while yet."""
        try:
            answer = self._api().delete_sandbox(
                x_ascii_confirm_delete=handle, sandbox_id=handle, _request_timeout=self._request_timeout
            )
        except Exception as err:
            if driver.status_of(err) == 404:
                return
            raise driver.translate(err, "deleting the sandbox", handle) from err
        finally:
            self._env.pop(handle, None)
        log.info("Boat accepted the deletion of sandbox %s (operation %s)", handle, answer.operation.id)

    # -- files -----------------------------------------------------------------------------------------

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        See :meth:`SandboxHook.read_file`: through the shell, in the same 4 MiB pieces as an export,
        since one command's output reaches the worker only up to Boat's 8 MiB cap.
        """
        check_byte_count(max_bytes, "max_bytes")
        buffer = io.BytesIO()
        self.export_file(handle, path, buffer, max_bytes=max_bytes)
        return buffer.getvalue()

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        See :meth:`SandboxHook.import_file`. Under ``/home/user`` or ``/tmp``: through Boat's file
        API, 3 MiB at a time into a temporary sibling renamed over ``path`` at the end; elsewhere, or
        where Boat refuses the path, through the shell.
        """
        handle = self.check_handle(handle)
        target = posixpath.normpath(posixpath.join(self.workdir, check_path(path)))
        if not any(target == root or target.startswith(root + "/") for root in NATIVE_WRITE_ROOTS):
            return super().import_file(handle, path, source)
        try:
            return self._import_native(handle, path, target, source)
        except _PathRefused as refused:
            # Boat resolves links before it checks the path; the shell writes where the link leads.
            log.info("Boat refused a native write to %s; writing it through the shell", target)
            return super().import_file(handle, path, cast(IO[bytes], _Rejoined(refused.first, source)))

    def _import_native(self, handle: str, path: str, target: str, source: IO[bytes]) -> int:
        def start() -> str:
            return posixpath.normpath(posixpath.join(self.workdir, self._temp_sibling(handle, target, path)))

        return write_through_temp(
            start=start,
            fill=lambda temp: self._fill_native(handle, path, temp, source),
            commit=lambda temp: self._write_step(handle, path, "commit", temp, target),
            abort=lambda temp: self._abort_temps(handle, temp, temp + ".part"),
        )

    def _fill_native(self, handle: str, path: str, temp: str, source: IO[bytes]) -> int:
        """Write ``source`` into ``temp``: the first piece directly, each later one to a part appended to it."""
        part = temp + ".part"
        total = 0
        first = True
        while True:
            chunk = source.read(WRITE_CHUNK)
            if not chunk and not first:
                break
            try:
                self._write_native(handle, temp if first else part, chunk, path)
            except _PathRefused as refused:
                if not first:
                    raise SandboxError(f"Boat refused a piece of {path!r} ({refused}).") from refused
                refused.first = chunk
                raise
            if not first:
                self._write_step(handle, path, "concat", temp, part)
            total += len(chunk)
            first = False
            if not chunk:
                break
        return total

    def _write_native(self, handle: str, target: str, chunk: bytes, path: str) -> None:
        boat_sdk = driver.import_boat()
        request = boat_sdk.FileWriteRequest(path=target, content=base64.b64encode(chunk).decode(), encoding="base64")
        try:
            self._api().write_file(handle, request, _request_timeout=self._request_timeout)
        except Exception as err:
            if driver.status_of(err) == 400 and driver.error_code(err) == "invalid_path":
                raise _PathRefused(driver.translate(err, f"writing {path!r}", handle)) from err
            raise driver.translate(err, f"writing {path!r}", handle) from err


class _PathRefused(SandboxError):
    """Boat's file API refused the path; ``first`` holds the bytes already read for it."""

    first: bytes = b""


class _Rejoined:
    """``first`` and then the rest of ``source``, as one readable binary stream."""

    def __init__(self, first: bytes, source: IO[bytes]) -> None:
        self._first = first
        self._source = source

    def read(self, size: int = -1) -> bytes:
        if self._first:
            if size is None or size < 0:
                data, self._first = self._first + self._source.read(), b""
                return data
            data, self._first = self._first[:size], self._first[size:]
            return data
        return self._source.read(size)


#: The hook under the name the public guide uses.
BoatSandboxBackend = BoatSandboxHook
