# Runs one command in a Docker sandbox, as the command user (root only with the opt-in).
#
#   $1  the deadline in seconds, as coreutils timeout reads it (never 0, which it reads as none)
#   $2  the command, for sh -c (its standard input is /dev/null)
#   $3  the text of stage.sh, run first to extract the archive on standard input as this user
#       (empty: nothing to extract); when that fails (status 125), the command does not run
#   $4  the text of file.sh, to read back the file $5 (at most $6 bytes) once the command succeeded
#       and everything else is ended, as this user (empty: no read back)
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
# (this shell's memory is closed to it), so it cannot forge that line. A file read back rides on it,
# base64 after one more colon, when file.sh could read it (no process of the command is left then).
t=${AIRFLOW_SANDBOX_STATUS-}
unset AIRFLOW_SANDBOX_STATUS
if [ -n "$3" ]; then
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
back=
if [ "$rc" -eq 0 ] && [ -n "$t" ] && [ -n "$4" ] && back=$(sh -c "$4" sandbox-file "$5" "$6" base64 2>/dev/null); then
  set -f
  IFS='
'
  set -- $back
  IFS=
  back=":$*"
fi
[ -z "$t" ] || printf '\036sandbox-status:%s:%s%s\n' "$t" "$rc" "$back" >&2
exit "$rc"
