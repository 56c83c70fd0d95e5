"""
``airflow sandboxes --help`` against ``airflow version``, each a fresh ``airflow`` process, interleaved
(``harness.compare``: median, min and max of the per-round ratio). Both pay for Airflow's start and its
providers' discovery; ``sandboxes --help`` also imports ``sandbox_provider.cli`` and builds its parser.
Goal (issue 27): at most 1.2x. A second row checks that no backend's SDK was imported for it.

    .venv/bin/python benchmarks/bench_cli.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import compare, print_rows  # noqa: E402

#: Modules a backend imports when it is used; none may load for ``airflow sandboxes --help``.
SDKS = ("docker", "modal", "kubernetes", "opensandbox", "openshell", "islo", "boat_sdk", "grpc")


def _airflow(env: dict, *args: str) -> subprocess.CompletedProcess:
    found = subprocess.run([sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"airflow {' '.join(args)} failed: {found.stderr[-1000:]}")
    return found


#: Builds the parser as ``airflow sandboxes --help`` does, then writes the names of the modules loaded.
PROBE = """
import json, sys
from airflow.cli import cli_parser
try:
    cli_parser.get_parser().parse_args(["sandboxes", "--help"])
except SystemExit:
    pass
with open(sys.argv[1], "w") as f:
    json.dump(sorted(sys.modules), f)
"""


def sdks_imported(env: dict, home: str) -> list[str]:
    """The backend SDKs ``airflow sandboxes --help`` imports (``sys.modules`` once its parser is built)."""
    out = os.path.join(home, "modules.json")
    subprocess.run([sys.executable, "-c", PROBE, out], env=env, capture_output=True, check=True)
    with open(out) as f:
        names = json.load(f)
    return sorted(name for name in names if name.split(".")[0] in SDKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="bench-cli-")
    env = {**os.environ, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
    assert "sweep-partials" in _airflow(env, "sandboxes", "--help").stdout  # the commands are registered
    comparison = compare(
        "airflow sandboxes --help",
        lambda: _airflow(env, "sandboxes", "--help"),
        "airflow version",
        lambda: _airflow(env, "version"),
        rounds=args.rounds,
    )
    print_rows([(comparison, "goal <= 1.2x")])
    imported = sdks_imported(env, home)
    print(f"backend SDKs imported by 'airflow sandboxes --help': {', '.join(imported) or 'none'}")


if __name__ == "__main__":
    main()
