#!/usr/bin/env bash
# Make a fresh clone ready: system packages (as root), then .venv with the locked dependencies.
#
# Idempotent and quick when everything is already there. Environment:
#   SANDBOX_VENV   where the virtualenv goes (default: .venv in the repository)
#   SANDBOX_LOCK   the lock file to install (default: requirements.lock; requirements-airflow-3.2.lock
#                  holds the oldest Airflow supported)
#   PYTHON         the interpreter to build it from (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }

# bubblewrap runs the local sandboxes; /usr/bin/python3 is the Python those sandboxes see.
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ -x /usr/bin/python3 ] || missing+=(python3)
command -v prlimit >/dev/null 2>&1 || missing+=(util-linux)
# libseccomp2: the local sandboxes' system-call filter is built with libseccomp;
# keyutils: the keyring tests plant a secret with keyctl and try to read it from inside.
command -v keyctl >/dev/null 2>&1 || missing+=(keyutils)
# (grep reads the whole list: with -q it would stop at the first match, ldconfig would die of SIGPIPE,
# and pipefail would count the library as missing.)
ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)
# socat: the egress gateway's forwarder (allow_egress_to on the local and Docker backends); curl and the
# system Python's pip: the egress tests use them as clients inside the sandboxes.
command -v socat >/dev/null 2>&1 || missing+=(socat)
# strace: a Modal stand-in test holds a process at its exit, to show a launch race of bubblewrap.
command -v strace >/dev/null 2>&1 || missing+=(strace)
command -v curl >/dev/null 2>&1 || missing+=(curl)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "please install: ${missing[*]} (e.g. sudo apt-get install ${missing[*]})"
    exit 1
  fi
fi

PY="${PYTHON:-python3}"
# Every installed module is compiled to bytecode once, as pip does at install. uv does not by default,
# and where PYTHONDONTWRITEBYTECODE is set nothing caches it later either: every Airflow process
# (each task, each CLI call, each test worker) then compiles Airflow from source, 1.5 s of CPU on
# a 2-core machine. BYTECODE names this in the stamps, so a virtualenv made without it is redone.
BYTECODE=compiled
# The provider's own modules (an editable install, which uv leaves as source); a module edited
# since is compiled again here, or at import where the cache may be written.
compile_src() { "$VENV/bin/python" -m compileall -q src >/dev/null; }
# The whole of a virtualenv's installed code (uv's --compile-bytecode skips what was installed before).
compile_venv() {
  "$1" -m compileall -q -j 0 "$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
}
if ! command -v uv >/dev/null 2>&1; then
  log "installing uv"
  "$PY" -m pip install -q uv
fi

# The OpenSandbox lifecycle server, which the OpenSandbox tests start, needs a newer FastAPI than
# Airflow allows: it gets a virtualenv of its own, shared by every provider virtualenv.
SERVER_VENV="${SANDBOX_OPENSANDBOX_SERVER_VENV:-$PWD/.venv-opensandbox-server}"
SERVER_LOCK=requirements-opensandbox-server.lock
server_stamp="$SERVER_VENV/.lock-$( (sha256sum "$SERVER_LOCK"; echo "$BYTECODE") | sha256sum | cut -c1-16)"
if [ ! -f "$server_stamp" ]; then
  [ -x "$SERVER_VENV/bin/python" ] || uv venv -q -p "$PY" "$SERVER_VENV"
  log "installing the OpenSandbox server into $SERVER_VENV"
  uv pip install -q -p "$SERVER_VENV/bin/python" -r "$SERVER_LOCK"
  compile_venv "$SERVER_VENV/bin/python"
  rm -f "$SERVER_VENV"/.lock-*
  touch "$server_stamp"
fi

VENV="${SANDBOX_VENV:-$PWD/.venv}"
LOCK="${SANDBOX_LOCK:-requirements.lock}"
stamp="$VENV/.lock-$( (sha256sum "$LOCK" pyproject.toml; echo "$BYTECODE") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  compile_src
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  uv venv -q -p "$PY" "$VENV"
fi
log "installing locked dependencies into $VENV (first run takes a few minutes)"
uv pip install -q -p "$VENV/bin/python" -r "$LOCK"
compile_venv "$VENV/bin/python"
uv pip install -q -p "$VENV/bin/python" --no-deps -e .
compile_src
rm -f "$VENV"/.lock-*
touch "$stamp"
