#!/bin/sh
# Test infrastructure, in the tests' OpenSandbox execd image only: the entrypoint an OpenSandbox server
# gives every sandbox (as /opt/opensandbox/bootstrap.sh) when its execd image is the project's. Run as
# root, it gives the command user the working directory (the image's WORKDIR, unless that is /), starts
# the guest daemon in the background as root (so no command can signal it or take its port; the daemon
# runs commands as that user and takes EXECD_ACCESS_TOKEN from the environment), then becomes the
# sandbox's own command with the token gone from its environment (the server passes `tail -f /dev/null`
# by default; `-c "a && b"` runs a shell line).
#
#   EXECD               the daemon to start (default /opt/opensandbox/execd, which the server copied in)
#   EXECD_PORT          the port it listens on (default 44772, the port the server publishes)
#   EXECD_ACCESS_TOKEN  the token every request to the daemon must carry
#   EXECD_COMMAND_UID, EXECD_COMMAND_GID   the command user (default 65432, and the same group id)
set -eu

EXECD="${EXECD:-/opt/opensandbox/execd}"
if [ ! -x "$EXECD" ]; then
  echo "bootstrap: the guest daemon $EXECD is missing or not executable" >&2
  exit 127
fi
if [ "$(id -u)" = 0 ]; then
  EXECD_COMMAND_UID="${EXECD_COMMAND_UID:-65432}"
  EXECD_COMMAND_GID="${EXECD_COMMAND_GID:-$EXECD_COMMAND_UID}"
  EXECD_COMMAND_HOME="$(pwd)"
  export EXECD_COMMAND_UID EXECD_COMMAND_GID EXECD_COMMAND_HOME
  if [ "$EXECD_COMMAND_HOME" != / ]; then
    chown "$EXECD_COMMAND_UID:$EXECD_COMMAND_GID" "$EXECD_COMMAND_HOME"
  fi
fi
"$EXECD" </dev/null &
unset EXECD_ACCESS_TOKEN EXECD_COMMAND_UID EXECD_COMMAND_GID EXECD_COMMAND_HOME

if [ "$#" -eq 0 ]; then
  set -- tail -f /dev/null
elif [ "$1" = "-c" ]; then
  shift
  set -- /bin/sh -c "$*"
fi
exec "$@"
