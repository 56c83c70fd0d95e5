"""
``Attachable``: the rules by which a task claims a sandbox another task provisioned.

A backend that mixes it in keeps a few string **stamps** with each sandbox (owner, holder, expiry,
network, workdir, the task that made it) and implements reading and writing them; the claim, the
release and the lifetime clamp come from here, the same for every backend.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    AttachedSandbox,
    SandboxSpec,
    decode_network_policy,
)

log = logging.getLogger(__name__)

__all__ = ["Attachable", "expiry_of"]


def expiry_of(stamps: Mapping[str, str]) -> float | None:
    """The expiry stamp as Unix seconds, or None when missing or unreadable."""
    try:
        return float(stamps[EXPIRES_AT_TAG])
    except (KeyError, TypeError, ValueError):
        return None


class Attachable:
    """
    Mixin for backends whose sandboxes a later task can attach to by handle. Put it before
    :class:`~sandbox_provider.sandbox.hook.SandboxHook` in the bases.

    The claim writes the holder and reads it back: that catches mistakes made one after another.
    Unless a backend adds a lock of its own (the local backend does), it is attribution, not a lock:
    code in the sandbox, or anyone with the backend's credentials, may rewrite stamps.
    """

    attachable: ClassVar[bool] = True

    @abstractmethod
    def read_tags(self, handle: str) -> Mapping[str, str]:
        """Return the sandbox's stamps. :raises SandboxTerminalError: if the sandbox is missing or ended."""

    @abstractmethod
    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's changeable stamps (the holder) with those in ``tags``."""

    def _remaining_lifetime(self, handle: str) -> float | None:
        known = self._known_expiry.get(handle)  # type: ignore[attr-defined]
        if known is None:
            known = expiry_of(self.read_tags(handle))
            if known is not None:
                self._known_expiry[handle] = known  # type: ignore[attr-defined]
        return None if known is None else known - time.time()

    def attach(self, handle: str, *, owner: str, holder: str) -> AttachedSandbox:
        """
        Claim a sandbox another task provisioned.

        The owner stamp must equal ``owner``; the holder stamp must be empty or ``holder`` already (a
        retry of the same task is the same holder).

        :raises SandboxTerminalError: on a wrong owner, another holder, or a sandbox that is gone.
        """
        handle = self.check_handle(handle)  # type: ignore[attr-defined]
        name = self.display_name  # type: ignore[attr-defined]
        for what, value in (("owner", owner), ("holder", holder)):
            if not isinstance(value, str) or not value.strip():
                raise SandboxTerminalError(f"attach needs a non-empty {what}, got {value!r}.")
        tags = dict(self.read_tags(handle))
        expires = expiry_of(tags)
        if expires is not None and expires <= time.time():
            raise SandboxTerminalError(
                f"Sandbox {handle!r} on the {name} backend has reached the end of its lifetime; it is not attached. "
                "Provision a new one, with a longer sandbox_timeout if the tasks between need it."
            )
        found = tags.get(OWNER_TAG)
        if found != owner:
            carries = f"it carries owner {found!r}" if found else "it carries no owner"
            raise SandboxTerminalError(
                f"Sandbox {handle!r} on the {name} backend is not owned by {owner!r}: {carries}. Provision it "
                "with SandboxSpec(owner=dag_run_owner(context)) in the same Dag run, or pass the owner it was "
                "provisioned under."
            )
        current = tags.get(HOLDER_TAG)
        if current and current != holder:
            raise SandboxTerminalError(
                f"Sandbox {handle!r} is held by {current!r}; one task uses a sandbox at a time. Run the tasks "
                "one after another, or provision a sandbox for each."
            )
        if current != holder:
            self.write_tags(handle, {**tags, HOLDER_TAG: holder})
            tags = dict(self.read_tags(handle))
            if tags.get(HOLDER_TAG) != holder:
                raise SandboxTerminalError(
                    f"Sandbox {handle!r} was claimed by {tags.get(HOLDER_TAG)!r} while {holder!r} was attaching. "
                    "Two tasks asked for it at once; provision one sandbox per task."
                )
        if expires is not None:
            self._known_expiry[handle] = expires  # type: ignore[attr-defined]
        network: SandboxSpec | None = None
        if NETWORK_TAG in tags:
            try:
                network = decode_network_policy(tags[NETWORK_TAG])
            except ValueError:
                log.warning("Sandbox %s carries a network stamp that cannot be read: %r", handle, tags[NETWORK_TAG])
        return AttachedSandbox(
            handle=handle,
            remaining_lifetime=None if expires is None else max(0.0, expires - time.time()),
            network=network,
            workdir=tags.get(WORKDIR_TAG),
            tags=tags,
        )

    def release(self, handle: str, *, holder: str) -> None:
        """Clear the holder stamp if it is ``holder``'s. Never destroys; releasing twice is fine."""
        tags = dict(self.read_tags(handle))
        if tags.get(HOLDER_TAG) == holder:
            tags.pop(HOLDER_TAG)
            self.write_tags(handle, tags)
