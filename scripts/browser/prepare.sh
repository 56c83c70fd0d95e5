#!/usr/bin/env bash
# Install the browser the UI tests drive (tests/browser): Debian's Chromium, headless, driven by
# the playwright package from the lock file against this system browser (no browser download).
#
# Environment:
#   SANDBOX_CHROMIUM   the browser the tests start (default /usr/bin/chromium)
set -euo pipefail

log() { printf '[prepare-browser] %s\n' "$*" >&2; }

CHROMIUM="${SANDBOX_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  log "browser ready: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "please install Chromium (e.g. sudo apt-get install chromium chromium-driver), or set SANDBOX_CHROMIUM"
  exit 1
fi
log "installing chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
log "browser ready: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
