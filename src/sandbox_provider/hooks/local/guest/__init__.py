"""
The local backend's own guest programs: export_into.sh, which extracts what the shared export_tree.sh packs
into the export destinations mounted into the launch.

Loaded like the shared ones (:mod:`sandbox_provider.sandbox.guest`), and tested on the host the same way.
"""

from __future__ import annotations

from sandbox_provider.sandbox.guest import GuestPrograms

__all__ = ["PROGRAMS", "program", "shell_command"]

PROGRAMS = GuestPrograms(__name__)
program = PROGRAMS.program
shell_command = PROGRAMS.shell_command
