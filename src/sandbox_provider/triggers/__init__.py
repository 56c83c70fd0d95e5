"""Triggers: what the triggerer runs for a deferred sandbox task (:class:`SandboxCommandTrigger`)."""

from __future__ import annotations

from sandbox_provider.triggers.sandbox import SandboxCommandTrigger

__all__ = ["SandboxCommandTrigger"]
