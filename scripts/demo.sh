#!/usr/bin/env bash
# Run the example_sandbox_flights Dag once on the local bubblewrap backend, in a throwaway Airflow
# home, and print where its report landed and the report's first lines.
#
#   bash scripts/demo.sh
#
# Python: $PYTHON if set (it needs this package installed with the demo extra: pip install -e '.[demo]');
# otherwise scripts/setup.sh makes .venv in this checkout from the lock file, and the demo uses it.
# The report goes under $SANDBOX_DEMO_OUTPUT (a URL or a directory), default /tmp/airflow-sandbox-demo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    bash "$ROOT/scripts/setup.sh"
fi

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
    PY="$(command -v python3)"
else
    PY="$(command -v python || true)"
fi
if [[ -z "$PY" ]]; then
    echo "demo: no Python found. Create the venv first: python3 -m venv .venv && .venv/bin/pip install -e '.[demo]'" >&2
    exit 1
fi
if ! command -v bwrap >/dev/null 2>&1; then
    echo "demo: bubblewrap (bwrap) is not installed; install it, e.g. sudo apt-get install bubblewrap" >&2
    exit 1
fi
if ! DAGS="$("$PY" -c 'import os, sandbox_provider.example_dags as m; print(os.path.dirname(m.__file__))' 2>/dev/null)"; then
    echo "demo: $PY cannot import sandbox_provider. Install it: $PY -m pip install -e '$ROOT[demo]'" >&2
    exit 1
fi

HOME_DIR="$(mktemp -d "${TMPDIR:-/tmp}/sandbox-demo-airflow-XXXXXX")"
LOG="$HOME_DIR/demo.log"
export AIRFLOW_HOME="$HOME_DIR"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS=False
export AIRFLOW__CORE__DAGS_FOLDER="$DAGS"
export SANDBOX_DEMO_OUTPUT="${SANDBOX_DEMO_OUTPUT:-/tmp/airflow-sandbox-demo}"

fail() {
    echo "demo: $1; the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    echo "demo: the Airflow home is kept for a look: $HOME_DIR" >&2
    exit 1
}

echo "Airflow home: $HOME_DIR (python: $PY)"
echo "Migrating the Airflow database..."
"$PY" -m airflow db migrate >"$LOG" 2>&1 || fail "airflow db migrate failed"

echo "Running example_sandbox_flights with dag.test()..."
SUMMARY="$HOME_DIR/summary.txt"
"$PY" - "$DAGS/example_sandbox_flights.py" "$SUMMARY" >>"$LOG" 2>&1 <<'PY' || fail "the Dag run failed"
import sys

from airflow.dag_processing.dagbag import DagBag
from airflow.models.xcom import XComModel
from airflow.sdk import ObjectStoragePath
from airflow.utils.session import create_session

dag_file, summary = sys.argv[1], sys.argv[2]
bag = DagBag(dag_folder=dag_file)
if bag.import_errors:
    sys.exit(f"The Dag file did not load: {bag.import_errors}")
dag_run = bag.dags["example_sandbox_flights"].test()
if str(dag_run.state) != "success":
    sys.exit(f"The run {dag_run.run_id} ended {dag_run.state}")
with create_session() as session:
    row = session.scalars(
        XComModel.get_many(
            run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids="carrier_stats", key="return_value"
        )
    ).first()
    result = XComModel.deserialize_value(row)
url = result["exports"]["carrier_stats.csv"]
lines = ObjectStoragePath(url).read_text().splitlines()
with open(summary, "w", encoding="utf-8") as out:
    out.write(f"Run {dag_run.run_id} succeeded; in the sandbox: {result['stdout'].strip()}\n")
    out.write(f"Report: {url}\n\n")
    out.write("\n".join(lines[:8]) + "\n")
    if len(lines) > 8:
        out.write(f"... ({len(lines) - 1} carriers in all)\n")
PY

echo
cat "$SUMMARY"
rm -rf "$HOME_DIR"
