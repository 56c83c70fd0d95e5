# Runs one command inside a sandbox under a deadline, for backends whose service neither kills a
# command at its deadline nor keeps the end of its output (Islo, Boat). POSIX sh; needs coreutils
# `timeout`, `mktemp`, `tail` and `wc` in the guest.
#
# The command runs in its own process group (coreutils `timeout` makes one) with its output going
# to two files in a private scratch directory (mode 0700, under $TMPDIR or /tmp, removed at the
# end), and its standard input from /dev/null. So a background job that keeps the output open does
# not hold the call, and output of any size costs the service nothing. At the deadline the whole
# group gets SIGTERM, and SIGKILL $2 seconds later; when the command ends first, what it left
# running in its group is killed then, so background jobs do not outlive it (a process that left
# the group with setsid does). Then the tail of each file is replayed.
#
# Positional arguments:
#   $1  the deadline, in hundredths of a second (a whole number, at least 1)
#   $2  seconds from SIGTERM to SIGKILL at the deadline (a whole number)
#   $3  bytes replayed from the end of each stream (a whole number, at least 1)
#   $4  1: run the command in a login shell (bash -l if the guest has bash, else sh -l), so the
#       guest's profile applies first; 0: plain `sh -c`
#   $5  the command
#
# Standard output: the last $3 bytes the command wrote there. Standard error: the last $3 bytes it
# wrote there, then one status line, which always comes last:
#   "\nairflow-sandbox-status <exit status> <1 if the deadline stopped it, else 0> <bytes the
#   command wrote to stdout> <bytes it wrote to stderr> <newlines it wrote to stdout> <newlines it
#   wrote to stderr>\n"
# Exit status: the command's; 125 (with a message on stderr and no status line) if the wrapper
# cannot run it; 143, 130 or 129 if the wrapper itself gets SIGTERM, SIGINT or SIGHUP, which it
# passes on to the command's group first.

set -u
hundredths=$1 grace=$2 keep=$3 login=$4 command=$5

if ! command -v timeout >/dev/null 2>&1; then
  echo "airflow-sandbox: this sandbox has no 'timeout' command (GNU coreutils), which runs commands under their deadline; use an image with coreutils" >&2
  exit 125
fi
scratch=$(mktemp -d "${TMPDIR:-/tmp}/airflow-sandbox-run.XXXXXXXX") || {
  echo "airflow-sandbox: cannot create a scratch directory under ${TMPDIR:-/tmp}" >&2
  exit 125
}
chmod 700 "$scratch"
child=

stop() {
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null
    wait "$child" 2>/dev/null
    kill -KILL "-$child" 2>/dev/null
  fi
  rm -rf "$scratch"
  exit "$1"
}
trap 'stop 143' TERM
trap 'stop 130' INT
trap 'stop 129' HUP

# Hundredths of a second since boot (Linux), or since the epoch where /proc is missing.
now() {
  if read -r up _ </proc/uptime 2>/dev/null; then
    echo $(( ${up%.*} * 100 + 1${up#*.} - 100 ))
  else
    echo $(( $(date +%s) * 100 ))
  fi
}

if [ "$login" = 1 ]; then
  if command -v bash >/dev/null 2>&1; then set -- bash -lc; else set -- sh -lc; fi
else
  set -- sh -c
fi
seconds=$(printf '%d.%02d' $((hundredths / 100)) $((hundredths % 100)))

began=$(now)
timeout -k "$grace" "$seconds" "$@" "$command" </dev/null >"$scratch/out" 2>"$scratch/err" &
child=$!
wait "$child" 2>/dev/null
status=$?
ended=$(now)
kill -KILL "-$child" 2>/dev/null
child=

late=0
if { [ "$status" = 124 ] || [ "$status" = 137 ]; } && [ $((ended - began)) -ge "$hundredths" ]; then
  late=1
fi
out_bytes=$(wc -c <"$scratch/out")
err_bytes=$(wc -c <"$scratch/err")
out_lines=$(wc -l <"$scratch/out")
err_lines=$(wc -l <"$scratch/err")
tail -c "$keep" "$scratch/out"
tail -c "$keep" "$scratch/err" >&2
printf '\nairflow-sandbox-status %d %d %d %d %d %d\n' "$status" "$late" $out_bytes $err_bytes $out_lines $err_lines >&2
rm -rf "$scratch"
exit "$status"
