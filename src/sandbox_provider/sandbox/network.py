"""
What a sandbox's network lets through, in words an agent can act on.

Each backend states, once, what each network mode of :class:`~sandbox_provider.sandbox.spec.SandboxSpec`
lets through on it (:class:`NetworkReach`, set as ``Capabilities(network=...)``); one function
turns that and a spec into the sentences of the ``run_command`` description, so every backend's
description has the same shape and says exactly what its own enforcement allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_provider.sandbox.output import listing
from sandbox_provider.sandbox.spec import SandboxSpec

__all__ = ["NetworkReach", "describe_reach", "missing_phrases"]

#: What a mode lets through when a backend has not said (a stand-in for tests, say): only what the
#: contract itself promises. A backend with a connection type must say it for every mode it accepts.
GENERIC = {
    "blocked": "has no network access at all, not even DNS",
    "open": "has outbound network access",
    "hosts": (
        "which ports and protocols reach them, and whether other names resolve, is up to the backend, so test "
        "before relying on more than a plain HTTPS request"
    ),
    "cidrs": "which ports reach them, and whether names resolve, is up to the backend, so test before relying on it",
}


@dataclass(frozen=True)
class NetworkReach:
    """
    What each network mode lets through on one backend. Each field is a phrase, stated as exactly
    as the backend enforces it: which ports and protocols pass, and what DNS answers.

    A new backend sets ``capabilities = Capabilities(..., network=NetworkReach(...))`` with a phrase
    for every mode its capabilities accept (``blocked`` for ``no_network``, ``open`` for
    ``open_network``, ``hosts`` for ``egress_hosts``, ``cidrs`` for ``egress_cidrs``): a backend class
    with a connection type that leaves one out fails when it is defined, saying which. When the
    wording depends on the hook's settings or cannot be put per mode, it overrides
    :meth:`~sandbox_provider.sandbox.hook.SandboxHook.describe_network` instead (and is then checked
    by what it returns).

    :param blocked: completes "This sandbox ..." for ``block_network=True`` with no allowlist.
    :param open: completes "This sandbox ..." for ``block_network=False``.
    :param hosts: how the hosts of ``allow_egress_to`` are reached, after "can reach only <hosts>: ".
    :param cidrs: how the ranges of ``allow_egress_to_cidrs`` are reached, after "... <ranges>: ".
    :param both: a sentence on what also holds when both lists are given; empty for nothing more.
    """

    blocked: str | None = None
    open: str | None = None
    hosts: str | None = None
    cidrs: str | None = None
    both: str = ""

    def phrase(self, mode: str) -> str:
        """The phrase for ``mode`` (a field name), or the contract's generic one when none was given."""
        given = getattr(self, mode)
        return GENERIC[mode] if given is None else given


def missing_phrases(reach: NetworkReach, accepted: dict[str, bool]) -> list[str]:
    """The fields of ``reach`` left out for modes ``accepted`` maps to True (``{"blocked": True, ...}``)."""
    return [mode for mode, on in accepted.items() if on and getattr(reach, mode) is None]


def describe_reach(reach: NetworkReach, spec: SandboxSpec) -> str:
    """
    The sentences telling an agent what a sandbox made from ``spec`` can reach, on a backend whose
    modes ``reach`` describes.
    """
    if not spec.block_network:
        return f"This sandbox {reach.phrase('open')}."
    hosts = list(spec.allow_egress_to or [])
    cidrs = list(spec.allow_egress_to_cidrs or [])
    if not hosts and not cidrs:
        return (
            f"This sandbox {reach.phrase('blocked')}, so installing packages or downloading anything will fail: work with "
            "what is already installed."
        )
    if hosts and cidrs:
        reach_text = (
            f"the hosts {listing(hosts)} ({reach.phrase('hosts')}) and the address ranges {listing(cidrs)} "
            f"({reach.phrase('cidrs')})."
        )
        if reach.both:
            reach_text += f" {reach.both}"
    elif hosts:
        reach_text = f"the hosts {listing(hosts)}: {reach.phrase('hosts')}."
    else:
        reach_text = f"the address ranges {listing(cidrs)}: {reach.phrase('cidrs')}."
    return (
        f"This sandbox can reach only {reach_text} Nothing else answers, so installing packages from anywhere "
        "else will not work."
    )
