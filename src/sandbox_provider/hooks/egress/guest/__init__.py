"""
The egress gateway's own guest programs: egress_forward.sh, which starts socat in front of the gateway's Unix
socket before each command.

Loaded like the shared ones (:mod:`sandbox_provider.sandbox.guest`), and tested on the host the same way.
"""

from __future__ import annotations

from sandbox_provider.sandbox.guest import GuestPrograms

__all__ = ["PROGRAMS", "program", "shell_command"]

PROGRAMS = GuestPrograms(__name__)
program = PROGRAMS.program
shell_command = PROGRAMS.shell_command
