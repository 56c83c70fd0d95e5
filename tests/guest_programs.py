"""The text of a guest program (``sandbox_provider/sandbox/guest/<name>``), for tests that run it on the host."""

from __future__ import annotations

from pathlib import Path

import sandbox_provider

GUEST_DIR = Path(sandbox_provider.__file__).parent / "sandbox" / "guest"


def guest_program(name: str) -> str:
    return (GUEST_DIR / name).read_text()
