#!/usr/bin/env bash
# A second, private Docker Engine whose storage driver can limit a container's disk (btrfs on a
# loop-mounted file), for the test that writes past disk_bytes. The usual engine (overlay2 on
# ext4) cannot: it refuses --storage-opt size, and so does the Docker backend. xfs with pquota
# would do for overlay2 too, but not on kernels built without XFS quota support.
#
#   bash scripts/docker/quota-engine.sh start   # prints the DOCKER_HOST to use
#   bash scripts/docker/quota-engine.sh stop
#
# The engine has its own data, containerd and socket under $SANDBOX_QUOTA_DIR (default
# /var/tmp/airflow-sandbox-quota-engine), touches no iptables rule, and has a bridge of its own
# ($SANDBOX_QUOTA_BRIDGE, default airflow-qbr0, 10.255.254.1/24). Never start it with --bridge=none
# beside another engine: a dockerd without a bridge deletes the host's docker0 interface, which
# the usual engine's containers use. The sandbox image is copied into it from the usual engine
# (run scripts/docker/prepare.sh first).
set -euo pipefail

log() { printf '[quota-engine] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: it mounts a filesystem and starts dockerd"
DIR="${SANDBOX_QUOTA_DIR:-/var/tmp/airflow-sandbox-quota-engine}"
IMAGE="${SANDBOX_DOCKER_IMAGE:-airflow-sandbox-python:bookworm}"
SOCK="unix://$DIR/docker.sock"
BRIDGE="${SANDBOX_QUOTA_BRIDGE:-airflow-qbr0}"

stop() {
  local pid
  pid=$(cat "$DIR/dockerd.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  if mountpoint -q "$DIR/mnt"; then umount "$DIR/mnt"; fi
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE"; fi
  rm -rf "$DIR"
}

start() {
  if docker -H "$SOCK" info >/dev/null 2>&1; then
    echo "$SOCK"
    return
  fi
  command -v mkfs.btrfs >/dev/null 2>&1 || {
    log "installing btrfs-progs"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends btrfs-progs >/dev/null
  }
  mkdir -p "$DIR/mnt" "$DIR/exec"
  truncate -s 3G "$DIR/disk.img"
  mkfs.btrfs -q -f "$DIR/disk.img" >/dev/null
  mount -o loop "$DIR/disk.img" "$DIR/mnt" || die "cannot loop-mount a btrfs filesystem on this machine"
  # Quotas on from the start: enabled later (by dockerd, at the first sized container) over data
  # already there, the accounting is inconsistent until a rescan, and limits may not hold.
  btrfs quota enable "$DIR/mnt"
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add name "$BRIDGE" type bridge
    ip addr add 10.255.254.1/24 dev "$BRIDGE"
    ip link set "$BRIDGE" up
  fi
  setsid nohup dockerd --data-root "$DIR/mnt/data" --exec-root "$DIR/exec" --pidfile "$DIR/dockerd.pid" \
    -H "$SOCK" --storage-driver btrfs --bridge "$BRIDGE" --iptables=false --ip-masq=false \
    >"$DIR/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 1 60); do
    docker -H "$SOCK" info >/dev/null 2>&1 && break
    sleep 1
  done
  docker -H "$SOCK" info >/dev/null 2>&1 || { tail -n 20 "$DIR/dockerd.log" >&2; die "dockerd did not answer"; }
  docker image inspect "$IMAGE" >/dev/null 2>&1 || die "the usual engine has no $IMAGE; run scripts/docker/prepare.sh"
  docker save "$IMAGE" | docker -H "$SOCK" load >/dev/null
  log "engine with storage driver btrfs ready"
  echo "$SOCK"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 start|stop" ;;
esac
