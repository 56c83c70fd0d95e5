"""The package's layers hold: what each folder may import, the guide's backend names, unique test module names."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import sandbox_provider
from sandbox_provider import sandbox
from sandbox_provider.hooks import BACKENDS

PACKAGE = Path(sandbox_provider.__file__).resolve().parent
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CONSUMERS = ("operators", "decorators", "toolsets", "example_dags", "get_provider_info")

#: Folder -> the subpackages of sandbox_provider its modules must never import (at module level or in a
#: function): the contract stands on nothing above it, the engine drives backends only through it.
NEVER = {
    "sandbox": ("engine", "hooks", *CONSUMERS),
    "engine": ("hooks", *CONSUMERS),
    "hooks": ("engine", *CONSUMERS),
}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever in the file the import stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_no_import_runs_back_up(folder):
    offending = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            parts = name.split(".")
            if parts[0] == "sandbox_provider" and len(parts) > 1 and parts[1] in NEVER[folder]:
                offending.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert offending == [], f"sandbox_provider/{folder}/ must not import {', '.join(NEVER[folder])}"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    # The positive control of the check above: an import placed in a function body is found.
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from sandbox_provider.engine.session import SandboxSession\n")
    assert "sandbox_provider.engine.session.SandboxSession" in imported_modules(module)


@pytest.mark.parametrize("path", list(BACKENDS))
def test_every_backend_has_its_guide_names(path):
    module, _, hook_name = path.partition(":")
    backend_name = hook_name.replace("Hook", "Backend")
    missing = [name for name in (hook_name, backend_name) if name not in sandbox.LAZY]
    assert missing == [], (
        f"Add {', '.join(missing)} to LAZY in sandbox_provider/sandbox/__init__.py for the backend {path}, "
        f'as "{module}:<name>", and define {backend_name} = {hook_name} in its hook module.'
    )
    cls = importlib.import_module(module).__dict__[hook_name]
    assert getattr(sandbox, hook_name) is cls
    assert getattr(sandbox, backend_name) is cls
    assert hook_name in sandbox.__all__ and backend_name in sandbox.__all__


def test_every_lazy_name_resolves():
    backends = {path.partition(":")[0] for path in BACKENDS}
    for name, path in sandbox.LAZY.items():
        module, _, attribute = path.partition(":")
        assert getattr(importlib.import_module(module), attribute) is getattr(sandbox, name)
        if module.startswith("sandbox_provider.hooks."):
            assert module in backends, f"{name} points at {module}, which is not in hooks.BACKENDS"


def test_test_module_names_are_unique():
    # Tests are no package: each module is imported by its file name, and the conftest puts the folders of
    # the stand-ins on sys.path, so two files of one name in two folders would shadow each other.
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py" and "__pycache__" not in p.parts)
    assert [name for name, count in names.items() if count > 1] == []


@pytest.mark.parametrize(("mark", "registered"), [("long_lived", True), ("long_livd", False)])
def test_a_mark_missing_from_the_markers_list_stops_the_run(tmp_path, mark, registered):
    """pyproject.toml's ``--strict-markers``: a misspelt mark is an error, not a mark that silently does nothing."""
    (tmp_path / "test_marked.py").write_text(f"import pytest\n\n\n@pytest.mark.{mark}\ndef test_it():\n    pass\n")
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
        + ["-p", "no:cacheprovider", "--collect-only", "-q", str(tmp_path / "test_marked.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if registered:
        assert collected.returncode == 0, collected.stdout + collected.stderr
    else:
        assert collected.returncode != 0
        assert f"'{mark}' not found in `markers` configuration option" in collected.stdout, collected.stdout
