"""
What the Modal stand-in's two servicers share: receiving a call, checking its credentials, recording
it, injecting faults, and answering every RPC of the installed SDK that the stand-in does not
serve with UNIMPLEMENTED and its name (recorded, so :meth:`modal_server.ModalServer.check_wire`
can fail the test naming it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.server import Stream

#: Marks the generated handlers that refuse an RPC, so :func:`served_rpcs` can leave them out.
REFUSAL = "refusal."
#: Marks a served RPC's handler wrapped by :func:`refuse_the_rest`.
GUARD = "guarded."


@dataclass
class Call:
    """One RPC that reached the stand-in: its name, its (first) request and the token id it carried."""

    rpc: str
    request: Message | None
    token_id: str | None


@dataclass
class Fault:
    """The next ``times`` calls of ``rpc`` fail with ``status``: before taking effect, or ``after`` it."""

    rpc: str
    status: Status
    message: str
    times: int = 1
    after: bool = False


def shaped(message_type: type, **fields: Any) -> Any:
    """``message_type(**fields)`` without the fields the installed SDK's message does not have (older SDKs)."""
    known = message_type.DESCRIPTOR.fields_by_name
    return message_type(**{name: value for name, value in fields.items() if name in known and value is not None})


def metadata_of(stream: Stream) -> dict[str, str]:
    return {key: value for key, value in (stream.metadata or {}).items() if isinstance(value, str)}


class Servicer:
    """
    Base of both servicers. ``server`` is the :class:`modal_server.ModalServer` whose state they
    serve; a subclass says in :meth:`authorize` which credentials its RPCs need.
    """

    def __init__(self, server: Any) -> None:
        self.server = server

    async def begin(self, stream: Stream, rpc: str) -> Any:
        """Receive the (first) request of ``rpc``, record it, check it and apply a fault due before it."""
        request = await stream.recv_message()
        metadata = metadata_of(stream)
        self.server.calls.append(Call(rpc, request, metadata.get("x-modal-token-id")))
        self.authorize(rpc, request, metadata)
        fault = self.server.take_fault(rpc, after=False)
        if fault is not None:
            raise GRPCError(fault.status, fault.message)
        return request

    async def finish(self, stream: Stream, rpc: str, response: Message) -> None:
        """Send ``response``, unless a fault is due after ``rpc`` took effect (the reply is lost)."""
        fault = self.server.take_fault(rpc, after=True)
        if fault is not None:
            raise GRPCError(fault.status, fault.message)
        await stream.send_message(response)

    def authorize(self, rpc: str, request: Any, metadata: dict[str, str]) -> None:
        raise NotImplementedError


def refuse_the_rest(cls: type, base: type) -> type:
    """
    Give ``cls`` a handler for every RPC of ``base`` it lacks (UNIMPLEMENTED, naming the RPC), and
    guard those it has: a handler that fails (a message the installed SDK shapes differently, say)
    answers UNIMPLEMENTED naming the RPC and the error, which the SDK does not retry, and is recorded.
    """
    for rpc in sorted(getattr(base, "__abstractmethods__", ())):
        owner = next((parent for parent in cls.__mro__ if parent is not base and rpc in vars(parent)), None)
        if owner is None:
            setattr(cls, rpc, refusal(rpc))
        elif not getattr(vars(owner)[rpc], "__qualname__", "").startswith((REFUSAL, GUARD)):
            setattr(owner, rpc, _guarded(rpc, vars(owner)[rpc]))
    cls.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
    return cls


def _guarded(rpc: str, handler: Callable) -> Callable:
    async def guard(self: Servicer, stream: Stream) -> None:
        try:
            await handler(self, stream)
        except (GRPCError, asyncio.CancelledError):
            raise
        except Exception as err:  # noqa: BLE001 - the stand-in itself failed: say so, by name
            self.server.unimplemented.append(f"{rpc} ({type(err).__name__}: {err})")
            raise GRPCError(Status.UNIMPLEMENTED, f"the Modal stand-in failed serving {rpc}: {err!r}") from err

    guard.__name__ = rpc
    guard.__qualname__ = GUARD + rpc
    return guard


def refusal(rpc: str) -> Callable:
    """A handler that answers ``rpc`` with UNIMPLEMENTED naming it, and records the call."""

    async def refuse(self: Servicer, stream: Stream) -> None:
        self.server.calls.append(Call(rpc, None, metadata_of(stream).get("x-modal-token-id")))
        self.server.unimplemented.append(rpc)
        raise GRPCError(Status.UNIMPLEMENTED, f"the Modal stand-in does not implement {rpc}")

    refuse.__name__ = rpc
    refuse.__qualname__ = REFUSAL + rpc
    return refuse


def served_rpcs(cls: type) -> set[str]:
    """The RPC names ``cls`` serves itself (its refusals left out)."""
    return {
        name
        for name in dir(cls)
        if name[:1].isupper()
        and callable(getattr(cls, name))
        and not getattr(getattr(cls, name), "__qualname__", "").startswith(REFUSAL)
    }


def check_served(cls: type, base: type) -> None:
    """Fail, naming them, if ``cls`` serves RPCs the installed SDK's ``base`` no longer has (renamed or dropped)."""
    stale = sorted(served_rpcs(cls) - set(base.__abstractmethods__))
    if stale:
        raise AssertionError(
            f"the Modal stand-in serves RPCs the installed modal SDK does not have: {', '.join(stale)}. "
            "The SDK renamed or dropped them; serve what it calls now instead."
        )
