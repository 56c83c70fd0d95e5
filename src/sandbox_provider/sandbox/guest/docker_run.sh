# Runs one command in a Docker sandbox, as the command user (root only with the opt-in).
#
#   $1  the deadline in seconds, as coreutils timeout reads it (never 0, which it reads as none)
#   $2  the command, for sh -c
#
# At the deadline timeout SIGKILLs the command's shell. In the foreground mode timeout does not kill
# its own process group, itself included, so no shell reports "Killed" on top of the command's own
# output. When the command is over, by itself or at the deadline, one kill(-1) ends every other
# process this user has in the container: background jobs, nohup and setsid daemons, fork bombs.
# (As root it ends every process but PID 1, the keeper, which kill(-1) never reaches.) The hook
# runs this with the keeper's copy of sh, which the command cannot trace; a command that kills or
# stops this script instead leaves a status over 127 or an exec past its deadline, and then the
# hook has the keeper sweep the sandbox.
timeout --foreground -s KILL "$1" sh -c "$2"
rc=$?
kill -KILL -1 2>/dev/null
exit "$rc"
