"""
A Modal control plane for tests: a grpclib server on loopback that the real ``modal`` SDK talks to
through ``MODAL_SERVER_URL``, built on the SDK's own generated servicers.

One port serves both services the SDK reaches: the control plane (``modal_proto.api_grpc.ModalClientBase``:
apps, images, secrets, sandboxes, tags, the auth token) and the task command router
(``modal_proto.task_command_router_grpc.TaskCommandRouterBase``), which the SDK is sent to for
``exec`` and, through a helper run by ``exec``, for ``Sandbox.filesystem``. Both the V1 (``Sandbox*``)
and the V2 (``Sandbox*V2``) RPCs are served: the SDK picks V2 by default and V1 for a sandbox with a GPU.

Each sandbox is a directory on the host that bubblewrap makes the root of every command it runs
(see :mod:`modal_worker`): the host's ``/usr`` and ``/etc`` read-only, everything else the sandbox's
own, and no network at all whatever was asked for; what was asked for is recorded
(:attr:`SandboxRecord.network`). Modal's semantics that the provider depends on are kept: a command
sees the sandbox's and the exec's env over a bare environment; at its deadline it is killed with
everything it started and reports no status, so the SDK answers -1; a terminated or expired sandbox
runs nothing more, and its status reads 137 (terminated) or 124 (lifetime over).

Every RPC of the installed SDK that is not served here answers UNIMPLEMENTED with its name and is
recorded in :attr:`ModalServer.unimplemented`; :meth:`ModalServer.check_wire` (run after every test
by the ``modal_server`` fixture) fails naming each one, so an SDK release that moves the hook's
calls to other RPCs fails the tests clearly instead of hanging.

Credentials: control-plane calls must carry a token pair from :attr:`ModalServer.tokens` (else
UNAUTHENTICATED); V2 calls also the short-lived token of ``AuthTokenGet``; router calls the bearer
token handed out for that sandbox's task.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import secrets
import shutil
import string
import threading
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import modal_worker
import pytest
from google.protobuf import empty_pb2
from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.server import Server, Stream
from modal_proto import api_pb2
from modal_proto.api_grpc import ModalClientBase
from modal_wire import Call, Fault, Servicer, refuse_the_rest, shaped
from modal_worker import NetworkPolicy, SandboxRecord

#: Token pair every test connection and the worker configuration use, unless a test sets others.
TOKEN = ("ak-standin-token", "as-standin-secret")
#: Sandboxes per page of ``SandboxList``; small, so the SDK's paging is exercised.
LIST_PAGE = 3
_ID_CHARS = string.ascii_letters + string.digits


@dataclass
class App:
    app_id: str
    name: str
    environment: str


@dataclass
class Image:
    image_id: str
    tag: str
    built: bool = False


class _Server(Server):
    """grpclib's server, which also keeps each open connection's transport, so that a stop can cut them."""

    def __init__(self, handlers: Any) -> None:
        super().__init__(handlers)
        self.transports: set[asyncio.BaseTransport] = set()

    def _protocol_factory(self) -> Any:
        protocol = super()._protocol_factory()
        made, lost = protocol.connection_made, protocol.connection_lost
        opened: list[asyncio.BaseTransport] = []

        def connection_made(transport: asyncio.BaseTransport) -> None:
            opened.append(transport)
            self.transports.add(transport)
            made(transport)

        def connection_lost(exc: Exception | None) -> None:
            self.transports.difference_update(opened)
            lost(exc)

        protocol.connection_made, protocol.connection_lost = connection_made, connection_lost
        return protocol


class ModalServer:
    """The stand-in's state and the knobs tests turn; :meth:`start` serves it on :attr:`url`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tokens: set[tuple[str, str]] = {TOKEN}
        self.calls: list[Call] = []
        self.unimplemented: list[str] = []
        self.faults: list[Fault] = []
        self.apps: dict[tuple[str, str], App] = {}
        self.images: dict[str, Image] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.auth_tokens: set[str] = set()
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._seq = itertools.count(1)
        self._lock = threading.RLock()

    # -- serving ---------------------------------------------------------------------------------

    def start(self, *, control_plane: type | None = None, router: type | None = None) -> ModalServer:
        """Serve on a free loopback port; ``control_plane``/``router`` replace the servicer classes."""
        control_plane = control_plane or ControlPlane
        router = router or modal_worker.Router

        async def serve() -> None:
            self._server = _Server([control_plane(self), router(self)])
            await self._server.start("127.0.0.1", 0)
            port = self._server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="modal-standin", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return self

    def stop(self) -> None:
        """End every sandbox's commands, stop serving and join the server's thread."""
        if self.loop is None:
            return
        for record in list(self.sandboxes.values()):
            self.run(modal_worker.end(record, api_pb2.GenericResult.GENERIC_STATUS_TERMINATED))

        async def close() -> None:
            if self._server is not None:
                self._server.close()
                # From Python 3.12 on, asyncio's wait_closed also waits for the open connections, and the
                # SDK's client keeps its channel open past the test: cut them, as a server going away does
                # (waiting them out cost 2 s a test on 3.12). The bound stays for a connection still opening.
                for transport in list(self._server.transports):
                    transport.abort()
                try:
                    await asyncio.wait_for(self._server.wait_closed(), 2)
                except TimeoutError:
                    pass

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self.loop.close()
        self.loop = None

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run ``coro`` on the server's loop from a test's thread and return its result."""
        assert self.loop is not None, "the stand-in is not running"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- what tests read and turn -----------------------------------------------------------------

    def requests(self, rpc: str) -> list[Any]:
        """The requests of every call of ``rpc`` so far, oldest first."""
        return [call.request for call in self.calls if call.rpc == rpc]

    def count(self, *rpcs: str) -> int:
        return sum(1 for call in self.calls if call.rpc in rpcs)

    def running_commands(self) -> dict[str, list[str]]:
        """The exec ids of the commands still running, per sandbox."""
        return {
            sandbox_id: [c.exec_id for c in record.execs.values() if not c.done.is_set()]
            for sandbox_id, record in self.sandboxes.items()
        }

    def fail_next(self, rpc: str, status: Status, message: str = "injected", *, times: int = 1, after: bool = False):
        """Make the next ``times`` calls of ``rpc`` fail with ``status`` (``after``: once they took effect)."""
        self.faults.append(Fault(rpc, status, message, times, after))

    def sandbox(self, sandbox_id: str | None = None) -> SandboxRecord:
        """The sandbox ``sandbox_id``, or the only one there is."""
        if sandbox_id is None:
            (record,) = self.sandboxes.values()
            return record
        return self.sandboxes[sandbox_id]

    def terminate(self, sandbox_id: str) -> None:
        """End a sandbox behind the client's back, as Modal's own ``modal sandbox stop`` would."""
        self.run(modal_worker.end(self.sandboxes[sandbox_id], api_pb2.GenericResult.GENERIC_STATUS_TERMINATED))

    def expire(self, sandbox_id: str) -> None:
        """End a sandbox now as its lifetime (``timeout``) running out does."""
        self.run(modal_worker.end(self.sandboxes[sandbox_id], api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT))

    def vanish(self, sandbox_id: str) -> None:
        """Forget a sandbox altogether (ended long ago): every RPC naming it answers NOT_FOUND from now on."""
        self.terminate(sandbox_id)
        del self.sandboxes[sandbox_id]

    def check_wire(self) -> None:
        """Fail, naming them, if the SDK called RPCs (or helper operations) the stand-in does not serve."""
        if self.unimplemented:
            names = ", ".join(sorted(set(self.unimplemented)))
            raise AssertionError(
                f"the installed modal SDK called what the Modal stand-in does not implement: {names}. "
                "Implement it in tests/hooks/modal/modal_server.py (or modal_worker.py) the way Modal answers it."
            )

    # -- used by the servicers --------------------------------------------------------------------

    def new_id(self, prefix: str, length: int = 22) -> str:
        return f"{prefix}-" + "".join(random.choices(_ID_CHARS, k=length))

    def created_at(self) -> float:
        """A creation time that orders sandboxes even when a test freezes the clock."""
        return time.time() + next(self._seq) * 1e-3

    def mint_jwt(self, subject: str, lifetime: float = 3600) -> str:
        def part(value: dict) -> str:
            return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

        claims = {"sub": subject, "exp": int(time.time() + lifetime), "nonce": secrets.token_hex(8)}
        return f"{part({'alg': 'none'})}.{part(claims)}.{secrets.token_hex(8)}"

    def take_fault(self, rpc: str, *, after: bool) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.rpc == rpc and fault.after == after and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None


# -- the control plane ---------------------------------------------------------------------------------


_V2 = {
    "SandboxCreateV2",
    "SandboxWaitV2",
    "SandboxListV2",
    "SandboxGetFromNameV2",
    "SandboxTagsGetV2",
    "SandboxTagsSetV2",
    "SandboxTerminateV2",
    "SandboxGetTaskIdV2",
    "SandboxGetCommandRouterAccess",
}


class ControlPlane(Servicer, ModalClientBase):
    """The control-plane RPCs the hook's calls reach, V1 and V2 alike."""

    def authorize(self, rpc: str, request: Any, metadata: dict[str, str]) -> None:
        pair = (metadata.get("x-modal-token-id", ""), metadata.get("x-modal-token-secret", ""))
        if pair not in self.server.tokens:
            raise GRPCError(Status.UNAUTHENTICATED, "Token missing or not recognised. Run `modal token new`.")
        if rpc in _V2 and metadata.get("x-modal-auth-token") not in self.server.auth_tokens:
            raise GRPCError(Status.UNAUTHENTICATED, "missing or expired auth token")

    async def ClientHello(self, stream: Stream) -> None:
        await self.begin(stream, "ClientHello")
        await self.finish(stream, "ClientHello", api_pb2.ClientHelloResponse())

    async def AuthTokenGet(self, stream: Stream) -> None:
        await self.begin(stream, "AuthTokenGet")
        token = self.server.mint_jwt("client")
        self.server.auth_tokens.add(token)
        await self.finish(stream, "AuthTokenGet", api_pb2.AuthTokenGetResponse(token=token))

    async def EnvironmentGetOrCreate(self, stream: Stream) -> None:
        request = await self.begin(stream, "EnvironmentGetOrCreate")
        name = request.deployment_name or "main"
        settings = api_pb2.EnvironmentSettings(image_builder_version=image_builder_version())
        response = api_pb2.EnvironmentGetOrCreateResponse(
            environment_id=f"en-{name}", metadata=api_pb2.EnvironmentMetadata(name=name, settings=settings)
        )
        await self.finish(stream, "EnvironmentGetOrCreate", response)

    async def AppGetOrCreate(self, stream: Stream) -> None:
        request = await self.begin(stream, "AppGetOrCreate")
        key = (request.environment_name, request.app_name)
        app = self.server.apps.get(key)
        if app is None:
            if request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{request.app_name}' not found in this environment")
            app = self.server.apps[key] = App(self.server.new_id("ap"), request.app_name, request.environment_name)
        await self.finish(stream, "AppGetOrCreate", api_pb2.AppGetOrCreateResponse(app_id=app.app_id))

    async def ImageGetOrCreate(self, stream: Stream) -> None:
        request = await self.begin(stream, "ImageGetOrCreate")
        commands = list(request.image.dockerfile_commands)
        key = "\n".join(commands)
        image = self.server.images.get(key)
        if image is None:
            tag = next((line.split(None, 1)[1] for line in commands if line.upper().startswith("FROM ")), "")
            image = self.server.images[key] = Image(self.server.new_id("im"), tag)
        result = api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS) if image.built else None
        response = api_pb2.ImageGetOrCreateResponse(image_id=image.image_id, result=result)
        await self.finish(stream, "ImageGetOrCreate", response)

    async def ImageJoinStreaming(self, stream: Stream) -> None:
        request = await self.begin(stream, "ImageJoinStreaming")
        image = next((i for i in self.server.images.values() if i.image_id == request.image_id), None)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {request.image_id} not found")
        image.built = True
        success = api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)
        await self.finish(stream, "ImageJoinStreaming", api_pb2.ImageJoinStreamingResponse(result=success))

    async def SecretGetOrCreate(self, stream: Stream) -> None:
        request = await self.begin(stream, "SecretGetOrCreate")
        secret_id = self.server.new_id("st")
        self.server.secrets[secret_id] = dict(request.env_dict)
        await self.finish(stream, "SecretGetOrCreate", api_pb2.SecretGetOrCreateResponse(secret_id=secret_id))

    # -- creating and finding sandboxes ----------------------------------------------------------

    async def SandboxCreate(self, stream: Stream) -> None:
        request = await self.begin(stream, "SandboxCreate")
        env = modal_worker.secret_env(list(request.definition.secret_ids), self.server.secrets)
        record = await self.create(request, env, version=1)
        response = shaped(
            api_pb2.SandboxCreateResponse, sandbox_id=record.sandbox_id, metadata=record.handle_metadata()
        )
        await self.finish(stream, "SandboxCreate", response)

    async def SandboxCreateV2(self, stream: Stream) -> None:
        request = await self.begin(stream, "SandboxCreateV2")
        env = modal_worker.secret_env(request.secret_sources, self.server.secrets)
        record = await self.create(request, env, version=2)
        response = shaped(
            api_pb2.SandboxCreateV2Response,
            sandbox_id=record.sandbox_id,
            task_id=record.task_id,
            metadata=record.handle_metadata(),
            command_router_access=api_pb2.CommandRouterAccess(url=self.server.url, jwt=record.router_jwt),
            sandbox_token=record.sandbox_token,
        )
        await self.finish(stream, "SandboxCreateV2", response)

    async def create(self, request: Any, env: dict[str, str], *, version: int) -> SandboxRecord:
        definition = request.definition
        app = next((a for a in self.server.apps.values() if a.app_id == request.app_id), None)
        if app is None:
            raise GRPCError(Status.NOT_FOUND, f"App {request.app_id} not found")
        image = next((i for i in self.server.images.values() if i.image_id == definition.image_id), None)
        if image is None or not image.built:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Image {definition.image_id} is not built")
        if definition.name and any(
            r.name == definition.name and r.app_id == app.app_id and r.result is None
            for r in self.server.sandboxes.values()
        ):
            raise GRPCError(Status.ALREADY_EXISTS, f"A sandbox named '{definition.name}' is already running")
        sandbox_id = self.server.new_id("sb") if version == 1 else self.server.new_id("sb", 26)
        access = network_policy(definition.network_access)
        record = SandboxRecord(
            sandbox_id=sandbox_id,
            version=version,
            app_id=app.app_id,
            name=definition.name,
            definition=definition,
            image_tag=image.tag,
            env=env,
            network=access,
            tags={tag.tag_name: tag.tag_value for tag in request.tags},
            created_at=self.server.created_at(),
            root=self.server.root / sandbox_id,
            task_id=self.server.new_id("ta"),
            router_jwt=self.server.mint_jwt(sandbox_id),
            sandbox_token=secrets.token_hex(16) if version == 2 else "",
        )
        modal_worker.provision(record)
        self.server.sandboxes[sandbox_id] = record
        if definition.timeout_secs:
            record.lifetime = asyncio.get_running_loop().call_later(
                definition.timeout_secs,
                lambda: asyncio.ensure_future(modal_worker.end(record, api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT)),
            )
        return record

    def lookup(self, sandbox_id: str, *, version: int | None = None) -> SandboxRecord:
        record = self.server.sandboxes.get(sandbox_id)
        if record is None or (version is not None and record.version != version):
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return record

    async def _get_from_name(self, stream: Stream, rpc: str, version: int) -> None:
        request = await self.begin(stream, rpc)
        app = self.server.apps.get((request.environment_name, request.app_name))
        found = [
            r
            for r in self.server.sandboxes.values()
            if app is not None and r.app_id == app.app_id and r.name == request.sandbox_name and r.version == version
        ]
        running = [r for r in found if r.result is None]
        chosen = running or (found if request.include_terminated else [])
        if not chosen:
            raise GRPCError(Status.NOT_FOUND, f"No running sandbox named '{request.sandbox_name}'")
        record = chosen[-1]
        response = shaped(
            api_pb2.SandboxGetFromNameResponse, sandbox_id=record.sandbox_id, metadata=record.handle_metadata()
        )
        await self.finish(stream, rpc, response)

    async def SandboxGetFromName(self, stream: Stream) -> None:
        await self._get_from_name(stream, "SandboxGetFromName", 1)

    async def SandboxGetFromNameV2(self, stream: Stream) -> None:
        await self._get_from_name(stream, "SandboxGetFromNameV2", 2)

    async def _list(self, stream: Stream, rpc: str, versions: tuple[int, ...]) -> None:
        request = await self.begin(stream, rpc)
        wanted = {tag.tag_name: tag.tag_value for tag in request.tags}
        matches = sorted(
            (
                r
                for r in self.server.sandboxes.values()
                if r.version in versions
                and (not request.app_id or r.app_id == request.app_id)
                and (request.include_finished or r.result is None)
                and all(r.tags.get(k) == v for k, v in wanted.items())
                and (not request.before_timestamp or r.created_at < request.before_timestamp)
            ),
            key=lambda r: r.created_at,
            reverse=True,
        )
        page = [r.info() for r in matches[:LIST_PAGE]]
        await self.finish(stream, rpc, api_pb2.SandboxListResponse(sandboxes=page))

    async def SandboxList(self, stream: Stream) -> None:
        await self._list(stream, "SandboxList", (1,))

    async def SandboxListV2(self, stream: Stream) -> None:
        await self._list(stream, "SandboxListV2", (1, 2))

    # -- one sandbox ------------------------------------------------------------------------------

    async def _wait(self, stream: Stream, rpc: str, version: int) -> None:
        request = await self.begin(stream, rpc)
        record = self.lookup(request.sandbox_id, version=version)
        if record.result is None and request.timeout > 0:
            try:
                await asyncio.wait_for(record.ended.wait(), request.timeout)
            except TimeoutError:
                pass
        response = shaped(api_pb2.SandboxWaitResponse, result=record.result, metadata=record.handle_metadata())
        await self.finish(stream, rpc, response)

    async def SandboxWait(self, stream: Stream) -> None:
        await self._wait(stream, "SandboxWait", 1)

    async def SandboxWaitV2(self, stream: Stream) -> None:
        await self._wait(stream, "SandboxWaitV2", 2)

    async def _tags_get(self, stream: Stream, rpc: str, version: int) -> None:
        request = await self.begin(stream, rpc)
        record = self.lookup(request.sandbox_id, version=version)
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in record.tags.items()]
        await self.finish(stream, rpc, api_pb2.SandboxTagsGetResponse(tags=tags))

    async def SandboxTagsGet(self, stream: Stream) -> None:
        await self._tags_get(stream, "SandboxTagsGet", 1)

    async def SandboxTagsGetV2(self, stream: Stream) -> None:
        await self._tags_get(stream, "SandboxTagsGetV2", 2)

    async def _tags_set(self, stream: Stream, rpc: str, version: int, response: Message) -> None:
        request = await self.begin(stream, rpc)
        record = self.lookup(request.sandbox_id, version=version)
        if record.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Sandbox {record.sandbox_id} has already finished")
        record.tags = {tag.tag_name: tag.tag_value for tag in request.tags}
        await self.finish(stream, rpc, response)

    async def SandboxTagsSet(self, stream: Stream) -> None:
        await self._tags_set(stream, "SandboxTagsSet", 1, empty_pb2.Empty())

    async def SandboxTagsSetV2(self, stream: Stream) -> None:
        await self._tags_set(stream, "SandboxTagsSetV2", 2, empty_pb2.Empty())

    async def _terminate(self, stream: Stream, rpc: str, version: int, response: Message) -> None:
        request = await self.begin(stream, rpc)
        record = self.lookup(request.sandbox_id, version=version)
        await modal_worker.end(record, api_pb2.GenericResult.GENERIC_STATUS_TERMINATED)
        await self.finish(stream, rpc, response)

    async def SandboxTerminate(self, stream: Stream) -> None:
        await self._terminate(stream, "SandboxTerminate", 1, api_pb2.SandboxTerminateResponse())

    async def SandboxTerminateV2(self, stream: Stream) -> None:
        await self._terminate(stream, "SandboxTerminateV2", 2, api_pb2.SandboxTerminateResponse())

    async def _task_id(self, stream: Stream, rpc: str, version: int) -> None:
        request = await self.begin(stream, rpc)
        record = self.lookup(request.sandbox_id, version=version)
        if record.result is not None:
            response = api_pb2.SandboxGetTaskIdResponse(task_result=record.result)
        else:
            response = api_pb2.SandboxGetTaskIdResponse(task_id=record.task_id)
        await self.finish(stream, rpc, response)

    async def SandboxGetTaskId(self, stream: Stream) -> None:
        await self._task_id(stream, "SandboxGetTaskId", 1)

    async def SandboxGetTaskIdV2(self, stream: Stream) -> None:
        await self._task_id(stream, "SandboxGetTaskIdV2", 2)

    async def TaskGetCommandRouterAccess(self, stream: Stream) -> None:
        request = await self.begin(stream, "TaskGetCommandRouterAccess")
        record = modal_worker.running_task(self.server.sandboxes, request.task_id)
        response = api_pb2.TaskGetCommandRouterAccessResponse(url=self.server.url, jwt=record.router_jwt)
        await self.finish(stream, "TaskGetCommandRouterAccess", response)

    async def SandboxGetCommandRouterAccess(self, stream: Stream) -> None:
        request = await self.begin(stream, "SandboxGetCommandRouterAccess")
        if request.task_id:
            record = modal_worker.running_task(self.server.sandboxes, request.task_id)
        else:
            record = self.lookup(request.sandbox_id, version=2)
            if record.result is not None:
                raise GRPCError(Status.NOT_FOUND, f"Sandbox {record.sandbox_id} has finished")
        response = api_pb2.SandboxGetCommandRouterAccessResponse(url=self.server.url, jwt=record.router_jwt)
        await self.finish(stream, "SandboxGetCommandRouterAccess", response)


refuse_the_rest(ControlPlane, ModalClientBase)


def sandbox_rpc(name: str) -> str:
    """
    The form of the sandbox RPC ``name`` (e.g. ``"SandboxCreate"``) the installed SDK sends for a
    sandbox made with its defaults: ``name + "V2"`` where it makes V2 sandboxes by default (1.6 on), else ``name``.
    """
    from modal.config import config

    try:
        v2 = config.get("sandbox_v2") is True
    except KeyError:  # an SDK from before V2 sandboxes
        v2 = False
    return f"{name}V2" if v2 else name


def image_builder_version() -> str:
    """The newest image builder version the installed SDK supports, as Modal sets for a new workspace."""
    from modal._image import ImageBuilderVersion

    return max(v for v in typing.get_args(ImageBuilderVersion) if v[:1].isdigit())


def network_policy(access: api_pb2.NetworkAccess) -> NetworkPolicy:
    kinds = api_pb2.NetworkAccess.NetworkAccessType
    return NetworkPolicy(
        blocked=access.network_access_type == kinds.BLOCKED,
        allowlist=access.network_access_type == kinds.ALLOWLIST,
        cidrs=list(access.allowed_cidrs),
        domains=list(access.allowed_domains),
    )


# -- pytest wiring -----------------------------------------------------------------------------------


@pytest.fixture(name="modal_server")
def modal_server_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModalServer]:
    """
    A running stand-in with the real SDK pointed at it (the worker's token pair is :data:`TOKEN`).
    After the test it fails, naming them, if the SDK called RPCs the stand-in does not serve.
    """
    if not shutil.which("bwrap") and not os.environ.get("SANDBOX_REQUIRE_BWRAP"):
        pytest.skip("the Modal stand-in runs commands in bubblewrap, which is not installed")
    server = ModalServer(tmp_path / "modal-standin").start()
    point_sdk_at(server, monkeypatch)
    try:
        yield server
    finally:
        server.stop()
    server.check_wire()


def point_sdk_at(server: ModalServer, monkeypatch: Any) -> None:
    """Send the real SDK to ``server``: its URL, the worker's token pair, and no client cached from before."""
    import modal._environments
    import modal.client

    monkeypatch.setenv("MODAL_SERVER_URL", server.url)
    monkeypatch.setenv("MODAL_TOKEN_ID", TOKEN[0])
    monkeypatch.setenv("MODAL_TOKEN_SECRET", TOKEN[1])
    monkeypatch.delenv("MODAL_ENVIRONMENT", raising=False)
    monkeypatch.setattr(modal.client._Client, "_client_from_env", None)
    monkeypatch.setattr(modal._environments, "ENVIRONMENT_CACHE", {})


__all__ = [
    "LIST_PAGE",
    "TOKEN",
    "Call",
    "ControlPlane",
    "Fault",
    "ModalServer",
    "NetworkPolicy",
    "SandboxRecord",
    "modal_server_fixture",
    "point_sdk_at",
    "sandbox_rpc",
]
