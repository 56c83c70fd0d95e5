#!/usr/bin/env bash
# Prepare a Docker Engine for the Docker sandbox backend and its tests, without any image registry.
#
#   1. install Docker Engine (Debian's docker.io) and debootstrap when they are missing;
#   2. start dockerd when no engine answers, and wait until it does;
#   3. build the sandbox image from Debian packages (debootstrap, then `docker import`), unless the
#      engine already has it. The root filesystem tarball is cached, so later runs only import it;
#   4. build the OpenSandbox execd image FROM it (opensandbox-execd-image.sh), cached by content.
#
# Environment:
#   SANDBOX_DOCKER_IMAGE   image tag to build      (default airflow-sandbox-python:<debian codename>)
#   SANDBOX_DOCKER_CACHE   tarball cache directory (default /var/cache/airflow-sandbox)
#   SANDBOX_DOCKER_REBUILD set to 1 to ignore the cache and the existing image
#
# The Debian mirror is read from this machine's apt configuration at run time; none is written here.
set -euo pipefail

log() { printf '[prepare-docker] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: it installs packages, starts dockerd and runs debootstrap"

# shellcheck disable=SC1091
. /etc/os-release
CODENAME="${VERSION_CODENAME:?/etc/os-release names no VERSION_CODENAME}"
IMAGE="${SANDBOX_DOCKER_IMAGE:-airflow-sandbox-python:${CODENAME}}"
CACHE_DIR="${SANDBOX_DOCKER_CACHE:-/var/cache/airflow-sandbox}"
PACKAGES="python3,procps"
# The recipe's fingerprint names the tarball, so changing the package list rebuilds it.
RECIPE_ID="$(printf '%s|%s|minbase|1' "$CODENAME" "$PACKAGES" | sha256sum | cut -c1-12)"
TARBALL="${CACHE_DIR}/rootfs-${CODENAME}-${RECIPE_ID}.tar.gz"

# -- 1. packages ------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v cgroupfs-mount >/dev/null 2>&1 || need+=(cgroupfs-mount)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ "${#need[@]}" -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# -- 2. the engine ----------------------------------------------------------------------------
engine_up() { docker info >/dev/null 2>&1; }
if ! engine_up; then
  # A machine that booted without an init system may have no cgroup hierarchy mounted yet.
  if ! awk '$3 == "cgroup" || $3 == "cgroup2" { found = 1 } END { exit !found }' /proc/mounts; then
    log "mounting cgroup hierarchies"
    cgroupfs-mount || log "cgroupfs-mount failed; dockerd may not start"
  fi
  log "starting dockerd (log: /var/log/airflow-sandbox-dockerd.log)"
  setsid nohup dockerd >/var/log/airflow-sandbox-dockerd.log 2>&1 </dev/null &
  for _ in $(seq 1 60); do
    engine_up && break
    sleep 1
  done
  engine_up || { tail -n 30 /var/log/airflow-sandbox-dockerd.log >&2 || true; die "dockerd did not answer within 60 s"; }
fi
log "engine ready: $(docker version --format '{{.Server.Version}}' 2>/dev/null || echo unknown)"

# -- 3. the image -----------------------------------------------------------------------------
if [ "${SANDBOX_DOCKER_REBUILD:-0}" != 1 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE already present"
  bash "$(dirname "$0")/opensandbox-execd-image.sh" "$IMAGE"
  exit 0
fi

# The first apt source of type deb that serves this release's main component.
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$CODENAME" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && (" " comps " ") ~ / main /) {
          split(uris, u, " "); print u[1]; found = 1; exit
        }
        types = suites = comps = uris = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      /^Types:/      { sub(/^Types:[ \t]*/, "");      types = $0 }
      /^URIs:/       { sub(/^URIs:[ \t]*/, "");       uris = $0 }
      /^Suites:/     { sub(/^Suites:[ \t]*/, "");     suites = $0 }
      /^Components:/ { sub(/^Components:[ \t]*/, ""); comps = $0 }
      END { if (!found) flush() }
    ' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v suite="$CODENAME" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { for (j = i + 2; j <= NF; j++) if ($j == "main") { print $i; exit } }
      }
    ' "$f"
  done
}

if [ "${SANDBOX_DOCKER_REBUILD:-0}" = 1 ] || [ ! -s "$TARBALL" ]; then
  MIRROR="$(apt_mirror | head -n 1)"
  [ -n "$MIRROR" ] || die "no apt source of type deb serves '$CODENAME main'; check /etc/apt/sources.list*"
  log "building a $CODENAME root filesystem with debootstrap (packages: $PACKAGES)"
  mkdir -p "$CACHE_DIR"
  ROOTFS="$(mktemp -d /var/tmp/airflow-sandbox-rootfs.XXXXXX)"
  trap 'rm -rf "$ROOTFS"' EXIT
  debootstrap --variant=minbase --include="$PACKAGES" "$CODENAME" "$ROOTFS" "$MIRROR" >/var/log/airflow-sandbox-debootstrap.log 2>&1 \
    || { tail -n 30 /var/log/airflow-sandbox-debootstrap.log >&2; die "debootstrap failed"; }
  # Trim what a sandbox never needs: package caches and lists, docs, locales.
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/*
  # No mirror stays inside the image: it has no network, and it should not carry this machine's config.
  rm -f "$ROOTFS"/etc/apt/sources.list "$ROOTFS"/etc/apt/sources.list.d/*
  mkdir -p "$ROOTFS/workspace"
  tar -C "$ROOTFS" --numeric-owner -czf "${TARBALL}.tmp" .
  mv "${TARBALL}.tmp" "$TARBALL"
  rm -rf "$ROOTFS"
  trap - EXIT
fi

log "importing $TARBALL as $IMAGE"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /workspace' \
  --change 'CMD ["/bin/bash"]' \
  --change 'LABEL org.opencontainers.image.title=airflow-sandbox-python' \
  "$TARBALL" "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -c 'import sys; print("sandbox image python", sys.version.split()[0])' >&2
log "image $IMAGE ready"

# -- 4. the OpenSandbox execd image, FROM the sandbox image ----------------------------------
bash "$(dirname "$0")/opensandbox-execd-image.sh" "$IMAGE"
