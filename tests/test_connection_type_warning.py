"""
Airflow's RFC 3986 warning about the underscore in ``sandbox_local`` / ``sandbox_docker``.

Airflow's core ``Connection.get_uri()`` warns for any connection type with an underscore, and the
API server calls it on every connection lookup (to fill its secrets cache, and again for each
connection test), so it logs the warning for every lookup of a sandbox connection. The spelling
is the right one (the URI scheme becomes ``sandbox-local``, read back as ``sandbox_local``), and
Airflow removed the warning after 3.3.2. Until then the README gives the deployment setting below,
which silences that one logger (whose only warning this is), not the rest of the module.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SETTING = "airflow.models.connection.Connection=ERROR"

PROBE = """
from airflow.models.connection import Connection, log
uri = Connection(conn_id="probe", conn_type="sandbox_local").get_uri()
assert Connection(conn_id="probe", uri=uri).conn_type == "sandbox_local", uri
log.warning("the module logger still speaks")
"""


def _probe(namespace_levels: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "AIRFLOW__LOGGING__NAMESPACE_LEVELS"}
    if namespace_levels is not None:
        env["AIRFLOW__LOGGING__NAMESPACE_LEVELS"] = namespace_levels
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("namespace_levels", [None, SETTING], ids=["as-installed", "with-readme-setting"])
def test_the_readme_setting_silences_only_the_rfc_3986_warning(namespace_levels):
    output = _probe(namespace_levels)
    assert "the module logger still speaks" in output
    if namespace_levels is None:
        # Positive control: the installed Airflow warns (drop this test once it no longer does).
        assert "shall not contain '_' according to RFC3986" in output
    else:
        assert "RFC3986" not in output
