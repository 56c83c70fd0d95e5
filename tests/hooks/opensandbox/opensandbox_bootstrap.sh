#!/bin/sh
# The entrypoint an OpenSandbox server gives every sandbox (as /opt/opensandbox/bootstrap.sh) when its
# execd image is the project's: start the guest daemon in the background, then become the sandbox's
# command (the server passes `tail -f /dev/null` by default; `-c "a && b"` runs a shell line).
#
#   EXECD       the daemon to start (default /opt/opensandbox/execd, which the server copied in)
#   EXECD_PORT  the port it listens on (default 44772, the port the server publishes)
set -eu

EXECD="${EXECD:-/opt/opensandbox/execd}"
if [ ! -x "$EXECD" ]; then
  echo "bootstrap: the guest daemon $EXECD is missing or not executable" >&2
  exit 127
fi
"$EXECD" </dev/null &

if [ "$#" -eq 0 ]; then
  set -- tail -f /dev/null
elif [ "$1" = "-c" ]; then
  shift
  set -- /bin/sh -c "$*"
fi
exec "$@"
