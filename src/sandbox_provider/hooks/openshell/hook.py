"""
Sandboxes on a self-hosted NVIDIA OpenShell gateway, through the ``openshell`` SDK (gRPC).

How the pieces map onto the gateway:

- **A sandbox** is an OpenShell sandbox named ``airflow-`` and 11 hex digits (the gateway takes
  at most 19 characters), in the configured workspace (every call names it). It carries the
  labels ``managed-by=airflow-sandbox``, ``airflow-created-at`` and ``airflow-expires-at`` (Unix
  seconds) and the task that made it, for tracing and sweeping.
- **No lifetime on the gateway.** A sandbox stays until it is deleted: a worker killed mid-task
  leaves it running. :meth:`OpenShellSandboxHook.remove_expired` deletes the ones past their
  ``airflow-expires-at``; run it on a schedule.
- **Network**: every sandbox gets a complete policy (never an empty one, which would let the
  image's own apply): no network rule, which OpenShell enforces as no egress, or, for
  ``allow_egress_to``, one rule letting any binary reach each host on port 443. Address ranges and
  an open network cannot be expressed (every rule names a host and ports) and are refused. The
  effective policy is read back after create and **before and after every command**; if it ever
  differs from what was asked for (its source, admission, Landlock as a hard requirement, no
  middlewares, exactly the requested destinations), the sandbox is destroyed and the task fails.
- **Commands** travel on stdin to the guest program ``run_session.sh``, which runs them in their own
  session under the deadline and kills the whole session at the end, so a timeout keeps the sandbox.
  If the gateway stops relaying past the deadline plus ``relay_grace``, the sandbox is destroyed
  and the result says so. Output is relayed as raw bytes, so binary files read exactly.
- **Files** go over the same exec stream: reads and exports as raw bytes, writes as stdin in
  768 KiB pieces into a temporary sibling renamed into place.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from sandbox_provider.hooks.forms.openshell import FORM
from sandbox_provider.hooks.hosted.service import check_conn_id, resolve_settings
from sandbox_provider.hooks.openshell import driver
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import (
    ShellFiles,
    check_export_size,
    checked_size,
    write_step_error,
    write_through_temp,
)
from sandbox_provider.sandbox.hook import (
    FILE_OP_TIMEOUT,
    Capabilities,
    OutputSink,
    ProvisionRequest,
    RunOutcome,
    SandboxHook,
)
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.spec import (
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_path,
    hostname_allowlist,
)

log = logging.getLogger(__name__)

__all__ = ["OpenShellSandboxBackend", "OpenShellSandboxHook", "OpenShellSandboxInfo"]

#: Raw bytes sent per exec when writing a file (well inside gRPC's 4 MiB message limit).
WRITE_CHUNK_BYTES = 768 * 1024
_NOT_READY = ("PROVISIONING", "STARTING", "UNSPECIFIED", "UNKNOWN")
_ADVICE = (
    "OpenShell blocks all egress by default and can allow hostnames on port 443 (allow_egress_to), but every rule "
    "names a host and ports, so it cannot open the network or allow address ranges, and its sandboxes cannot be "
    "attached by another task (owner). Keep block_network=True and list the hosts the sandbox needs in "
    "allow_egress_to, or use a backend that enforces the rest."
)


@dataclass(frozen=True)
class OpenShellSandboxInfo:
    """
    One sandbox this provider made on the gateway, as :meth:`OpenShellSandboxHook.list_sandboxes` finds it.

    :param handle: the sandbox name.
    :param created_at: Unix time (seconds) it was created, or None if its label is missing.
    :param expires_at: Unix time (seconds) its lifetime ends, or None if its label is missing.
    :param phase: the gateway's phase (``READY``, ``ERROR``, ...).
    """

    handle: str
    created_at: float | None
    expires_at: float | None
    phase: str

    def expired(self, now: float | None = None) -> bool:
        """True when the lifetime has run out at ``now`` (default: the current time)."""
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)


class OpenShellSandboxHook(ShellFiles, SandboxHook):
    """
    Provision sandboxes on an OpenShell gateway.

    Connection (type ``sandbox_openshell``, default id ``sandbox_openshell_default``; when that
    default connection is not defined, or has no host, the gateway registered with the
    ``openshell`` CLI on the worker is used: ``gateway``, else ``$OPENSHELL_GATEWAY``, else the
    CLI's active gateway):

    - ``host`` (``gateway.example.com`` or ``https://gateway.example.com:8443``) and ``port``;
    - ``password``: a bearer token, when the gateway wants one;
    - extras ``tls`` (TLS with system roots), ``tls_ca_cert``, ``tls_client_cert``,
      ``tls_client_key`` (paths on the worker; TLS is on when any is given), and every setting below.

    :param openshell_conn_id: the Airflow connection to read.
    :raises ValueError: for a setting of the wrong type or out of bounds.
    """

    name: ClassVar[str] = "openshell"
    display_name: ClassVar[str] = "OpenShell"
    capabilities = Capabilities(open_network=False, egress_hosts=True, egress_cidrs=False, advice=_ADVICE)
    handle_pattern: ClassVar[re.Pattern[str]] = re.compile(r"airflow-[0-9a-f]{11}")
    handle_shape: ClassVar[str] = "'airflow-' followed by 11 lowercase hex digits"
    handle_example: ClassVar[str] = "airflow-0123456789a"
    form = FORM
    workdir = "/sandbox"
    #: Seconds between readiness polls.
    poll_interval: ClassVar[float] = 0.5

    def __init__(
        self,
        openshell_conn_id: str = FORM.default_conn_name,
        *,
        gateway: str | None = None,
        workspace: str | None = None,
        image: str | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        sandbox_timeout: float | None = None,
        ready_timeout: float | None = None,
        request_timeout: float | None = None,
        relay_grace: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.openshell_conn_id = check_conn_id(openshell_conn_id, "openshell_conn_id")
        self._args = self.settings.arguments(locals())
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._settings_obj: dict[str, Any] | None = None
        #: Hosts each sandbox this hook made may reach, by handle.
        self._hosts: dict[str, list[str]] = {}

    # -- connection ----------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is not None:
            return self._settings_obj
        fields: dict[str, Any] = {"host": None, "port": None, "password": None}
        extra: dict[str, Any] = {}
        conn = self.connection_or_none(otherwise="the gateway registered with the openshell CLI")
        if conn is not None:
            fields = {"host": conn.host or None, "port": conn.port or None, "password": conn.password or None}
            extra = dict(conn.extra_dejson or {})
        settings = resolve_settings(self.settings, self._args, extra, self.openshell_conn_id)
        settings.update(fields)
        self._settings_obj = settings
        return settings

    def _client(self) -> Any:
        with self._lock:
            if self._client_obj is None:
                self._client_obj = self._connect(self._resolved())
            return self._client_obj

    def _connect(self, settings: dict[str, Any]) -> Any:
        try:
            import openshell
        except ImportError as err:
            from airflow.exceptions import AirflowOptionalProviderFeatureException

            raise AirflowOptionalProviderFeatureException(
                "The OpenShell sandbox backend needs the openshell package: "
                "pip install -c requirements.lock '.[openshell]' in a clone of airflow-provider-sandbox."
            ) from err
        timeout, gateway = self.patience(settings["request_timeout"]), settings["gateway"]  # gateway: host-less only
        if not settings["host"]:
            try:
                return openshell.SandboxClient.from_active_cluster(cluster=gateway, timeout=timeout)
            except openshell.SandboxError as err:
                raise SandboxTerminalError(
                    f"No OpenShell gateway to use: {err}. Give the connection {self.openshell_conn_id!r} a host, or "
                    "register a gateway with the openshell CLI on the worker (and pass gateway= to pick one)."
                ) from None
        files = {"ca": settings["tls_ca_cert"], "cert": settings["tls_client_cert"], "key": settings["tls_client_key"]}
        wants_tls = bool(settings["tls"]) or any(files.values())
        endpoint, use_tls = driver.endpoint(settings["host"], settings["port"], wants_tls)
        tls = None
        if use_tls:
            from pathlib import Path

            paths = {key: Path(value) for key, value in files.items() if value}
            missing = sorted(str(path) for path in paths.values() if not path.is_file())
            if missing:
                raise SandboxTerminalError(
                    f"TLS files of connection {self.openshell_conn_id!r} do not exist on this worker: {missing}."
                )
            tls = openshell.TlsConfig(ca_path=paths.get("ca"), cert_path=paths.get("cert"), key_path=paths.get("key"))
        return openshell.SandboxClient(endpoint, tls=tls, bearer_token=settings["password"], timeout=timeout)

    def close(self) -> None:
        """Release the gRPC channel, if one was opened; the hook opens a new one when used again."""
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            client.close()

    def get_conn(self) -> Any:
        """The ``openshell.SandboxClient`` this hook uses (made on first use)."""
        return self._client()

    def _test_where(self) -> str:
        return f" (connection {self.openshell_conn_id!r})"

    def _lifetime_seconds(self) -> float:
        return float(self._resolved()["sandbox_timeout"])

    # -- gateway calls -------------------------------------------------------------------------------

    def _call(self, action: str, handle: str, fn: Callable[[Any], Any]) -> Any:
        try:
            return fn(self._client())
        except SandboxError:
            raise
        except Exception as err:
            raise self._translate(err, action, handle) from err

    def _translate(self, err: BaseException, action: str, handle: str) -> SandboxError:
        import grpc

        code = driver.status_code(err)
        where = f"while {action} sandbox {handle} on the OpenShell gateway"
        if code == grpc.StatusCode.NOT_FOUND:
            return SandboxTerminalError(f"Sandbox {handle} is gone from the OpenShell gateway ({where}).")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return SandboxTerminalError(
                f"The OpenShell gateway refused the credentials {where} ({driver.describe(err)}). Check the bearer "
                f"token and TLS files of connection {self.openshell_conn_id!r}, or the CLI's gateway registration."
            )
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE):
            return SandboxError(f"The OpenShell gateway refused {where}: {driver.describe(err)}.")
        return SandboxTerminalError(f"Failed {where}: {driver.describe(err)}.")

    def _stub(self) -> Any:
        # GetSandboxConfig has no SandboxClient method, and exec needs a deadline of its own, so both
        # go through the client's stub, on the SDK's own error-mapping channel.
        return self._client()._stub

    def _workspace(self) -> str:
        return self._resolved()["workspace"]

    # -- policy --------------------------------------------------------------------------------------

    def _refusal(self, spec: SandboxSpec) -> str | None:
        if spec.allow_egress_to:
            try:
                hostname_allowlist(spec.allow_egress_to)
            except ValueError as err:
                return str(err)
        owned = driver.supervisor_env_names(spec.env)
        if owned:
            return (
                f"SandboxSpec.env sets {owned}, which the OpenShell supervisor sets itself (its proxy, its CA bundle and "
                "OPENSHELL_* variables) and would silently overwrite. Rename these variables, or drop them."
            )
        return None

    def describe_network(self, spec: SandboxSpec) -> str | None:
        if not spec.allow_egress_to:
            # Not "not even DNS": OpenShell's deny-all is enforced at its proxy, and name lookups
            # have been reported to get through it.
            return (
                "The sandbox has no network access: connections to any host fail, so installing packages or "
                "downloading anything will fail; work with what is already installed."
            )
        hosts = ", ".join(hostname_allowlist(spec.allow_egress_to))
        return (
            f"The sandbox can reach only {hosts}, and only on port 443 (HTTPS); every other host and port fails, so "
            "installing packages from elsewhere will not work."
        )

    def _expected_hosts(self, handle: str) -> list[str]:
        hosts = self._hosts.get(handle)
        if hosts is None:
            # A sandbox made by another hook object: what it was created to reach is in its spec.
            timeout = self.patience(self._resolved()["request_timeout"])
            sandbox = self._call(
                "reading",
                handle,
                lambda c: c._stub.GetSandbox(
                    driver.get_request(workspace=self._workspace(), name=handle), timeout=timeout
                ),
            )
            rule = sandbox.sandbox.spec.policy.network_policies.get(driver.EGRESS_RULE)
            hosts = [endpoint.host for endpoint in rule.endpoints] if rule is not None else []
            self._hosts[handle] = hosts
        return hosts

    def _verify_policy(self, handle: str, when: str) -> None:
        """:raises SandboxTerminalError: after destroying the sandbox, if its policy is not the one asked for."""
        import grpc

        hosts = self._expected_hosts(handle)
        request = driver.config_request(workspace=self._workspace(), name=handle)
        try:
            config = self._stub().GetSandboxConfig(request, timeout=self.patience(self._resolved()["request_timeout"]))
        except Exception as err:
            if driver.status_code(err) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SandboxError(
                    f"Could not reach the OpenShell gateway to check the network policy of sandbox {handle} {when} "
                    f"({driver.describe(err)}); nothing was run. Try again."
                ) from err
            raise self._translate(err, "checking the policy of", handle) from err
        problem = driver.policy_problem(config, hosts)
        if problem:
            self._destroy_quietly(handle)
            raise SandboxTerminalError(
                f"The network policy of OpenShell sandbox {handle} is not the one it was created with ({when}): "
                f"{problem}. The sandbox was destroyed. Check the gateway's global policy and settings, which may "
                "override or widen a sandbox's own."
            )

    # -- lifecycle -----------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        hosts = hostname_allowlist(request.spec.allow_egress_to or [])
        settings = self._resolved()
        name = "airflow-" + request.name[-12:-1]
        spec = driver.sandbox_spec(
            image=settings["image"],
            cpu=settings["cpu"],
            memory=settings["memory"],
            env=dict(request.spec.env or {}),
            policy=driver.sandbox_policy(hosts, self.workdir),
        )
        workspace = self._workspace()
        labels = driver.labels(request.stamps, request.expires_at)
        self._call("creating", name, lambda c: c.create(workspace=workspace, spec=spec, name=name, labels=labels))
        self._hosts[name] = hosts
        try:
            self._wait_ready(name)
            self._verify_policy(name, "after it was created")
        except BaseException:
            self._destroy_quietly(name)
            raise
        log.info("Created OpenShell sandbox %s in workspace %s", name, workspace)
        return name

    def _wait_ready(self, handle: str) -> None:
        import grpc
        from openshell._proto import openshell_pb2

        deadline = time.monotonic() + self.patience(self._resolved()["ready_timeout"])
        phase = "PROVISIONING"
        while time.monotonic() < deadline:
            try:
                sandbox = self._client().get(handle, workspace=self._workspace())
            except Exception as err:
                if driver.status_code(err) not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._translate(err, "waiting for", handle) from err
            else:
                phase = openshell_pb2.SandboxPhase.Name(sandbox.phase).removeprefix("SANDBOX_PHASE_")
                if phase == "READY":
                    return
                if phase not in _NOT_READY:
                    raise SandboxTerminalError(f"OpenShell sandbox {handle} entered phase {phase} instead of READY.")
            time.sleep(self.poll_interval)
        raise SandboxTerminalError(
            f"OpenShell sandbox {handle} was not ready within {self._resolved()['ready_timeout']:g} seconds (last phase "
            f"{phase}); raise ready_timeout or check the gateway's compute driver."
        )

    def _destroy(self, handle: str) -> None:
        import grpc

        try:
            self._client().delete(handle, workspace=self._workspace(), allow_missing=True)
        except Exception as err:
            if driver.status_code(err) != grpc.StatusCode.NOT_FOUND:
                raise self._translate(err, "deleting", handle) from err
        self._hosts.pop(handle, None)

    def _destroy_quietly(self, handle: str) -> None:
        try:
            self._destroy(handle)
        except Exception:
            log.warning("Could not delete OpenShell sandbox %s; delete it by hand", handle, exc_info=True)

    def list_sandboxes(self) -> list[OpenShellSandboxInfo]:
        """
        List this provider's sandboxes in the workspace (by their ``managed-by`` label), with their stamps.

        :raises SandboxTerminalError: if the gateway cannot be reached.
        """
        selector = "=".join(driver.MANAGED_LABEL)
        refs = self._call(
            "listing", "(all)", lambda c: c.list_all(workspace=self._workspace(), label_selector=selector)
        )
        from openshell._proto import openshell_pb2

        return [
            OpenShellSandboxInfo(
                handle=ref.name,
                created_at=driver.number(ref.labels.get(driver.CREATED_LABEL)),
                expires_at=driver.number(ref.labels.get(driver.EXPIRES_LABEL)),
                phase=openshell_pb2.SandboxPhase.Name(ref.phase).removeprefix("SANDBOX_PHASE_"),
            )
            for ref in refs
        ]

    def sandbox_records(self) -> list[SandboxRecord]:
        """This provider's sandboxes in the workspace, with their phase, creation time and stamps (from their labels)."""
        selector = "=".join(driver.MANAGED_LABEL)
        refs = self._call(
            "listing", "(all)", lambda c: c.list_all(workspace=self._workspace(), label_selector=selector)
        )
        from openshell._proto import openshell_pb2

        records = []
        for ref in refs:
            if not self.handle_pattern.fullmatch(ref.name):
                continue
            stamps = driver.stamps_of(ref.labels)
            phase = openshell_pb2.SandboxPhase.Name(ref.phase).removeprefix("SANDBOX_PHASE_").lower()
            records.append(SandboxRecord(ref.name, stamps, phase, driver.number(ref.labels.get(driver.CREATED_LABEL))))
        return sorted(records, key=lambda r: r.handle)

    def remove_expired(self, *, now: float | None = None) -> list[str]:
        """
        Delete this provider's sandboxes past their lifetime, or in phase ERROR; return their handles.
        The gateway has no lifetime of its own, so run this on a schedule.

        :param now: the Unix time to judge expiry by; default the current time.
        """
        removed = []
        for info in self.list_sandboxes():
            if self.handle_pattern.fullmatch(info.handle) and (info.expired(now) or info.phase == "ERROR"):
                self.destroy(info.handle)
                removed.append(info.handle)
        if removed:
            log.info("Removed %d leftover OpenShell sandboxes: %s", len(removed), ", ".join(removed))
        return removed

    # -- commands ------------------------------------------------------------------------------------

    def _exec(self, handle: str, argv: list[str], *, stdin: bytes, deadline: float, on_stdout, on_stderr) -> int | None:
        """Run ``argv`` once; the stream is cancelled if a callback raises. Raises gRPC errors as they come."""
        request = driver.exec_request(
            workspace=self._workspace(), name=handle, argv=argv, stdin=stdin, workdir=self.workdir
        )
        call = self._stub().ExecSandbox(request, timeout=deadline)
        try:
            return driver.relay(call, on_stdout, on_stderr)
        finally:
            call.cancel()

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        import grpc

        self._verify_policy(handle, "before a command")
        argv = guest.run_session_argv(timeout, self.workdir)
        head = bytearray()

        def on_stderr(data: bytes) -> None:
            if len(head) < 512:
                head.extend(data[: 512 - len(head)])
            output.stderr(data)

        started = time.monotonic()
        for attempt in (1, 2):
            try:
                code = self._exec(
                    handle,
                    argv,
                    stdin=command.encode(),
                    deadline=timeout + self._resolved()["relay_grace"],
                    on_stdout=output.stdout,
                    on_stderr=on_stderr,
                )
                break
            except Exception as err:
                status = driver.status_code(err)
                if status == grpc.StatusCode.FAILED_PRECONDITION and attempt == 1:
                    self._wait_ready(handle)  # it never started: wait until the sandbox is ready, then once more
                    continue
                if status == grpc.StatusCode.DEADLINE_EXCEEDED:
                    log.warning("OpenShell stopped relaying sandbox %s past the deadline; destroying it", handle)
                    self._destroy_quietly(handle)
                    return RunOutcome(exit_code=-1, timed_out=True, sandbox_terminated=True)
                if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise SandboxError(_MAYBE_RAN.format(handle=handle, why=driver.describe(err))) from err
                raise self._translate(err, "running a command in", handle) from err
        elapsed = time.monotonic() - started
        if code is None:
            raise SandboxError(_MAYBE_RAN.format(handle=handle, why="the stream ended without an exit status"))
        guest.check_run_session(code, bytes(head), handle)
        self._verify_policy(handle, "after a command")
        return RunOutcome(exit_code=code, timed_out=code == guest.RUN_TIMEOUT_STATUS and elapsed >= timeout)

    # -- files: raw bytes over the exec stream -------------------------------------------------------

    def _file_exec(
        self, handle: str, argv: list[str], *, what: str, stdin: bytes = b"", on_stdout=None
    ) -> tuple[int, str]:
        """Run a file program under the file budget; return its status and stderr (bounded)."""
        import grpc

        err = bytearray()

        def on_stderr(data: bytes) -> None:
            if len(err) < 64 * 1024:
                err.extend(data)

        try:
            code = self._exec(
                handle, argv, stdin=stdin, deadline=FILE_OP_TIMEOUT, on_stdout=on_stdout or (lambda _: None),
                on_stderr=on_stderr,
            )  # fmt: skip
        except (SandboxError, SandboxFileTooLargeError):
            raise
        except Exception as caught:
            status = driver.status_code(caught)
            if status == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise SandboxError(f"{what} did not finish within {FILE_OP_TIMEOUT:g} seconds.") from caught
            if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise SandboxError(f"The gateway connection dropped while {what}; try again.") from caught
            if status is None:
                raise
            raise self._translate(caught, what + " in", handle) from caught
        if code is None:
            raise SandboxError(f"The gateway ended the stream while {what} without an exit status; try again.")
        return code, err.decode("utf-8", "replace")

    def _copy_out(
        self, handle: str, path: str, max_bytes: int, sink: Callable[[bytes], object], verb: str
    ) -> tuple[int, int]:
        """Stream the regular file ``path`` (at most ``max_bytes``) into ``sink``; return (reported size, bytes)."""
        handle = self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        check_path(path)
        copied = 0

        def on_stdout(data: bytes) -> None:
            nonlocal copied
            copied += len(data)
            if copied > max_bytes:
                raise SandboxFileTooLargeError(path, copied, max_bytes)
            sink(data)

        self._verify_policy(handle, f"before {verb} {path!r}")
        argv = ["/bin/sh", "-c", guest.program("file.sh"), "file.sh", path, str(int(max_bytes)), "cat"]
        code, err = self._file_exec(handle, argv, what=f"{verb} {path!r}", on_stdout=on_stdout)
        self._verify_policy(handle, f"after {verb} {path!r}")
        size = checked_size(SandboxExecResult(exit_code=code, stdout="", stderr=err), path, max_bytes, verb)
        return size, copied

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`; the bytes come raw over the exec stream."""
        parts: list[bytes] = []
        size, copied = self._copy_out(handle, path, max_bytes, parts.append, "reading")
        check_export_size(path, size, copied)
        return b"".join(parts)

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`; memory stays bounded by one relayed piece."""
        size, copied = self._copy_out(handle, path, max_bytes, stream.write, "exporting")
        check_export_size(path, size, copied)
        return copied

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """See :meth:`SandboxHook.import_file`: 768 KiB of stdin per exec into a temporary sibling, renamed at the end."""
        handle = self.check_handle(handle)
        check_path(path)
        write = guest.program("write.sh")
        what = f"writing {path!r}"
        self._verify_policy(handle, f"before writing {path!r}")

        def start() -> str:
            out = bytearray()
            code, err = self._file_exec(
                handle, ["/bin/sh", "-c", write, "write.sh", "start", path], what=what, on_stdout=out.extend
            )
            if code != 0 or not out.strip():
                raise write_step_error(path, err, "no temporary file")
            return out.decode().strip().splitlines()[-1]

        def fill(temp: str) -> int:
            total = 0
            while chunk := source.read(WRITE_CHUNK_BYTES):
                append = ["/bin/sh", "-c", 'cat >> "$1"', "append", temp]
                code, err = self._file_exec(handle, append, what=what, stdin=chunk)
                if code != 0:
                    raise write_step_error(path, err, "append failed")
                total += len(chunk)
            return total

        def commit(temp: str) -> None:
            code, err = self._file_exec(handle, ["/bin/sh", "-c", write, "write.sh", "commit", temp, path], what=what)
            if code != 0:
                raise write_step_error(path, err, "rename failed")

        total = write_through_temp(
            start=start,
            fill=fill,
            commit=commit,
            abort=lambda temp: self._file_exec(
                handle, ["/bin/sh", "-c", write, "write.sh", "abort", temp], what="cleaning up"
            ),
        )
        self._verify_policy(handle, f"after writing {path!r}")
        return total


#: The model-facing wording for a command whose fate is unknown.
_MAYBE_RAN = (
    "The connection to the OpenShell gateway broke while a command ran in sandbox {handle} ({why}), so it may or may "
    "not have run, and may have changed files. Check the sandbox's state before running it again."
)


#: The hook under the name the public guide uses.
OpenShellSandboxBackend = OpenShellSandboxHook
