# Runs one command inside a sandbox under a deadline, as the only thing in its own session, and
# leaves nothing it started running afterwards. For backends whose exec call cannot do that itself
# (OpenShell, sbx). POSIX sh; needs setsid, mktemp, sleep and a Linux /proc.
#
# Invocation:  sh -c "$PROGRAM" airflow-run SECONDS [WORKDIR [ENVFILE]]   (the command text on stdin)
#   SECONDS  the deadline, a positive decimal number of seconds (fractions allowed).
#   WORKDIR  where the command starts; empty for the current directory.
#   ENVFILE  a file of `export NAME='value'` lines sourced before the command; empty for none.
#
# The command runs as `sh FILE` with stdin from /dev/null; its stdout and stderr are this program's,
# so output streams as it is written. At the deadline every process of the command's session is
# stopped and killed, round after round until none is left, and so are processes a member of the
# session forked after leaving it (their parent is found before it exits). The same sweep runs when
# the command ends by itself, so background jobs do not outlive it (a process that detaches and
# whose parent has already exited escapes). Being terminated (TERM, HUP, INT) sweeps too.
#
# Exit status: the command's own (128+N when signal N killed it); 124 when the deadline passed.
# Reserved, each with one stderr line starting "airflow-sandbox:":
#   125  the command could not be staged or started (no temporary directory, bad WORKDIR,
#        unreadable ENVFILE, bad SECONDS);
#   127  setsid is missing in the image.
set -u

fail() { printf 'airflow-sandbox: %s\n' "$2" >&2; exit "$1"; }

secs=${1:-}
workdir=${2:-}
envfile=${3:-}
case $secs in
  '' | *[!0-9.]* | *.*.* | .) fail 125 "the deadline '$secs' is not a number of seconds" ;;
esac
command -v setsid >/dev/null 2>&1 || fail 127 "setsid is missing, so the command cannot run in its own session"
stage=$(mktemp -d "${TMPDIR:-/tmp}/airflow-run.XXXXXX" 2>/dev/null) || fail 125 "cannot create a temporary directory to stage the command"
if ! cat >"$stage/command"; then
  rm -rf "$stage"
  fail 125 "cannot stage the command in $stage"
fi
if [ -n "$workdir" ] && ! cd "$workdir" 2>/dev/null; then
  rm -rf "$stage"
  fail 125 "cannot enter the working directory $workdir"
fi

sid=""
timer=""
fired=0

# Stop, then kill, every live process in session $sid, the processes named in $extra (the timer),
# and every process descended from one found, until a /proc scan finds none (at most 50 rounds, so
# a fork bomb cannot keep the wrapper here forever).
extra=""
sweep() {
  [ -n "$sid" ] || return 0
  round=0
  while [ "$round" -lt 50 ]; do
    found=" "
    more=1
    while [ "$more" = 1 ]; do
      more=0
      for entry in /proc/[0-9]*; do
        pid=${entry#/proc/}
        case $found in *" $pid "*) continue ;; esac
        # The whole file: a process may put a newline in its name, which spans the line in two.
        stat=""
        while IFS= read -r part || [ -n "$part" ]; do stat="$stat$part "; done 2>/dev/null <"$entry/stat" || continue
        case $stat in *") "*) ;; *) continue ;; esac
        stat=${stat##*) }
        # shellcheck disable=SC2086
        set -- $stat
        [ "$#" -ge 4 ] || continue
        [ "$1" = Z ] && continue
        case " $extra $found" in
          *" $pid "* | *" $2 "*) ;;
          *) [ "$4" = "$sid" ] || continue ;;
        esac
        kill -s STOP "$pid" 2>/dev/null && found="$found$pid " && more=1
      done
    done
    [ "$found" = " " ] && return 0
    # shellcheck disable=SC2086
    kill -s KILL $found 2>/dev/null
    round=$((round + 1))
  done
}

finish() {
  # The timer and its sleep go too, before this exits: nothing of this run is left behind.
  extra=$timer
  sweep
  rm -rf "$stage"
  exit "$1"
}

trap 'fired=1' ALRM
trap 'finish 143' TERM
trap 'finish 129' HUP
trap 'finish 130' INT

# A background job of a non-interactive shell is not a process-group leader, so setsid does not
# fork: the job's pid is the new session's id.
setsid sh -c '
  if [ -n "$1" ]; then
    [ -r "$1" ] || { printf "airflow-sandbox: cannot read the environment file %s\n" "$1" >&2; exit 125; }
    . "$1"
  fi
  exec sh "$2"
' airflow-command "$envfile" "$stage/command" </dev/null &
sid=$!

wrapper=$$
(
  nap=""
  trap '[ -n "$nap" ] && kill "$nap" 2>/dev/null; exit 0' TERM
  sleep "$secs" &
  nap=$!
  wait "$nap" && kill -s ALRM "$wrapper"
) </dev/null >/dev/null 2>&1 &
timer=$!

wait "$sid"
status=$?
if [ "$fired" = 1 ] && kill -0 "$sid" 2>/dev/null; then
  sweep
  wait "$sid" 2>/dev/null
  finish 124
fi
finish "$status"
