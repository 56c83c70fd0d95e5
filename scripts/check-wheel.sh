#!/usr/bin/env bash
# Check the wheel on its own: build it, install it (not editable) into a fresh virtualenv, and run the
# flights demo and the contract battery for the local and Docker backends against that install.
#
#   bash scripts/check-wheel.sh
#
# It fails when the wheel lacks a file of the package (the guest programs are package data), when it
# carries test infrastructure (tests/, the OpenSandbox test daemon), or when the installed package does
# not run. The Docker half needs the Engine and image that scripts/docker/prepare.sh makes; without them
# it is skipped with a notice, unless SANDBOX_REQUIRE_DOCKER is set. Environment:
#   SANDBOX_LOCK   the lock file the fresh virtualenv installs (default: requirements.lock)
#   KEEP_WHEEL_CHECK=1  keep the work directory (wheel, virtualenv, logs) for a look
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

log() { printf '[check-wheel] %s\n' "$*" >&2; }

bash scripts/setup.sh
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sandbox-wheel-XXXXXX")"
if [ -z "${KEEP_WHEEL_CHECK:-}" ]; then
  trap 'rm -rf "$WORK"' EXIT
else
  log "work directory: $WORK"
fi

log "building the wheel"
.venv/bin/python -m build --wheel --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || {
  tail -n 40 "$WORK/build.log" >&2
  exit 1
}
WHEEL="$(ls "$WORK"/dist/*.whl)"

log "checking what $(basename "$WHEEL") holds"
.venv/bin/python - "$WHEEL" src/sandbox_provider <<'PY'
import pathlib
import sys
import zipfile

wheel, package = sys.argv[1], pathlib.Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
# Every file of the package ships: modules, and the guest programs beside them (package data).
expected = {
    str(path.relative_to(package.parent))
    for path in package.rglob("*")
    if path.is_file() and "__pycache__" not in path.parts
}
missing = sorted(expected - names)
shipped = {name for name in names if name.startswith("sandbox_provider/")}
extra = sorted(shipped - expected)
# Test infrastructure never ships: nothing outside the package, no stand-in daemon.
leaked = sorted(
    name
    for name in names
    if not name.startswith(("sandbox_provider/", "airflow_provider_sandbox-")) or "opensandbox_execd" in name
)
guest = sorted(name for name in shipped if "/guest/" in name and not name.endswith("__init__.py"))
problems = [f"missing from the wheel: {missing}"] * bool(missing)
problems += [f"in the wheel but not in the package: {extra}"] * bool(extra)
problems += [f"test infrastructure in the wheel: {leaked}"] * bool(leaked)
if problems:
    sys.exit("\n".join(problems))
print(f"{len(shipped)} files of the package, {len(guest)} guest programs: {', '.join(guest)}")
PY

log "installing it into a fresh virtualenv"
VENV="$WORK/venv"
uv venv -q -p "$ROOT/.venv/bin/python" "$VENV"
uv pip install -q -p "$VENV/bin/python" -r "${SANDBOX_LOCK:-requirements.lock}"
uv pip install -q -p "$VENV/bin/python" --no-deps "$WHEEL"
# Run from the work directory, so nothing of the checkout can be imported in place of the install.
cd "$WORK"
SITE="$("$VENV/bin/python" -c 'import os, sandbox_provider; print(os.path.dirname(sandbox_provider.__file__))')"
case "$SITE" in
  "$VENV"/*) log "sandbox_provider imports from $SITE" ;;
  *) log "sandbox_provider imports from $SITE, not from the fresh virtualenv" && exit 1 ;;
esac

log "the flights demo on the local backend"
PYTHON="$VENV/bin/python" SANDBOX_DEMO_OUTPUT="$WORK/demo-local" bash "$ROOT/scripts/demo.sh"

docker_ready() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import os

import docker

client = docker.from_env(timeout=10)
client.ping()
client.images.get(os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm"))
PY
}

batteries=("$ROOT/tests/contract/test_contract_local.py")
if docker_ready; then
  log "the flights demo on the Docker backend"
  image="${SANDBOX_DOCKER_IMAGE:-airflow-sandbox-python:bookworm}"
  AIRFLOW_CONN_SANDBOX_DOCKER_WHEEL="{\"conn_type\": \"sandbox_docker\", \"extra\": {\"image\": \"$image\"}}" \
    SANDBOX_DEMO_BACKEND=sandbox_docker_wheel PYTHON="$VENV/bin/python" SANDBOX_DEMO_OUTPUT="$WORK/demo-docker" \
    bash "$ROOT/scripts/demo.sh"
  batteries+=("$ROOT/tests/contract/test_contract_docker.py")
elif [ -n "${SANDBOX_REQUIRE_DOCKER:-}" ]; then
  log "SANDBOX_REQUIRE_DOCKER is set but the Engine or its image is missing (bash scripts/docker/prepare.sh)"
  exit 1
else
  log "no Docker Engine with the sandbox image here: the Docker half is skipped"
fi

log "the contract battery against the installed package"
# The tests' own conftest points Airflow at the package's example Dags; here, the installed ones.
AIRFLOW__CORE__DAGS_FOLDER="$SITE/example_dags" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  --rootdir "$ROOT" -c "$ROOT/pyproject.toml" --basetemp "$WORK/pytest" "${batteries[@]}"
log "the wheel works on its own"
