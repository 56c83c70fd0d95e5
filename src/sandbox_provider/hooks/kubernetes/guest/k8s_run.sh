# Runs one command in a Kubernetes sandbox, through exec, as the pod's user.
#
#   $1  the deadline in seconds, as coreutils timeout reads it (never 0, which it reads as none)
#   $2  the working directory (exec has no working directory of its own)
#   $3  the command, for sh -c (its standard input is /dev/null)
#   $4  the text of stage.sh, run first to extract the archive on standard input (empty: nothing to
#       extract); when that fails (status 125, "sandbox-stage-failed" on stderr), the command does not run
#
# At the deadline timeout SIGKILLs the command's shell; in the foreground mode it does not kill its own
# process group, so no shell reports "Killed" on top of the command's output. When the command is over,
# by itself or at the deadline, one kill(-1) ends every other process of the pod's user in the
# container (background jobs, nohup and setsid daemons, fork bombs) but PID 1, the keeper, which
# kill(-1) never reaches. The exit status is the command's, and the cluster reports it on the exec's
# status channel. A command that kills or stops this script instead leaves a status over 127 or an exec
# past its deadline, and the hook then sweeps the sandbox with a kill(-1) of its own.
cd -- "$2" || { echo "airflow-sandbox: cannot enter the working directory $2" >&2; exit 125; }
if [ -n "$4" ]; then
  sh -c "$4" sandbox-stage || exit "$?"
fi
timeout --foreground -s KILL "$1" sh -c "$3" < /dev/null
rc=$?
kill -KILL -1 2>/dev/null
exit "$rc"
