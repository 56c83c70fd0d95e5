"""
The Kubernetes backend's own guest programs: k8s_keeper.sh (the sandbox's PID 1), k8s_run.sh (the
runner of every command) and k8s_op.sh (file operations, in the working directory).

Loaded like the shared ones (:mod:`sandbox_provider.sandbox.guest`), and tested on the host the same way.
"""

from __future__ import annotations

from sandbox_provider.sandbox.guest import GuestPrograms

__all__ = ["PROGRAMS", "program"]

PROGRAMS = GuestPrograms(__name__)
program = PROGRAMS.program
