"""
``airflow sandboxes`` is registered through the provider info's ``cli`` entry, and loads lazily: the
``airflow`` command line imports ``sandbox_provider.cli`` but no handler and no backend, let alone a
backend's SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sandbox_provider.get_provider_info import get_provider_info

#: Top-level modules of the backends' SDKs and of what only the handlers import.
HEAVY = ("docker", "modal", "kubernetes", "opensandbox", "openshell", "islo", "boat_sdk", "grpc")


#: Builds the ``airflow`` command line's parser as ``airflow ARGS`` does, parses ARGS (a ``--help``
#: prints and exits), then writes the names of every module loaded to the file named first.
PROBE = """
import json, sys
out, args = sys.argv[1], sys.argv[2:]
from airflow.cli import cli_parser
try:
    cli_parser.get_parser().parse_args(args)
finally:
    with open(out, "w") as f:
        json.dump(sorted(sys.modules), f)
"""


def _imports(*args: str, home: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "AIRFLOW_HOME": home}
    env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
    out = os.path.join(home, "modules.json")
    found = subprocess.run([sys.executable, "-c", PROBE, out, *args], env=env, capture_output=True, text=True)
    with open(out) as f:
        return found, set(json.load(f))


def test_the_provider_info_names_the_command_function():
    info = get_provider_info()
    assert info["cli"] == ["sandbox_provider.cli.get_cli_commands"]
    from sandbox_provider.cli import get_cli_commands

    (group,) = get_cli_commands()
    assert group.name == "sandboxes"
    assert [c.name for c in group.subcommands] == ["list", "sweep", "sweep-partials", "show", "destroy"]


def test_airflow_help_loads_no_backend(tmp_path):
    for args in (("--help",), ("sandboxes", "--help"), ("sandboxes", "sweep", "--help")):
        found, names = _imports(*args, home=str(tmp_path))
        assert found.returncode == 0, found.stderr[-2000:]
        # Positive control: the provider's command module was imported, so the list of imports is real.
        assert "sandbox_provider.cli" in names, sorted(n for n in names if n.startswith("sandbox_provider"))
        assert "sandboxes" in found.stdout
        loaded = sorted(n for n in names if n.split(".")[0] in HEAVY)
        assert loaded == [], loaded
        # The provider info reads the connection forms (Airflow-free, with what they share: the egress
        # rules); no backend's hook module, no handler and nothing of the engine or the hook contract loads.
        backends = ("local", "docker", "modal", "kubernetes", "opensandbox", "openshell", "sbx", "islo", "boat")
        heavy = (
            *(f"sandbox_provider.hooks.{name}" for name in backends),
            "sandbox_provider.cli.",
            "sandbox_provider.engine",
            "sandbox_provider.sandbox.hook",
        )
        assert not [n for n in names if n.startswith(heavy)], sorted(n for n in names if n.startswith("sandbox_"))
