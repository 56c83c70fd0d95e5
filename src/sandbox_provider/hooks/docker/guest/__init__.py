"""
The Docker backend's own guest programs: docker_keeper.sh (the sandbox's PID 1), docker_run.sh (the runner of
every command), docker_op.sh (file operations) and docker_wait.sh (the wait for the keeper of a new sandbox).

Loaded like the shared ones (:mod:`sandbox_provider.sandbox.guest`), and tested on the host the same way.
"""

from __future__ import annotations

from sandbox_provider.sandbox.guest import GuestPrograms

__all__ = ["PROGRAMS", "program", "shell_command"]

PROGRAMS = GuestPrograms(__name__)
program = PROGRAMS.program
shell_command = PROGRAMS.shell_command
