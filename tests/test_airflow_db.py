"""The session's copied metadata database (tests/airflow_db.py) is what a migration of its own writes."""

from __future__ import annotations

import os
import sqlite3

import airflow_db


def _contents(path) -> dict[str, object]:
    with sqlite3.connect(path) as db:
        schema = sorted(db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        pools = sorted(db.execute("SELECT pool, slots, include_deferred FROM slot_pool"))
        templates = sorted(db.execute("SELECT filename, elasticsearch_id FROM log_template"))
        revision = sorted(db.execute("SELECT version_num FROM alembic_version"))
    return {"schema": schema, "pools": pools, "templates": templates, "revision": revision}


def test_a_copied_database_is_what_a_migration_writes(tmp_path, monkeypatch):
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    monkeypatch.setenv(airflow_db.CACHE_ENV, str(tmp_path / "cache"))
    copied, migrated = tmp_path / "copied", tmp_path / "migrated"
    airflow_db.migrate({**env, "AIRFLOW_HOME": str(copied)})
    airflow_db.migrate({**env, "AIRFLOW_HOME": str(copied / "again")})  # the second caller copies
    assert len(list((tmp_path / "cache").glob("airflow-*.db"))) == 1
    airflow_db._run_migrate({**env, "AIRFLOW_HOME": str(migrated)})
    want = _contents(migrated / airflow_db.DB_NAME)
    assert want["schema"] and want["pools"] and want["templates"] and want["revision"]  # it reads something
    assert _contents(copied / airflow_db.DB_NAME) == want
    assert _contents(copied / "again" / airflow_db.DB_NAME) == want


def test_a_database_already_open_gets_the_migrated_one_whole(tmp_path, monkeypatch):
    """
    A worker's own home is open before its first test asks for a migrated database (Airflow connects
    at import), in WAL mode with pages not yet in the file: the copy goes through SQLite, so the open
    connection and a new one both read the migrated database, intact.
    """
    monkeypatch.setenv(airflow_db.CACHE_ENV, str(tmp_path / "cache"))
    home = tmp_path / "home"
    home.mkdir()
    already = sqlite3.connect(home / airflow_db.DB_NAME)
    try:
        assert already.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
        already.execute("PRAGMA wal_autocheckpoint=0")
        already.execute("CREATE TABLE before_the_copy (n)")
        already.executemany("INSERT INTO before_the_copy VALUES (?)", [(i,) for i in range(2000)])
        already.commit()
        assert (home / f"{airflow_db.DB_NAME}-wal").stat().st_size > 0  # the control: pages wait in the WAL
        airflow_db.migrate({**os.environ, "AIRFLOW_HOME": str(home)})
        for db in (already, sqlite3.connect(home / airflow_db.DB_NAME)):
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            assert "before_the_copy" not in names and {"dag_run", "slot_pool", "alembic_version"} <= names
    finally:
        already.close()
