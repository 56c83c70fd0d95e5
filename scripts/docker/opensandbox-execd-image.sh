#!/usr/bin/env bash
# Build the execd image an OpenSandbox server copies into every sandbox, without any registry:
# FROM the local sandbox image, holding the project's guest daemon as /execd and its entrypoint as
# /bootstrap.sh (the two files the server takes out of its `[runtime] execd_image`).
#
# Test infrastructure: the image exists so the tests can run the real opensandbox-server here. A
# deployment uses the vendor's execd image; nothing in the provider needs or ships this one.
#
#   opensandbox-execd-image.sh [BASE_IMAGE]   (default airflow-sandbox-python:<debian codename>)
#
# Environment:
#   SANDBOX_EXECD_IMAGE   image tag to build (default airflow-sandbox-execd:<debian codename>)
#
# Cached by content: the image carries a label with the hash of both files and of the base image's
# id, and is rebuilt only when one of them changed.
set -euo pipefail

log() { printf '[execd-image] %s\n' "$*" >&2; }

HERE="$(cd "$(dirname "$0")" && pwd)"
# The daemon is test infrastructure: it lives with the OpenSandbox tests, not in the package.
GUEST="$HERE/../../tests/hooks/opensandbox"
# shellcheck disable=SC1091
. /etc/os-release
CODENAME="${VERSION_CODENAME:?/etc/os-release names no VERSION_CODENAME}"
BASE="${1:-airflow-sandbox-python:${CODENAME}}"
IMAGE="${SANDBOX_EXECD_IMAGE:-airflow-sandbox-execd:${CODENAME}}"
LABEL=org.airflow-sandbox.execd-content

base_id="$(docker image inspect --format '{{.Id}}' "$BASE")"
content="$( (cat "$GUEST/opensandbox_execd.py" "$GUEST/opensandbox_bootstrap.sh"; printf '%s' "$base_id") \
  | sha256sum | cut -c1-16)"
if [ "$(docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$IMAGE" 2>/dev/null || true)" = "$content" ]; then
  log "image $IMAGE is current ($content)"
  exit 0
fi

CONTEXT="$(mktemp -d)"
trap 'rm -rf "$CONTEXT"' EXIT
cp "$GUEST/opensandbox_execd.py" "$CONTEXT/execd"
cp "$GUEST/opensandbox_bootstrap.sh" "$CONTEXT/bootstrap.sh"
cat >"$CONTEXT/Dockerfile" <<DOCKERFILE
FROM $BASE
COPY execd bootstrap.sh /
RUN chmod 0755 /execd /bootstrap.sh
LABEL $LABEL=$content
LABEL org.opencontainers.image.description="airflow-provider-sandbox test infrastructure: a stand-in for OpenSandbox's execd, for the tests' server only"
DOCKERFILE
old_id="$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "building $IMAGE from $BASE ($content)"
docker build -q -t "$IMAGE" "$CONTEXT" >"$CONTEXT/build.log" 2>&1 || { cat "$CONTEXT/build.log" >&2; exit 1; }
# The image this one replaces is ours and now untagged: remove it unless a container still uses it.
[ -z "$old_id" ] || docker image rm "$old_id" >/dev/null 2>&1 || true
log "image $IMAGE ready"
