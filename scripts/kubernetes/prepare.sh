#!/usr/bin/env bash
# A Kubernetes cluster on this machine's loopback for the Kubernetes sandbox backend and its tests,
# built from Debian's source package, with no image registry and no host setting changed.
#
#   prepare.sh [start]   build once (cached), then start the cluster unless it is up already
#   prepare.sh stop      end the processes this script started (by their PID files), after deleting
#                        the cluster's pods so the kubelet removes their containers
#   prepare.sh status    exit 0 when the cluster answers and its node is Ready
#   prepare.sh build     only steps 1 to 3 below (the binaries and the images), whether or not it is up
#
# What it does on start:
#   1. installs what it needs from Debian: etcd-server, golang-1.19-go, rsync, make, dpkg-dev, openssl,
#      and adds deb-src entries (a file of ours under /etc/apt/sources.list.d/) only when none exist;
#   2. builds kube-apiserver, kube-controller-manager, kube-scheduler and kubelet from the source of
#      Debian's `kubernetes` package (1.20) once, into $CACHE/kubernetes-<source version>-<patch id>/bin,
#      GOPATH mode as Debian's rules build it (`make gen_openapi` first: the generated OpenAPI file is not
#      in the tarball), with `-tags providerless` (no cloud providers). Test-build patches: this
#      machine's root lacks CAP_SYS_RESOURCE, so the negative oom_score_adj of the pod's infra container
#      (-998) and of Guaranteed pods (-997) cannot be set, and are set to 0; the kubelet does not touch
#      the Docker daemon's processes (it would move them and lower their oom_score_adj); the node's
#      address may be 127.0.0.1 (real nodes may not use loopback); and the vendored reflect2 1.0.1 gets the map iterator of Go 1.18+ (with Go 1.19 every component crashes
#      encoding a map to JSON otherwise);
#   3. builds the pause image (`airflow-sandbox-pause:<codename>`) FROM the sandbox image that
#      scripts/docker/prepare.sh builds from Debian packages;
#   4. makes a CA, serving and client certificates, a service-account key and bearer tokens, and writes
#      kubeconfigs: $STATE/admin.kubeconfig (system:masters, for tests and set-up) and
#      $STATE/worker.kubeconfig (a user with no rights until a RoleBinding grants some);
#   5. starts etcd, kube-apiserver (TLS and tokens on 127.0.0.1), kube-controller-manager,
#      kube-scheduler and the kubelet on the local Docker Engine (dockershim, no network plugin): the
#      kubelet in a mount namespace of its own where the kernel settings it would write
#      (vm/overcommit_memory, kernel/panic, ...) are copies, with no iptables chains, no image garbage
#      collection (other images on the Engine are not its to remove), its own root directory and
#      cgroup root; then waits until the node is Ready.
#
# Environment:
#   SANDBOX_KUBERNETES_CACHE   build cache (default /var/cache/airflow-sandbox)
#   SANDBOX_KUBERNETES_STATE   state: data, certificates, kubeconfigs (default /var/lib/airflow-sandbox-kubernetes)
#   SANDBOX_DOCKER_IMAGE       the sandbox image (default airflow-sandbox-python:<codename>)
#
# Ports, all on 127.0.0.1: etcd 12379 (peers 12380), kube-apiserver 16443, kubelet 20250 (health 20248).
set -euo pipefail

log() { printf '[prepare-kubernetes] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: it installs packages, starts a kubelet and talks to the Docker Engine"

HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck disable=SC1091
. /etc/os-release
CODENAME="${VERSION_CODENAME:?/etc/os-release names no VERSION_CODENAME}"
CACHE="${SANDBOX_KUBERNETES_CACHE:-/var/cache/airflow-sandbox}"
STATE="${SANDBOX_KUBERNETES_STATE:-/var/lib/airflow-sandbox-kubernetes}"
RUN="$STATE/run"
LOGS="$STATE/log"
SANDBOX_IMAGE="${SANDBOX_DOCKER_IMAGE:-airflow-sandbox-python:${CODENAME}}"
PAUSE_IMAGE="airflow-sandbox-pause:${CODENAME}"
NODE=airflow-sandbox-node
ETCD_PORT=12379 ETCD_PEER_PORT=12380 API_PORT=16443 KUBELET_PORT=20250 KUBELET_HEALTH_PORT=20248
CGROUP_ROOT=/airflow-sandbox-kubernetes
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet)
#: The kernel settings the kubelet sets (pkg/kubelet/cm setupKernelTunables): masked, never written.
KERNEL_SETTINGS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops
  kernel/keys/root_maxkeys kernel/keys/root_maxbytes)
#: Bump to rebuild when the patches below change.
PATCH_ID=oom0-nodocker-reflect2-loopback-1

# -- processes by PID file --------------------------------------------------------------------------

pid_of() {
  # The PID in the component's file, when that process still runs the binary it was started from.
  local name=$1 pid exe
  [ -s "$RUN/$name.pid" ] || return 1
  pid=$(cat "$RUN/$name.pid")
  [ -d "/proc/$pid" ] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  [ "$exe" = "$(cat "$RUN/$name.exe" 2>/dev/null)" ] || return 1
  echo "$pid"
}

stop_component() {
  local name=$1 pid
  pid=$(pid_of "$name") || { rm -f "$RUN/$name.pid"; return 0; }
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    [ -d "/proc/$pid" ] || break
    sleep 0.2
  done
  [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$RUN/$name.pid"
}

api_get() { # path [curl arguments...]: as the cluster's admin
  local path=$1
  shift
  [ -s "$STATE/pki/admin.token" ] || return 1
  curl -fsS --max-time 10 --cacert "$STATE/pki/ca.crt" -H "Authorization: Bearer $(cat "$STATE/pki/admin.token")" \
    "$@" "https://127.0.0.1:$API_PORT$path" 2>/dev/null
}

api_ready() { api_get /readyz >/dev/null; }

node_ready() { # [since]: Ready since that Unix time at least, and the kubelet renewed its lease within a minute
  local node lease
  node=$(api_get "/api/v1/nodes/$NODE") && lease=$(api_get "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/$NODE") ||
    return 1
  python3 -c '
import datetime, json, sys
def seconds(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
node, lease, since = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
now = datetime.datetime.now(datetime.timezone.utc).timestamp()
ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready" and c["status"] == "True"]
fresh = now - 60 <= seconds(lease["spec"]["renewTime"])
sys.exit(0 if ready and fresh and seconds(ready[0]["lastHeartbeatTime"]) >= since - 1 else 1)' "$node" "$lease" "${1:-0}" 2>/dev/null
}

cluster_up() {
  local name
  for name in "${COMPONENTS[@]}"; do pid_of "$name" >/dev/null || return 1; done
  api_ready && node_ready
}

remove_cgroups() {
  # Our cgroup root in every v1 hierarchy, deepest first; a cgroup with a process left stays.
  local dir
  for dir in /sys/fs/cgroup/*"$CGROUP_ROOT"; do
    [ -d "$dir" ] || continue
    find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

stop_cluster() {
  if pid_of kube-apiserver >/dev/null && pid_of kubelet >/dev/null; then
    # The kubelet removes the containers of the pods it runs once they are deleted.
    local ns left
    for ns in $(api_get /api/v1/namespaces |
      python3 -c 'import json,sys; print(" ".join(i["metadata"]["name"] for i in json.load(sys.stdin)["items"]))'); do
      api_get "/api/v1/namespaces/$ns/pods?gracePeriodSeconds=1" -X DELETE >/dev/null || true
    done
    for _ in $(seq 1 60); do
      left=$(docker ps -q --filter label=io.kubernetes.pod.namespace | wc -l)
      [ "$left" -eq 0 ] && break
      sleep 0.5
    done
  fi
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do stop_component "${COMPONENTS[i]}"; done
  remove_cgroups
}

case "${1:-start}" in
  stop)
    mkdir -p "$RUN"
    stop_cluster
    log "stopped"
    exit 0 ;;
  status)
    mkdir -p "$RUN"
    cluster_up && { log "up: KUBECONFIG=$STATE/admin.kubeconfig"; exit 0; }
    log "not up"
    exit 1 ;;
  start | build) ;;
  *) die "usage: $0 [start|stop|status|build]" ;;
esac
ACTION=${1:-start}

mkdir -p "$RUN" "$LOGS"
if [ "$ACTION" = start ] && cluster_up; then
  log "cluster already up (KUBECONFIG=$STATE/admin.kubeconfig)"
  exit 0
fi
started_at=$(date +%s)

# -- 1. packages and the source ---------------------------------------------------------------------

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -x /usr/lib/go-1.19/bin/go ] || need+=(golang-1.19-go)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v make >/dev/null 2>&1 || need+=(make)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
updated=0
if [ "${#need[@]}" -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  updated=1
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && docker image inspect "$SANDBOX_IMAGE" >/dev/null 2>&1 ||
  bash "$HERE/../docker/prepare.sh"

has_deb_src() {
  grep -hqsE '^[[:space:]]*deb-src[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list ||
    grep -hqsE '^Types:.*deb-src' /etc/apt/sources.list.d/*.sources
}
# Empty when apt knows no such source (apt-cache then exits 100, which must not end this script).
source_version() { { apt-cache showsrc kubernetes 2>/dev/null || true; } | awk '/^Version:/ { print $2; exit }'; }

VERSION="$(source_version)"
if [ -z "$VERSION" ]; then
  if ! has_deb_src; then
    # deb-src entries for the mirrors this machine already uses for deb (none is named here).
    src_file=/etc/apt/sources.list.d/airflow-sandbox-deb-src.sources
    log "adding deb-src entries ($src_file)"
    for f in /etc/apt/sources.list.d/*.sources; do
      [ -f "$f" ] && [ "$f" != "$src_file" ] || continue
      awk 'BEGIN { RS = ""; ORS = "\n\n" } /(^|\n)Types:[^\n]*deb/ && !/(^|\n)Enabled: *no/ { sub(/Types:[^\n]*/, "Types: deb-src"); print }' "$f"
    done >"$src_file"
    [ -s "$src_file" ] || { rm -f "$src_file"; die "no deb entry in /etc/apt/sources.list.d/*.sources to derive deb-src from; add one for '$CODENAME main'"; }
  fi
  [ "$updated" = 1 ] && [ -n "$(source_version)" ] || apt-get update -qq
  VERSION="$(source_version)"
  [ -n "$VERSION" ] || die "apt knows no source package 'kubernetes'; check the deb-src entries"
fi

BUILD="$CACHE/kubernetes-${VERSION//[^A-Za-z0-9.+-]/_}-$PATCH_ID"
BIN="$BUILD/bin"

# -- 2. the build -----------------------------------------------------------------------------------

patch_source() { # the test build's patches (see the header), each checked to have applied
  local src=$1 r="$1/vendor/github.com/modern-go/reflect2"
  sed -i 's/defaultSandboxOOMAdj int = -998/defaultSandboxOOMAdj int = 0/' "$src/pkg/kubelet/dockershim/docker_sandbox.go"
  sed -i 's/guaranteedOOMScoreAdj int = -997/guaranteedOOMScoreAdj int = 0/' "$src/pkg/kubelet/qos/policy.go"
  sed -i 's/^func (m \*containerManager) doWork() {$/&\n\treturn/' "$src/pkg/kubelet/dockershim/cm/container_manager_linux.go"
  sed -i 's/^\tif nodeIP.IsLoopback() {$/\tif false \&\& nodeIP.IsLoopback() {/' "$src/pkg/kubelet/kubelet_node_status.go"
  # reflect2 1.0.1 calls reflect.mapiterinit with its pre-1.18 signature; Go 1.18 and later fill a
  # caller-allocated iterator instead, so the JSON encoder of every component crashes on maps.
  sed -i 's|^func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer) \*hiter$|func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer, it *hiter)|' \
    "$r/unsafe_link.go"
  sed -i 's|^\t// rest fields are ignored$|\t// The rest of the runtime iterator of Go 1.18 and later, which reflect.mapiterinit fills in place.\n\tt, h, buckets, bptr, overflow, oldoverflow unsafe.Pointer\n\tstartBucket uintptr\n\toffset, wrapped, bucketShift, index uint8\n\tbucket, checkBucket uintptr|' \
    "$r/unsafe_link.go"
  printf '\n// newHiter starts an iteration over the map m of type rtype.\nfunc newHiter(rtype unsafe.Pointer, m unsafe.Pointer) *hiter {\n\tit := new(hiter)\n\tmapiterinit(rtype, m, it)\n\treturn it\n}\n' \
    >>"$r/unsafe_link.go"
  sed -i 's|hiter:      mapiterinit(type2.rtype, \*(\*unsafe.Pointer)(obj)),|hiter:      newHiter(type2.rtype, *(*unsafe.Pointer)(obj)),|' "$r/unsafe_map.go"
  grep -q 'defaultSandboxOOMAdj int = 0' "$src/pkg/kubelet/dockershim/docker_sandbox.go" &&
    grep -q 'guaranteedOOMScoreAdj int = 0' "$src/pkg/kubelet/qos/policy.go" &&
    grep -A1 '^func (m \*containerManager) doWork() {$' "$src/pkg/kubelet/dockershim/cm/container_manager_linux.go" | grep -q return &&
    grep -q 'if false && nodeIP.IsLoopback() {' "$src/pkg/kubelet/kubelet_node_status.go" &&
    grep -q 'm unsafe.Pointer, it \*hiter)$' "$r/unsafe_link.go" && grep -q 'bucket, checkBucket uintptr' "$r/unsafe_link.go" &&
    grep -q 'newHiter(type2.rtype' "$r/unsafe_map.go" ||
    die "the test-build patches did not apply to kubernetes $VERSION"
}

build() {
  local work="$BUILD/work" t0
  t0=$(date +%s)
  rm -rf "$work" && mkdir -p "$work" "$BUILD/gocache"
  log "fetching the source of kubernetes $VERSION"
  (cd "$work" && apt-get source -qq --download-only "kubernetes=$VERSION" >/dev/null 2>&1) ||
    die "apt-get source kubernetes=$VERSION failed"
  (cd "$work" && dpkg-source -x --no-check ./*.dsc src >/dev/null)
  local src="$work/src"
  patch_source "$work/src"
  log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet (log: $BUILD/build.log)"
  (
    export GOPATH="$src/.go" GO111MODULE=off CGO_ENABLED=0 GOFLAGS= GOCACHE="$BUILD/gocache" HOME="$work/home"
    export PATH="/usr/lib/go-1.19/bin:$PATH"
    mkdir -p "$GOPATH/src/k8s.io" "$HOME" "$BIN.tmp"
    ln -sfn ../../.. "$GOPATH/src/k8s.io/kubernetes"
    cd "$GOPATH/src/k8s.io/kubernetes"
    make gen_openapi
    # The version the components report: the upstream release Debian's version names.
    local upstream=${VERSION#*really} v=k8s.io/kubernetes/vendor/k8s.io ld="-s -w" minor
    upstream=${upstream%%[-+~]*}
    minor=${upstream#*.}
    for pkg in component-base/version client-go/pkg/version; do
      ld="$ld -X $v/$pkg.gitVersion=v$upstream -X $v/$pkg.gitMajor=${upstream%%.*} -X $v/$pkg.gitMinor=${minor%%.*}"
    done
    for c in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
      go build -tags providerless -ldflags "$ld" -o "$BIN.tmp/$c" "./cmd/$c"
    done
  ) >"$BUILD/build.log" 2>&1 || { tail -n 30 "$BUILD/build.log" >&2; die "the build failed (log: $BUILD/build.log)"; }
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
  echo "$VERSION" >"$BUILD/version"
  # The source, the Go cache and the generated files are not needed to run: keep only the binaries.
  rm -rf "$work" "$BUILD/gocache"
  log "built in $(($(date +%s) - t0)) s"
}

if [ ! -x "$BIN/kubelet" ]; then build; else log "binaries of kubernetes $VERSION cached in $BIN"; fi

# -- 3. the pause image -----------------------------------------------------------------------------

if ! docker image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
  log "building $PAUSE_IMAGE FROM $SANDBOX_IMAGE"
  printf '%s\n' "FROM $SANDBOX_IMAGE" \
    'LABEL org.opencontainers.image.title=airflow-sandbox-pause' \
    'CMD ["/bin/sh", "-c", "trap \"exit 0\" TERM INT; while :; do sleep 86400 & wait $!; done"]' |
    DOCKER_BUILDKIT=0 docker build -q -t "$PAUSE_IMAGE" - >/dev/null
fi
if [ "$ACTION" = build ]; then
  log "built in $(($(date +%s) - started_at)) s: $BIN, $PAUSE_IMAGE"
  exit 0
fi

# -- 4. certificates, tokens, kubeconfigs -----------------------------------------------------------

PKI="$STATE/pki"
make_pki() {
  mkdir -p "$PKI" && chmod 700 "$PKI"
  cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=airflow-sandbox-ca" 2>/dev/null
  sign() { # name subject extensions
    openssl req -new -newkey rsa:2048 -nodes -keyout "$1.key" -subj "$2" -addext "$3" 2>/dev/null |
      openssl x509 -req -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -copy_extensions copy -out "$1.crt" 2>/dev/null
  }
  sign apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"
  sign kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  local who token
  : >tokens.csv
  for who in admin node controller-manager scheduler worker; do
    token=$(openssl rand -hex 24)
    echo "$token" >"$who.token"
    case $who in
      admin) echo "$token,airflow-sandbox-admin,admin,\"system:masters\"" ;;
      node) echo "$token,system:node:$NODE,node,\"system:nodes\"" ;;
      controller-manager) echo "$token,system:kube-controller-manager,kcm" ;;
      scheduler) echo "$token,system:kube-scheduler,scheduler" ;;
      worker) echo "$token,airflow-sandbox-worker,worker" ;;
    esac >>tokens.csv
  done
  chmod 600 ./*.key ./*.token tokens.csv
  cd - >/dev/null
}
[ -s "$PKI/tokens.csv" ] || make_pki

kubeconfig() { # who file
  local ca
  ca=$(base64 -w0 <"$PKI/ca.crt")
  umask 077
  cat >"$2" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: airflow-sandbox
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $ca
users:
- name: $1
  user:
    token: $(cat "$PKI/$1.token")
contexts:
- name: $1@airflow-sandbox
  context:
    cluster: airflow-sandbox
    user: $1
    namespace: default
current-context: $1@airflow-sandbox
EOF
}
for who in admin node controller-manager scheduler worker; do kubeconfig "$who" "$STATE/$who.kubeconfig"; done

# -- 5. the processes -------------------------------------------------------------------------------

wait_for() { # what seconds command...
  local what=$1 until=$(($(date +%s) + $2))
  shift 2
  while [ "$(date +%s)" -lt "$until" ]; do
    "$@" && return 0
    sleep 0.2
  done
  die "$what did not come up within $2 s (logs: $LOGS)"
}

# Processes are recorded with the binary they run, checked again by `stop`, so a PID reused by another
# program is never signalled.
launch_exec() { # name binary args...
  local name=$1 binary=$2
  shift 2
  pid_of "$name" >/dev/null && return 0
  setsid "$binary" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
  readlink -f "$binary" >"$RUN/$name.exe"
}

mkdir -p "$STATE/etcd" && chmod 700 "$STATE/etcd"
launch_exec etcd "$(command -v etcd)" --name airflow-sandbox --data-dir "$STATE/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "airflow-sandbox=http://127.0.0.1:$ETCD_PEER_PORT"
wait_for etcd 30 curl -fs --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" -o /dev/null

launch_exec kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" --insecure-port 0 \
  --cert-dir "$STATE/apiserver" --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" --token-auth-file "$PKI/tokens.csv" \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range 10.254.0.0/24 --endpoint-reconciler-type none \
  --kubelet-client-certificate "$PKI/kubelet-client.crt" --kubelet-client-key "$PKI/kubelet-client.key" \
  --kubelet-preferred-address-types InternalIP,Hostname --profiling=false --allow-privileged=false
wait_for kube-apiserver 90 api_ready

launch_exec kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig "$STATE/controller-manager.kubeconfig" --leader-elect=false --port 0 --secure-port 0 \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" --use-service-account-credentials=true \
  --controllers '*,-csrsigning,-csrapproving,-nodeipam,-cloud-node-lifecycle,-service,-route' --profiling=false
launch_exec kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig "$STATE/scheduler.kubeconfig" --leader-elect=false --port 0 --secure-port 0 --profiling=false

# The kubelet: in a mount namespace of its own, where the kernel settings it sets are copies of the
# real ones (so the machine keeps its own), with its own cgroup root in every hierarchy. The host's own
# values are kept beside the copies (kernel-settings/host), for the tests to compare.
start_kubelet() {
  local mask="$STATE/kernel-settings" masks="" setting copy hierarchy
  mkdir -p "$mask/host" "$STATE/kubelet"
  for setting in "${KERNEL_SETTINGS[@]}"; do
    [ -e "/proc/sys/$setting" ] || continue
    copy="$mask/${setting//\//.}"
    cat "/proc/sys/$setting" >"$copy"
    cp "$copy" "$mask/host/${setting//\//.}"
    masks="$masks mount --bind '$copy' '/proc/sys/$setting' &&"
  done
  for hierarchy in /sys/fs/cgroup/*/; do
    # cgroup v1 hierarchies only (the kubelet's cgroupfs driver here); not the unified one.
    [ -f "$hierarchy/cgroup.procs" ] && [ ! -f "$hierarchy/cgroup.controllers" ] && mkdir -p "$hierarchy${CGROUP_ROOT#/}" || true
  done
  # unshare execs the shell, which execs the kubelet: the PID recorded is the kubelet's.
  setsid unshare --mount --propagation private sh -c "$masks exec \"\$@\"" kubelet "$BIN/kubelet" \
    --kubeconfig "$STATE/node.kubeconfig" --hostname-override "$NODE" --node-ip 127.0.0.1 \
    --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" --volume-plugin-dir "$STATE/kubelet/volume-plugins" \
    --container-runtime docker --docker-endpoint unix:///var/run/docker.sock --pod-infra-container-image "$PAUSE_IMAGE" \
    --cgroup-driver cgroupfs --cgroup-root "$CGROUP_ROOT" --cgroups-per-qos=true --enforce-node-allocatable pods \
    --address 127.0.0.1 --port "$KUBELET_PORT" --read-only-port 0 \
    --healthz-bind-address 127.0.0.1 --healthz-port "$KUBELET_HEALTH_PORT" \
    --anonymous-auth=false --client-ca-file "$PKI/ca.crt" --authorization-mode AlwaysAllow \
    --make-iptables-util-chains=false --hairpin-mode none --fail-swap-on=false \
    --image-gc-high-threshold 100 --image-gc-low-threshold 99 \
    --eviction-hard 'memory.available<100Mi,nodefs.available<1%,imagefs.available<1%' \
    --serialize-image-pulls=false --max-pods 110 >>"$LOGS/kubelet.log" 2>&1 </dev/null &
  echo $! >"$RUN/kubelet.pid"
  readlink -f "$BIN/kubelet" >"$RUN/kubelet.exe"
}
kubelet_since=0
if ! pid_of kubelet >/dev/null; then
  kubelet_since=$(date +%s)
  start_kubelet
fi
wait_for "the node $NODE" 120 node_ready "$kubelet_since"
for name in "${COMPONENTS[@]}"; do pid_of "$name" >/dev/null || die "$name ended (log: $LOGS/$name.log)"; done
# The namespaces of test and benchmark runs that were ended with the cluster (no run can use them now).
for ns in $(api_get /api/v1/namespaces | python3 -c '
import json, sys
for item in json.load(sys.stdin)["items"]:
    name = item["metadata"]["name"]
    if name.startswith(("sandbox-test-", "sandbox-bench-")) and not item["metadata"].get("deletionTimestamp"):
        print(name)'); do
  log "deleting namespace $ns, left by a run that ended with the cluster"
  api_get "/api/v1/namespaces/$ns" -X DELETE >/dev/null || true
done
log "cluster up in $(($(date +%s) - started_at)) s: KUBECONFIG=$STATE/admin.kubeconfig"
