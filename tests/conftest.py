"""Test settings: a private AIRFLOW_HOME with an SQLite database, set before Airflow is imported."""

from __future__ import annotations

import os
import tempfile

_HOME = os.environ.get("SANDBOX_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="sandbox-tests-airflow-")
os.environ["AIRFLOW_HOME"] = _HOME
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS"] = "False"
os.environ.setdefault(
    "AIRFLOW__CORE__DAGS_FOLDER",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "sandbox_provider", "example_dags"
    ),
)

import json  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def add_connection(monkeypatch):
    """Define an Airflow connection through its environment variable; returns a function."""

    def _add(conn_id: str, conn_type: str, *, extra: dict | None = None, **fields) -> str:
        value = {"conn_type": conn_type, **fields}
        if extra is not None:
            value["extra"] = json.dumps(extra)
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(value))
        return conn_id

    return _add


@pytest.fixture(scope="session")
def migrated_airflow_db():
    """Migrate the test AIRFLOW_HOME's SQLite database once per session, for tests that run ``dag.test()``."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], check=True, env=dict(os.environ), capture_output=True
    )
    return _HOME


@pytest.fixture(autouse=True)
def _sandbox_can_reach_tmp_path(request):
    """
    As root, the local backend runs sandboxes as an unprivileged user, which must be able to pass
    through the directories above a sandbox's state root; pytest makes its temporary folders 0700.
    """
    if os.geteuid() == 0 and "tmp_path" in request.fixturenames:
        path = request.getfixturevalue("tmp_path")
        for folder in (path, *path.parents):
            if str(folder) in ("/", tempfile.gettempdir()):
                break
            folder.chmod(folder.stat().st_mode | 0o111)
