"""
An OpenShell gateway for tests: an in-process ``grpc.server`` on loopback, built on the ``openshell``
SDK's own generated servicer, so the real ``SandboxClient`` talks real gRPC to it.

Each sandbox is a directory on the host; ``ExecSandbox`` really runs the requested argv in a
bubblewrap sandbox over it (``/sandbox`` and ``/tmp`` are the sandbox's own, the host's ``/usr`` and
``/etc`` read-only, no network), with the request's stdin, so stdout, stderr, exit codes and bytes
are real and stream as they are written. The double cannot filter egress by hostname, so every
sandbox is offline whatever its policy says; what the tests check is the policy the gateway was
asked for and reports back.

Faults the tests drive, all on :class:`FakeGateway`:

- ``fail_next(rpc, code, details)``: the next call of ``rpc`` aborts with that status;
- ``exec_faults``: what the next ``ExecSandbox`` calls do instead of finishing: ``Stall(after=n)``
  (stop relaying after n events and hold the stream until the client gives up), ``Unavailable(after=n)``
  (abort with UNAVAILABLE mid-stream), ``NoExit()`` (end the stream without an exit event);
- ``on_exec``: callables run as an exec starts (to change the policy while a command runs);
- ``on_create``: callables run on a new sandbox (to make the gateway apply another policy);
- ``drift(name, change)``: change what ``GetSandboxConfig`` reports for a sandbox from now on;
- ``vanish(name)``: the sandbox disappears behind the client's back (NOT_FOUND from then on);
- ``ready_after``: how many ``GetSandbox`` polls a new sandbox stays PROVISIONING; ``phase``: force one.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import timestamp_pb2
from openshell._proto import datamodel_pb2, openshell_pb2, openshell_pb2_grpc, sandbox_pb2

from pid_namespace import marked_processes

#: The longest sandbox name the gateway accepts.
NAME_LIMIT = 19
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_LABEL = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?")
#: Marks every process the double starts for a sandbox, so deleting it can find them all.
_OWNER_VAR = "FAKE_OPENSHELL_SANDBOX"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Stall:
    """Relay ``after`` events, then nothing: the stream stays open until the client's deadline."""

    after: int = 0


@dataclass
class Unavailable:
    """Relay ``after`` events, then abort the stream with UNAVAILABLE (the gateway lost its relay)."""

    after: int = 0


@dataclass
class NoExit:
    """Relay all output, then end the stream without an exit event."""


@dataclass
class FakeSandbox:
    id: str
    name: str
    workspace: str
    labels: dict[str, str]
    spec: openshell_pb2.SandboxSpec
    root: Path
    created: float
    polls_left: int
    phase: int | None = None
    config: sandbox_pb2.GetSandboxConfigResponse = field(default_factory=sandbox_pb2.GetSandboxConfigResponse)
    execs: list[openshell_pb2.ExecSandboxRequest] = field(default_factory=list)

    def message(self, phase: int) -> openshell_pb2.Sandbox:
        created = timestamp_pb2.Timestamp()
        created.FromNanoseconds(int(self.created * 1e9))
        return openshell_pb2.Sandbox(
            metadata=datamodel_pb2.ObjectMeta(
                id=self.id, name=self.name, workspace=self.workspace, labels=self.labels, created_time=created
            ),
            spec=self.spec,
            status=openshell_pb2.SandboxStatus(phase=phase, current_policy_version=self.config.version),
        )


class FakeGateway:
    """The gateway's state and the knobs tests turn; :meth:`start` serves it on ``self.endpoint``."""

    def __init__(self, root: Path, *, token: str | None = None) -> None:
        self.root = Path(root)
        self.token = token
        self.sandboxes: dict[tuple[str, str], FakeSandbox] = {}
        self.calls: list[tuple[str, object]] = []
        self.ready_after = 1
        self.exec_faults: list[Stall | Unavailable | NoExit] = []
        self.on_exec: list[Callable[[FakeSandbox], None]] = []
        self.on_create: list[Callable[[FakeSandbox], None]] = []
        self._failures: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
        self._lock = threading.RLock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    # -- serving --------------------------------------------------------------------------------

    def start(self, *, tls: tuple[bytes, bytes] | None = None) -> FakeGateway:
        """Serve on loopback; with ``tls`` (a PEM key and certificate), over TLS."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        openshell_pb2_grpc.add_OpenShellServicer_to_server(_Servicer(self), self._server)
        if tls is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            port = self._server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([tls]))
        self._server.start()
        self.endpoint = f"127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(10)
        for sandbox in list(self.sandboxes.values()):
            self._remove(sandbox)

    # -- knobs ----------------------------------------------------------------------------------

    def fail_next(self, rpc: str, code: grpc.StatusCode, details: str = "injected", times: int = 1) -> None:
        self._failures.setdefault(rpc, []).extend([(code, details)] * times)

    def sandbox(self, name: str, workspace: str | None = None) -> FakeSandbox:
        matches = [s for (ws, n), s in self.sandboxes.items() if n == name and workspace in (None, ws)]
        if not matches:
            raise KeyError(name)
        return matches[0]

    def drift(self, name: str, change: Callable[[sandbox_pb2.GetSandboxConfigResponse], None]) -> None:
        with self._lock:
            sandbox = self.sandbox(name)
            change(sandbox.config)
            sandbox.config.version += 1

    def vanish(self, name: str) -> None:
        with self._lock:
            self._remove(self.sandbox(name))

    def processes_of(self, sandbox: FakeSandbox) -> list[int]:
        """Pids of live processes the double started for ``sandbox`` (and their descendants)."""
        return marked_processes(f"{_OWNER_VAR}={sandbox.id}")

    # -- internals used by the servicer ------------------------------------------------------------

    def check(self, rpc: str, request: object, context: grpc.ServicerContext) -> None:
        self.calls.append((rpc, request))
        if self.token is not None:
            metadata = dict(context.invocation_metadata())
            if metadata.get("authorization") != f"Bearer {self.token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        pending = self._failures.get(rpc)
        if pending:
            code, details = pending.pop(0)
            context.abort(code, details)

    def lookup(self, workspace: str, name: str, context: grpc.ServicerContext) -> FakeSandbox:
        sandbox = self.sandboxes.get((workspace, name))
        if sandbox is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {name!r} not found in workspace {workspace!r}")
        return sandbox

    def create(self, request: openshell_pb2.CreateSandboxRequest, context) -> FakeSandbox:
        workspace = request.workspace_scope.workspace
        name = request.name or f"sandbox-{uuid.uuid4().hex[:10]}"
        if not workspace:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "workspace is required")
        if len(name) > NAME_LIMIT or not _NAME.fullmatch(name):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sandbox name {name!r} must be at most {NAME_LIMIT} lowercase letters, digits and hyphens",
            )
        for key, value in request.labels.items():
            if not key or len(key) > 63 or len(value) > 63 or not _LABEL.fullmatch(key) or not _LABEL.fullmatch(value):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"label {key!r}={value!r} is not a valid label")
        with self._lock:
            if (workspace, name) in self.sandboxes:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"sandbox {name!r} already exists")
            sandbox_id = uuid.uuid4().hex
            root = self.root / sandbox_id
            for part in ("sandbox", "tmp"):
                (root / part).mkdir(parents=True)
            (root / "tmp").chmod(0o1777)
            sandbox = FakeSandbox(
                id=sandbox_id,
                name=name,
                workspace=workspace,
                labels=dict(request.labels),
                spec=openshell_pb2.SandboxSpec.FromString(request.spec.SerializeToString()),
                root=root,
                created=time.time(),
                polls_left=self.ready_after,
            )
            sandbox.config = _effective_config(sandbox)
            for hook in self.on_create:
                hook(sandbox)
            self.sandboxes[(workspace, name)] = sandbox
        return sandbox

    def phase_of(self, sandbox: FakeSandbox) -> int:
        if sandbox.phase is not None:
            return sandbox.phase
        if sandbox.polls_left > 0:
            sandbox.polls_left -= 1
            return openshell_pb2.SANDBOX_PHASE_PROVISIONING
        return openshell_pb2.SANDBOX_PHASE_READY

    def _remove(self, sandbox: FakeSandbox) -> None:
        self.sandboxes.pop((sandbox.workspace, sandbox.name), None)
        for _ in range(50):
            pids = self.processes_of(sandbox)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        shutil.rmtree(sandbox.root, ignore_errors=True)


def _effective_config(sandbox: FakeSandbox) -> sandbox_pb2.GetSandboxConfigResponse:
    """What a gateway reports for a sandbox created with its own policy: that policy, admitted."""
    policy = sandbox.spec.policy
    return sandbox_pb2.GetSandboxConfigResponse(
        policy=policy,
        version=1,
        policy_hash=hashlib.sha256(policy.SerializeToString(deterministic=True)).hexdigest(),
        policy_source=sandbox_pb2.POLICY_SOURCE_SANDBOX,
        workspace=sandbox.workspace,
        configuration_admitted=True,
        configuration_instance_id=uuid.uuid4().hex,
    )


def _bwrap_argv(sandbox: FakeSandbox, request: openshell_pb2.ExecSandboxRequest) -> list[str]:
    env = {"PATH": _PATH, "HOME": "/sandbox", **sandbox.spec.environment, **request.environment}
    argv = [
        "bwrap", "--die-with-parent", "--unshare-user", "--uid", "0", "--gid", "0",
        "--unshare-net", "--unshare-ipc", "--unshare-uts", "--cap-drop", "ALL",
        "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
        "--proc", "/proc", "--dev", "/dev",
        "--bind", str(sandbox.root / "sandbox"), "/sandbox", "--bind", str(sandbox.root / "tmp"), "/tmp",
        "--chdir", request.workdir or "/sandbox", "--clearenv",
    ]  # fmt: skip
    for key, value in {**env, _OWNER_VAR: sandbox.id}.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *request.command]


class _Servicer(openshell_pb2_grpc.OpenShellServicer):
    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway

    def Health(self, request, context):
        self.gateway.check("Health", request, context)
        return openshell_pb2.HealthResponse(status=openshell_pb2.SERVICE_STATUS_HEALTHY, version="fake")

    def CreateSandbox(self, request, context):
        self.gateway.check("CreateSandbox", request, context)
        sandbox = self.gateway.create(request, context)
        return openshell_pb2.SandboxResponse(sandbox=sandbox.message(openshell_pb2.SANDBOX_PHASE_PROVISIONING))

    def GetSandbox(self, request, context):
        self.gateway.check("GetSandbox", request, context)
        sandbox = self.gateway.lookup(request.workspace_scope.workspace, request.name, context)
        return openshell_pb2.SandboxResponse(sandbox=sandbox.message(self.gateway.phase_of(sandbox)))

    def ListSandboxes(self, request, context):
        self.gateway.check("ListSandboxes", request, context)
        wanted = dict(part.split("=", 1) for part in request.label_selector.split(",") if part.strip() and "=" in part)
        matches = [
            s
            for (workspace, _), s in sorted(self.gateway.sandboxes.items())
            if workspace == request.workspace_scope.workspace
            and all(s.labels.get(k.strip()) == v.strip() for k, v in wanted.items())
        ]
        start = int(request.page_token or 0)
        size = request.page_size or 100
        page = matches[start : start + size]
        token = str(start + size) if start + size < len(matches) else ""
        phase = openshell_pb2.SANDBOX_PHASE_READY
        return openshell_pb2.ListSandboxesResponse(
            sandboxes=[s.message(s.phase or phase) for s in page], next_page_token=token
        )

    def DeleteSandbox(self, request, context):
        self.gateway.check("DeleteSandbox", request, context)
        sandbox = self.gateway.sandboxes.get((request.workspace_scope.workspace, request.name))
        if sandbox is None:
            if request.allow_missing:
                return openshell_pb2.DeleteSandboxResponse(outcome=openshell_pb2.DELETION_OUTCOME_ALREADY_ABSENT)
            context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.name!r} not found")
        with self.gateway._lock:
            self.gateway._remove(sandbox)
        return openshell_pb2.DeleteSandboxResponse(
            outcome=openshell_pb2.DELETION_OUTCOME_COMPLETED, sandbox_id=sandbox.id
        )

    def GetSandboxConfig(self, request, context):
        self.gateway.check("GetSandboxConfig", request, context)
        sandbox = self.gateway.lookup(request.workspace_scope.workspace, request.name, context)
        with self.gateway._lock:
            return sandbox_pb2.GetSandboxConfigResponse.FromString(sandbox.config.SerializeToString())

    def ExecSandbox(self, request, context) -> Iterator[openshell_pb2.ExecSandboxEvent]:
        self.gateway.check("ExecSandbox", request, context)
        sandbox = self.gateway.lookup(request.workspace_scope.workspace, request.sandbox, context)
        if self.gateway.phase_of(sandbox) != openshell_pb2.SANDBOX_PHASE_READY:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"sandbox {sandbox.name!r} is not ready")
        sandbox.execs.append(request)
        fault = self.gateway.exec_faults.pop(0) if self.gateway.exec_faults else None
        for hook in self.gateway.on_exec:
            hook(sandbox)
        yield from _Exec(sandbox, request, context).events(fault)


class _Exec:
    """One running command: its process, its output pumped into a queue, and how it ends."""

    def __init__(self, sandbox: FakeSandbox, request, context) -> None:
        self.context = context
        self.proc = subprocess.Popen(
            _bwrap_argv(sandbox, request),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.events_q: queue.Queue = queue.Queue()
        self.open_streams = 2
        threading.Thread(target=self._feed, args=(bytes(request.stdin),), daemon=True).start()
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            threading.Thread(target=self._pump, args=(name, pipe), daemon=True).start()
        timeout = (
            request.execution_timeout.ToTimedelta().total_seconds() if request.HasField("execution_timeout") else None
        )
        self.deadline = None if not timeout else time.monotonic() + timeout
        context.add_callback(self.hang_up)

    def _feed(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
        except BrokenPipeError:
            pass
        finally:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def _pump(self, name: str, pipe) -> None:
        fd = pipe.fileno()
        while chunk := os.read(fd, 65536):
            self.events_q.put((name, chunk))
        self.events_q.put((name, None))

    def hang_up(self) -> None:
        """The client went away or the gateway ended the call: hang up the session, then kill it."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGHUP)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def events(self, fault) -> Iterator[openshell_pb2.ExecSandboxEvent]:
        relayed = 0
        try:
            while self.open_streams:
                try:
                    name, chunk = self.events_q.get(timeout=0.05)
                except queue.Empty:
                    if self.deadline is not None and time.monotonic() > self.deadline:
                        self.hang_up()
                        self.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "execution timeout exceeded")
                    if not self.context.is_active():
                        return
                    continue
                if chunk is None:
                    self.open_streams -= 1
                    continue
                self._maybe_fail(fault, relayed)
                yield _event(name, chunk)
                relayed += 1
            code = self.proc.wait()
            if isinstance(fault, NoExit):
                return
            self._maybe_fail(fault, relayed)
            yield _event("exit", code)
        finally:
            self.hang_up()
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()

    def _maybe_fail(self, fault, relayed: int) -> None:
        """Apply a Stall or Unavailable fault once ``fault.after`` events went out."""
        if not isinstance(fault, (Stall, Unavailable)) or relayed < fault.after:
            return
        if isinstance(fault, Unavailable):
            self.context.abort(grpc.StatusCode.UNAVAILABLE, "connection to the sandbox supervisor was reset")
        while self.context.is_active():
            time.sleep(0.05)
        self.context.abort(grpc.StatusCode.CANCELLED, "the client gave up")


def _event(name: str, payload) -> openshell_pb2.ExecSandboxEvent:
    if name == "exit":
        return openshell_pb2.ExecSandboxEvent(exit=openshell_pb2.ExecSandboxExit(exit_code=payload))
    if name == "stdout":
        return openshell_pb2.ExecSandboxEvent(stdout=openshell_pb2.ExecSandboxStdout(data=payload))
    return openshell_pb2.ExecSandboxEvent(stderr=openshell_pb2.ExecSandboxStderr(data=payload))
