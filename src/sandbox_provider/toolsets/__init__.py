"""pydantic-ai toolsets: ``SandboxToolset`` gives an agent a shell and files in a sandbox."""

from __future__ import annotations

from sandbox_provider.toolsets.sandbox import SandboxToolset

__all__ = ["SandboxToolset"]
