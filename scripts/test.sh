#!/usr/bin/env bash
# Run the test suite: sets up .venv if needed, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${SANDBOX_VENV:-$PWD/.venv}"
exec "$VENV/bin/python" -m pytest "$@"
