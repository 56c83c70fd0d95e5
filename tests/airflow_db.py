"""
A migrated Airflow metadata database for a test's Airflow home, migrated once per test session.

``airflow db migrate`` costs about 6 s of CPU (20 s on a busy 2-core machine), and a session used to
run it for every instance a test module makes (a worker's home, the worker-kill and sweep instances,
each deferred battery's). Now the first caller of a session migrates a database in a home of its own,
and every caller, in any pytest-xdist worker of the session, gets a copy of that database (through
SQLite's backup, see :func:`_copy`): the same schema, default pool and log templates a migration of its own would write. A home whose database is
not the default SQLite file (``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` set) is migrated as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

#: The environment variable naming the session's directory for the migrated database (set by conftest).
CACHE_ENV = "SANDBOX_TEST_DB_CACHE"
#: Settings (environment variable prefixes) that change what a migration writes.
_SHAPING = ("AIRFLOW__DATABASE__", "AIRFLOW__CORE__AUTH_MANAGER", "AIRFLOW__FAB__")
#: The file name Airflow gives its SQLite database in AIRFLOW_HOME when nothing else is configured.
DB_NAME = "airflow.db"


def _run_migrate(env: Mapping[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"], env=dict(env), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed ({done.returncode}): {done.stderr[-2000:]}")


def _template(env: Mapping[str, str], cache: Path) -> Path:
    """The session's migrated database, made by the first caller (under a lock: workers call at once)."""
    import airflow

    cache.mkdir(parents=True, exist_ok=True)
    # What could change what a migration writes: the database settings and the auth manager (whose
    # tables an external database manager may add). Homes that differ there get templates of their own.
    shaping = sorted((k, v) for k, v in env.items() if k.startswith(_SHAPING))
    key = hashlib.sha256(repr((airflow.__version__, shaping)).encode()).hexdigest()[:12]
    template = cache / f"airflow-{airflow.__version__}-{key}.db"
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            home = cache / f"home-{os.getpid()}"
            home.mkdir(exist_ok=True)
            _run_migrate({**env, "AIRFLOW_HOME": str(home)})
            _copy(home / DB_NAME, cache / "template.partial")
            os.replace(cache / "template.partial", template)
            shutil.rmtree(home, ignore_errors=True)
    return template


def migrate(env: Mapping[str, str]) -> None:
    """
    Give ``env["AIRFLOW_HOME"]`` a migrated metadata database, as ``airflow db migrate`` with ``env``
    would. :raises RuntimeError: when the migration fails (its stderr's tail in the message).
    """
    cache = os.environ.get(CACHE_ENV)
    if not cache or env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        _run_migrate(env)
        return
    home = Path(env["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    _copy(_template(env, Path(cache)), home / DB_NAME)


def _copy(source: Path, target: Path) -> None:
    """
    Copy an SQLite database through SQLite's backup, not as a file: the target may be open already (a
    worker's own home, which Airflow opened at import) and in WAL mode, whose -wal file a plain copy
    would leave to be replayed onto the new file.
    """
    with contextlib.closing(sqlite3.connect(source)) as src, contextlib.closing(sqlite3.connect(target)) as dst:
        src.backup(dst)
