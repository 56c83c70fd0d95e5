"""The stand-in ``sbx`` CLI (``sbx_standin/sbx``) for tests: its state, knobs and clean-up."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

STANDIN = Path(__file__).parent / "sbx_standin" / "sbx"
#: Templates the guide names, run here as the locally built image (no registry can be reached).
TEMPLATES = ("python:3.12-slim", "node:22-slim")


@dataclass
class StandIn:
    path: str
    state: Path
    label: str

    def hang(self, subcommand: str) -> None:
        """Make ``sbx <subcommand>`` never return from now on."""
        with open(self.state / "hang", "a") as f:
            f.write(subcommand + "\n")

    def fail(self, subcommand: str) -> None:
        """Make ``sbx <subcommand>`` fail from now on."""
        with open(self.state / "fail", "a") as f:
            f.write(subcommand + "\n")

    def heal(self) -> None:
        for name in ("hang", "fail"):
            (self.state / name).unlink(missing_ok=True)

    def calls(self) -> list[str]:
        path = self.state / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def containers(self) -> list[str]:
        """Names of the containers backing this stand-in's sandboxes."""
        out = subprocess.run(
            ["docker", "ps", "-a", "--filter", f"label=sbx-standin={self.label}", "--format", "{{.Names}}"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return sorted(out.stdout.split())

    def rules(self) -> list[str]:
        path = self.state / "rules"
        return path.read_text().splitlines() if path.exists() else []


@contextmanager
def sbx_standin(state: Path, image: str, *, policy: str | None = "deny-all") -> Iterator[StandIn]:
    """
    A stand-in ``sbx`` whose sandboxes are containers of ``image`` labelled for this use only; every
    one of them is removed at the end. ``policy`` is the host's ``sbx policy init`` (None: not run).
    """
    standin = StandIn(path=str(STANDIN), state=state, label=f"t{os.getpid()}-{uuid.uuid4().hex[:10]}")
    state.mkdir(parents=True, exist_ok=True)
    (state / "images").write_text("".join(f"{t}={image}\n" for t in TEMPLATES))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SBX_STANDIN_STATE", str(state))
        mp.setenv("SBX_STANDIN_LABEL", standin.label)
        if policy is not None:
            subprocess.run([standin.path, "policy", "init", policy], check=True, timeout=60)
        try:
            yield standin
        finally:
            names = standin.containers()
            if names:
                subprocess.run(["docker", "rm", "-f", *names], capture_output=True, timeout=120)
