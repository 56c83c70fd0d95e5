# Runs one command in a Docker sandbox, as the command user (root only with the opt-in).
#
#   $1  the deadline in seconds, as coreutils timeout reads it (never 0, which it reads as none)
#   $2  the command, for sh -c (its standard input is /dev/null)
#   $3  optional: the text of stage.sh, run first to extract the archive on standard input as this
#       user; when that fails (status 125), the command does not run
#
# At the deadline timeout SIGKILLs the command's shell. In the foreground mode timeout does not kill
# its own process group, itself included, so no shell reports "Killed" on top of the command's own
# output. When the command is over, by itself or at the deadline, one kill(-1) ends every other
# process this user has in the container: background jobs, nohup and setsid daemons, fork bombs.
# (As root it ends every process but PID 1, the keeper, which kill(-1) never reaches.) The hook
# runs this with the keeper's copy of sh, which the command cannot trace; a command that kills or
# stops this script instead leaves a status over 127 or an exec past its deadline, and then the
# hook has the keeper sweep the sandbox.
#
# With AIRFLOW_SANDBOX_STATUS set (the hook's token for this one exec), it takes the token out of
# the environment before the command starts and, once everything is ended, writes the status trailer
# "\036sandbox-status:<token>:<status>" as its last line on stderr: the command cannot read the token
# (this shell's memory is closed to it), so it cannot forge that line.
t=${AIRFLOW_SANDBOX_STATUS-}
unset AIRFLOW_SANDBOX_STATUS
if [ -n "${3-}" ]; then
  sh -c "$3" sandbox-stage
  rc=$?
  if [ "$rc" -ne 0 ]; then
    [ -z "$t" ] || printf '\036sandbox-status:%s:%s\n' "$t" "$rc" >&2
    exit "$rc"
  fi
fi
timeout --foreground -s KILL "$1" sh -c "$2" < /dev/null
rc=$?
kill -KILL -1 2>/dev/null
[ -z "$t" ] || printf '\036sandbox-status:%s:%s\n' "$t" "$rc" >&2
exit "$rc"
