"""
The worker side of the Modal stand-in (:mod:`modal_server`): its sandboxes, and the task command
router that runs their commands.

A sandbox is a directory on the host. Every command runs in bubblewrap with that directory as its
root, the host's ``/usr`` and ``/etc`` read-only over it, a ``python`` on ``PATH`` as the
``python:*`` images have, the filesystem helper at ``/__modal/.bin/modal-sandbox-fs-tools``, its own
user, PID and network namespaces (no network at all), ``--clearenv`` and then only a base ``PATH``,
``HOME`` and ``LANG``, the sandbox's env and the exec's env, in that order. Every command of a sandbox
runs in the sandbox's one user and PID namespace, which a holder process keeps from the first command
to the sandbox's end, as the commands of a container share it: what a command started in its own
process group ends with it (killing the command's bubblewrap's group kills them), what it started in a
session of its own (``setsid``) lives on until the sandbox ends, and ending the sandbox ends them all.

What the router does the way Modal does it, because the provider depends on it:

- output streams as it is written, from any offset, until the command's end;
- at ``timeout_secs`` the command and all it started are killed, and its exit status is never
  reported, so the SDK's own deadline makes ``wait()`` return -1;
- a command killed by a signal ``N`` exits ``128 + N``;
- once the sandbox is terminated or its lifetime is over, its commands are killed, their waits
  answer NOT_FOUND, and nothing new starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sandbox_fs_tools
from grpclib import GRPCError, Status
from grpclib.server import Stream
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as router_pb2
from modal_proto.task_command_router_grpc import TaskCommandRouterBase
from modal_wire import Servicer, refuse_the_rest, shaped

from pid_namespace import process_state, uptime

#: Where the SDK's filesystem API expects its helper inside a sandbox.
FS_TOOLS_PATH = "/__modal/.bin/modal-sandbox-fs-tools"
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
#: The folder (beside the sandboxes' roots) that becomes /usr/local/bin, where python:* images keep ``python``.
IMAGE_BIN = ".image-bin"
#: Largest piece of output one ``TaskExecStdioRead`` message carries.
STDIO_CHUNK = 64 * 1024
_HERE = Path(__file__).resolve().parent


@dataclass
class NetworkPolicy:
    """What a sandbox's outbound network was asked to be: all blocked, or an allowlist, or open."""

    blocked: bool
    allowlist: bool
    cidrs: list[str]
    domains: list[str]


@dataclass
class ExecRecord:
    """One command: what was asked for, its output so far and how it ended."""

    exec_id: str
    argv: list[str]
    workdir: str
    env: dict[str, str]
    timeout_secs: int | None
    process: asyncio.subprocess.Process | None = None
    output: dict[int, bytearray] = field(default_factory=lambda: {1: bytearray(), 2: bytearray()})
    closed: set[int] = field(default_factory=set)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    exit_code: int | None = None
    timed_out: bool = False
    stdin_written: int = 0
    stdin_closed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class SandboxRecord:
    """One sandbox as the stand-in knows it; tests read what was asked for from here."""

    sandbox_id: str
    version: int
    app_id: str
    name: str
    definition: api_pb2.Sandbox
    image_tag: str
    env: dict[str, str]
    network: NetworkPolicy
    tags: dict[str, str]
    created_at: float
    root: Path
    task_id: str
    router_jwt: str
    sandbox_token: str
    result: api_pb2.GenericResult | None = None
    execs: dict[str, ExecRecord] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    lifetime: asyncio.TimerHandle | None = None
    #: The process that holds the sandbox's namespaces, and descriptors of its user and PID namespaces.
    holder: asyncio.subprocess.Process | None = None
    namespaces: tuple[int, int] | None = None
    #: Held while the holder starts, so that two first commands at once make one holder.
    holding: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def workdir(self) -> str:
        return self.definition.workdir or "/"

    @property
    def commands(self) -> list[list[str]]:
        """The argv of every command run in the sandbox, oldest first."""
        return [record.argv for record in self.execs.values()]

    def path(self, inside: str) -> Path:
        """The host path of ``inside``, an absolute path in the sandbox."""
        return self.root / inside.lstrip("/")

    def handle_metadata(self) -> api_pb2.SandboxHandleMetadata:
        return shaped(api_pb2.SandboxHandleMetadata, result=self.result, app_id=self.app_id)

    def info(self) -> api_pb2.SandboxInfo:
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in self.tags.items()]
        return shaped(
            api_pb2.SandboxInfo,
            id=self.sandbox_id,
            created_at=self.created_at,
            app_id=self.app_id,
            name=self.name,
            tags=tags,
            task_info=api_pb2.TaskInfo(id=self.task_id, result=self.result),
            metadata=self.handle_metadata(),
        )


def running_task(sandboxes: dict[str, SandboxRecord], task_id: str) -> SandboxRecord:
    """The sandbox whose task is ``task_id``; NOT_FOUND once it has ended, as Modal's router answers."""
    record = next((r for r in sandboxes.values() if r.task_id == task_id), None)
    if record is None or record.result is not None:
        raise GRPCError(Status.NOT_FOUND, f"Task {task_id} not found")
    return record


def secret_env(sources: Any, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """
    The variables of ``sources``, in order: ``SecretSource`` messages (inline, or a secret's id) or
    plain secret ids.
    """
    env: dict[str, str] = {}
    for source in sources:
        secret_id = source if isinstance(source, str) else source.secret_id
        if not isinstance(source, str) and source.HasField("env"):
            env.update(source.env.contents)
        elif secret_id in secrets:
            env.update(secrets[secret_id])
        else:
            raise GRPCError(Status.NOT_FOUND, f"Secret {secret_id} not found")
    return env


def provision(record: SandboxRecord) -> None:
    """Lay out a new sandbox's root: the directories an image has, and its working directory."""
    for name in ("bin", "lib", "lib64", "sbin"):
        (record.root / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f"usr/{name}", record.root / name)
    image_bin = record.root.parent / IMAGE_BIN
    if not image_bin.exists():
        image_bin.mkdir(parents=True)
        for name in ("python", "python3"):
            os.symlink("/usr/bin/python3", image_bin / name)
    for name in ("tmp", "root", "__modal/.bin"):
        record.path(name).mkdir(parents=True, exist_ok=True)
    record.path("tmp").chmod(0o1777)
    record.path(record.workdir).mkdir(parents=True, exist_ok=True)


async def end(record: SandboxRecord, status: int) -> None:
    """End ``record`` with ``status`` (terminated or timed out); kill what runs in it. Idempotent."""
    if record.result is not None:
        await record.ended.wait()
        return
    exit_code = 137 if status == api_pb2.GenericResult.GENERIC_STATUS_TERMINATED else 124
    record.result = api_pb2.GenericResult(status=status, exitcode=exit_code)  # from now on nothing starts
    if record.lifetime is not None:
        record.lifetime.cancel()
    for command in record.execs.values():
        _kill(command)
    await _release(record)
    await asyncio.gather(*(command.done.wait() for command in record.execs.values() if command.process))
    record.ended.set()  # whoever waits for the end sees it once nothing runs any more


def _kill(command: ExecRecord) -> None:
    if command.process is not None and command.process.returncode is None:
        try:
            os.killpg(command.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _root_argv(record: SandboxRecord) -> list[str]:
    return [
        "--bind", str(record.root), "/",
        "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc",
        "--ro-bind", str(record.root.parent / IMAGE_BIN), "/usr/local/bin",
        "--ro-bind", str(_HERE / "sandbox_fs_tools.py"), FS_TOOLS_PATH,
        "--proc", "/proc", "--dev", "/dev",
    ]  # fmt: skip


async def _hold(record: SandboxRecord) -> tuple[int, int]:
    """
    The sandbox's user and PID namespaces, made by a holder process on first use.

    They are returned once they are ready to join: bubblewrap reports the holder's pid (``--info-fd``)
    before the holder has written its user namespace's uid and gid maps, and a command's bubblewrap
    that joins the namespace in that moment runs with no uid, so the kernel refuses the credentials
    it sends ("Can't send pid: Invalid argument") and the command exits 1. The holder's own command
    says ``ready`` on its stdout, which it can only do once bubblewrap has set the namespace up.
    """
    async with record.holding:
        if record.namespaces is not None:
            return record.namespaces
        read, write = os.pipe()
        try:
            record.holder = await asyncio.create_subprocess_exec(
                "bwrap", "--die-with-parent", "--unshare-user", "--uid", "0", "--gid", "0", "--unshare-pid",
                "--unshare-net", "--info-fd", str(write), *_root_argv(record),
                "--", "sh", "-c", "echo ready && exec sleep infinity",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                pass_fds=(write,), start_new_session=True,
            )  # fmt: skip
            os.close(write)
            write = -1
            info = await asyncio.get_running_loop().run_in_executor(None, _read_all, read)
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
        assert record.holder.stdout is not None
        said = await record.holder.stdout.readline()
        if said != b"ready\n":
            raise GRPCError(Status.INTERNAL, f"the sandbox's namespace holder did not start (it said {said!r})")
        child = json.loads(info)["child-pid"]
        record.namespaces = (
            os.open(f"/proc/{child}/ns/user", os.O_RDONLY),
            os.open(f"/proc/{child}/ns/pid", os.O_RDONLY),
        )
        return record.namespaces


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data


async def _release(record: SandboxRecord) -> None:
    """End the holder, and with its namespace every process left in the sandbox."""
    if record.holder is not None and record.holder.returncode is None:
        try:
            os.killpg(record.holder.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        await record.holder.wait()
    for fd in record.namespaces or ():
        os.close(fd)
    record.namespaces = None


def bwrap_argv(record: SandboxRecord, command: ExecRecord) -> list[str]:
    """
    The command's bubblewrap, which joins the holder's namespaces: it ends with them (the holder is
    the one bound to the stand-in's life), so it has no ``--die-with-parent`` of its own. With
    ``--pidns`` that option kills the command outright when it loses a race: bubblewrap forks into the
    namespace through an intermediate process that exits at once, and the program, having set its
    parent-death signal to SIGKILL just before its exec, gets it when that process exits after all
    (a machine under load). That was the SIGKILL (exit 137) "not sent by the stand-in".
    """
    user, pid = record.namespaces or (-1, -1)
    argv = [
        "bwrap", "--userns", str(user), "--pidns", str(pid), "--uid", "0", "--gid", "0",
        "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "modal", *_root_argv(record),
        "--chdir", command.workdir, "--clearenv",
    ]  # fmt: skip
    for key, value in command.env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *command.argv]


class Router(Servicer, TaskCommandRouterBase):
    """The task command router: starting commands, their output, stdin and exit status."""

    def authorize(self, rpc: str, request: Any, metadata: dict[str, str]) -> None:
        task_id = getattr(request, "task_id", None) or getattr(getattr(request, "start", None), "task_id", "")
        record = running_task(self.server.sandboxes, task_id)
        if metadata.get("authorization") != f"Bearer {record.router_jwt}":
            raise GRPCError(Status.UNAUTHENTICATED, "missing or wrong router token")

    def command(self, request: Any) -> tuple[SandboxRecord, ExecRecord]:
        """The sandbox and the command a request names (by task id and exec id)."""
        record = running_task(self.server.sandboxes, request.task_id)
        command = record.execs.get(request.exec_id)
        if command is None:
            raise GRPCError(Status.NOT_FOUND, f"Exec {request.exec_id} not found")
        return record, command

    async def TaskExecStart(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecStart")
        record = running_task(self.server.sandboxes, request.task_id)
        if request.exec_id not in record.execs:  # the exec id is the idempotency key
            command = ExecRecord(
                exec_id=request.exec_id,
                argv=list(request.command_args),
                workdir=request.workdir if request.HasField("workdir") else record.workdir,
                env={**BASE_ENV, **record.env, **self.exec_env(request)},
                timeout_secs=request.timeout_secs if request.HasField("timeout_secs") else None,
            )
            self.check_helper(command.argv)
            record.execs[request.exec_id] = command
            await start(record, command)
        await self.finish(stream, "TaskExecStart", router_pb2.TaskExecStartResponse())

    def exec_env(self, request: Any) -> dict[str, str]:
        """The exec's own variables: its secret sources (older SDKs: secret ids and an ``env`` map)."""
        fields = request.DESCRIPTOR.fields_by_name
        if "secret_sources" in fields:
            return secret_env(request.secret_sources, self.server.secrets)
        return {**secret_env(list(request.secret_ids), self.server.secrets), **dict(request.env)}

    def check_helper(self, argv: list[str]) -> None:
        """Record a filesystem helper operation the stand-in's helper does not implement."""
        if argv[:1] != [FS_TOOLS_PATH] or len(argv) != 2:
            return
        operation = next(iter(json.loads(argv[1])), "")
        if operation not in sandbox_fs_tools.OPERATIONS:
            self.server.unimplemented.append(f"modal-sandbox-fs-tools {operation}")

    async def TaskExecStdioRead(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecStdioRead")
        _, command = self.command(request)
        fd = 1 if request.file_descriptor == router_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT else 2
        offset = request.offset
        while True:
            async with command.changed:
                await command.changed.wait_for(lambda at=offset: len(command.output[fd]) > at or fd in command.closed)
                piece = bytes(command.output[fd][offset : offset + STDIO_CHUNK])
            if not piece:
                return
            offset += len(piece)
            await stream.send_message(router_pb2.TaskExecStdioReadResponse(data=piece))

    async def TaskExecWait(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecWait")
        record, command = self.command(request)
        await command.done.wait()
        response = await self.exit_status(record, command, router_pb2.TaskExecWaitResponse)
        await self.finish(stream, "TaskExecWait", response)

    async def TaskExecPoll(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecPoll")
        record, command = self.command(request)
        if not command.done.is_set() or command.timed_out:
            response = router_pb2.TaskExecPollResponse()
        else:
            response = await self.exit_status(record, command, router_pb2.TaskExecPollResponse)
        await self.finish(stream, "TaskExecPoll", response)

    async def exit_status(self, record: SandboxRecord, command: ExecRecord, response: type) -> Any:
        """The exit status of a finished command; never for one killed at its deadline."""
        if command.timed_out and record.result is None:
            await record.ended.wait()  # held until the client's own deadline gives up on it
        if record.result is not None:  # the sandbox ended, and its commands with it
            raise GRPCError(Status.NOT_FOUND, f"Task {record.task_id} not found")
        return response(code=command.exit_code)

    async def TaskExecStdinWriteStream(self, stream: Stream) -> None:
        first = await self.begin(stream, "TaskExecStdinWriteStream")
        _, command = self.command(first.start)
        offset = first.start.offset
        async for message in stream:
            kind = message.WhichOneof("payload")
            if kind == "data":
                await write_stdin(command, offset, message.data, eof=False)
                offset += len(message.data)
            elif kind == "end":
                await write_stdin(command, offset, b"", eof=True)
        await self.finish(stream, "TaskExecStdinWriteStream", router_pb2.TaskExecStdinWriteStreamResponse())

    async def TaskExecStdinWrite(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecStdinWrite")
        _, command = self.command(request)
        await write_stdin(command, request.offset, request.data, eof=request.eof)
        await self.finish(stream, "TaskExecStdinWrite", router_pb2.TaskExecStdinWriteResponse())

    async def TaskExecStdinStatus(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskExecStdinStatus")
        _, command = self.command(request)
        response = router_pb2.TaskExecStdinStatusResponse(
            num_bytes_written=command.stdin_written, closed=command.stdin_closed
        )
        await self.finish(stream, "TaskExecStdinStatus", response)


refuse_the_rest(Router, TaskCommandRouterBase)


async def start(record: SandboxRecord, command: ExecRecord) -> None:
    """Start ``command`` in ``record``: pump its output, kill it at its deadline, note how it ended."""
    namespaces = await _hold(record)
    command.process = await asyncio.create_subprocess_exec(
        *bwrap_argv(record, command),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=namespaces,
        start_new_session=True,
    )
    loop = asyncio.get_running_loop()
    deadline = None
    if command.timeout_secs:
        deadline = loop.call_later(command.timeout_secs, _at_deadline, command)
    pumps = [
        asyncio.ensure_future(_pump(command, 1, command.process.stdout)),
        asyncio.ensure_future(_pump(command, 2, command.process.stderr)),
    ]

    async def reap() -> None:
        code = await command.process.wait()
        await asyncio.gather(*pumps)
        if deadline is not None:
            deadline.cancel()
        command.exit_code = 128 - code if code < 0 else code
        if command.exit_code == 128 + signal.SIGKILL and not command.timed_out and record.result is None:
            _note_outside_kill(record, command)
        command.done.set()

    asyncio.ensure_future(reap())


def _note_outside_kill(record: SandboxRecord, command: ExecRecord) -> None:
    """
    Say on stderr that a command of a live sandbox ended by a SIGKILL the stand-in did not send: whether
    its namespace's holder still lives tells a namespace that ended whole from a command killed alone.
    """
    holder = record.holder
    state = "never started"
    if holder is not None:
        letter = process_state(holder.pid) or "gone"
        state = f"pid {holder.pid}, exit status {holder.returncode}, process state {letter}"
    print(
        f"modal stand-in: at {uptime()} s of uptime, command {command.argv[:2]} (pid {command.process.pid}) in "
        f"sandbox {record.sandbox_id} ended by SIGKILL, not sent by the stand-in (the command itself, or a process outside); the holder: {state}; "
        f"its stderr: {bytes(command.output[2][-300:])!r}",
        file=sys.stderr,
    )


async def write_stdin(command: ExecRecord, offset: int, data: bytes, *, eof: bool) -> None:
    """
    Write ``data``, which starts at byte ``offset`` of the command's stdin, then close it if ``eof``.
    What was already written is skipped (a retried write); a gap is refused.
    """
    if offset > command.stdin_written:
        raise GRPCError(
            Status.FAILED_PRECONDITION, f"stdin offset {offset} is past the {command.stdin_written} written"
        )
    pipe = command.process.stdin if command.process else None
    fresh = data[command.stdin_written - offset :]
    try:
        if fresh and pipe is not None and not command.stdin_closed:
            pipe.write(fresh)
            await pipe.drain()
            command.stdin_written += len(fresh)
        if eof and pipe is not None and not command.stdin_closed:
            pipe.close()
            command.stdin_closed = True
    except (BrokenPipeError, ConnectionResetError):
        raise GRPCError(Status.FAILED_PRECONDITION, "the command stopped reading its stdin") from None


def _at_deadline(command: ExecRecord) -> None:
    command.timed_out = True
    _kill(command)


async def _pump(command: ExecRecord, fd: int, pipe: Any) -> None:
    while chunk := await pipe.read(STDIO_CHUNK):
        async with command.changed:
            command.output[fd] += chunk
            command.changed.notify_all()
    async with command.changed:
        command.closed.add(fd)
        command.changed.notify_all()
