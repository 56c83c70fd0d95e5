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

__all__ = ["NetworkReach", "describe_reach"]


@dataclass(frozen=True)
class NetworkReach:
    """
    What each network mode lets through on one backend. Each field is a phrase, stated as exactly
    as the backend enforces it: which ports and protocols pass, and what DNS answers.

    A new backend sets ``capabilities = Capabilities(..., network=NetworkReach(...))``. When the
    wording depends on the hook's settings or cannot be put per mode, it overrides
    :meth:`~sandbox_provider.sandbox.hook.SandboxHook.describe_network` instead.

    :param blocked: completes "This sandbox ..." for ``block_network=True`` with no allowlist.
    :param open: completes "This sandbox ..." for ``block_network=False``.
    :param hosts: how the hosts of ``allow_egress_to`` are reached, after "can reach only <hosts>: ".
    :param cidrs: how the ranges of ``allow_egress_to_cidrs`` are reached, after "... <ranges>: ".
    :param both: a sentence on what also holds when both lists are given; empty for nothing more.
    """

    blocked: str = "has no network access at all, not even DNS"
    open: str = "has outbound network access"
    hosts: str = (
        "which ports and protocols reach them, and whether other names resolve, is up to the backend, so test "
        "before relying on more than a plain HTTPS request"
    )
    cidrs: str = "which ports reach them, and whether names resolve, is up to the backend, so test before relying on it"
    both: str = ""


def describe_reach(reach: NetworkReach, spec: SandboxSpec) -> str:
    """
    The sentences telling an agent what a sandbox made from ``spec`` can reach, on a backend whose
    modes ``reach`` describes.
    """
    if not spec.block_network:
        return f"This sandbox {reach.open}."
    hosts = list(spec.allow_egress_to or [])
    cidrs = list(spec.allow_egress_to_cidrs or [])
    if not hosts and not cidrs:
        return (
            f"This sandbox {reach.blocked}, so installing packages or downloading anything will fail: work with "
            "what is already installed."
        )
    if hosts and cidrs:
        reach_text = (
            f"the hosts {listing(hosts)} ({reach.hosts}) and the address ranges {listing(cidrs)} ({reach.cidrs})."
        )
        if reach.both:
            reach_text += f" {reach.both}"
    elif hosts:
        reach_text = f"the hosts {listing(hosts)}: {reach.hosts}."
    else:
        reach_text = f"the address ranges {listing(cidrs)}: {reach.cidrs}."
    return (
        f"This sandbox can reach only {reach_text} Nothing else answers, so installing packages from anywhere "
        "else will not work."
    )
