# Presents the egress gateway's Unix socket as a TCP port on the sandbox's own loopback, then runs
# the command, for the local backend, whose every command gets a fresh network namespace. POSIX sh;
# needs socat and /proc.
#
# socat listens on 127.0.0.1:$1 (in the background, its output discarded, so it holds none of the
# command's pipes) and hands each connection to the socket at $2; the command starts once the port
# listens, so its first request finds it. It dies with the command's PID namespace. Killing it only
# cuts the sandbox off: the allowlist is the gateway's, outside.
#
# Positional arguments:
#   $1  the TCP port on 127.0.0.1 (1 to 65535)
#   $2  the gateway's socket, as the sandbox sees it
#   $3… the command and its arguments
#
# Exit status: the command's; 125 with one line on stderr when the forwarder did not start.
port=$1
socket=$2
shift 2
socat "TCP-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork" "UNIX-CONNECT:$socket" </dev/null >/dev/null 2>&1 &
forwarder=$!
listening=$(printf '0100007F:%04X 00000000:0000 0A' "$port")
tries=0
until grep -q "$listening" /proc/net/tcp 2>/dev/null; do
  tries=$((tries + 1))
  if [ "$tries" -gt 1000 ] || ! kill -0 "$forwarder" 2>/dev/null; then
    echo "airflow-sandbox: the egress forwarder (socat) did not start on 127.0.0.1:$port" >&2
    exit 125
  fi
  sleep 0.005
done
exec "$@"
