#!/usr/bin/env bash
# Run a command under load, to reproduce a test that passes only on an idle machine:
#
#   bash scripts/load.sh bash scripts/test.sh -n auto tests/toolsets
#
# Around the command, stress-ng (Debian's) runs two CPU hogs and one I/O hog that writes and reads
# files in a temporary directory of its own; they end with the command (at the latest after
# SANDBOX_LOAD_SECONDS, default 3 hours), and the command's exit status is this script's.
# Environment:
#   SANDBOX_LOAD_CPU       CPU hogs (default 2)
#   SANDBOX_LOAD_IO        I/O hogs (default 1)
#   SANDBOX_LOAD_SECONDS   the longest the hogs run (default 10800)
set -euo pipefail

if [ "$#" = 0 ]; then
  echo "usage: bash scripts/load.sh COMMAND [ARG...]" >&2
  exit 2
fi
if ! command -v stress-ng >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[load] installing stress-ng" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends stress-ng >/dev/null
  else
    echo "[load] please install stress-ng (e.g. sudo apt-get install stress-ng)" >&2
    exit 1
  fi
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/sandbox-load-XXXXXX")
stress-ng --cpu "${SANDBOX_LOAD_CPU:-2}" --hdd "${SANDBOX_LOAD_IO:-1}" --hdd-bytes 256M \
  --temp-path "$scratch" --timeout "${SANDBOX_LOAD_SECONDS:-10800}" --quiet &
hogs=$!
stop_hogs() {
  kill -INT "$hogs" 2>/dev/null || true
  wait "$hogs" 2>/dev/null || true
  rm -rf "$scratch"
}
trap stop_hogs EXIT
echo "[load] stress-ng (pid $hogs): ${SANDBOX_LOAD_CPU:-2} CPU hogs, ${SANDBOX_LOAD_IO:-1} I/O hog; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

status=0
"$@" || status=$?
echo "[load] the command ended with status $status; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit "$status"
