# Stops a detached command (job_start.sh): marks the job stopped and kills the command's process
# group, then waits at most 15 seconds for the runner to write the job's status.
#
#   $1  the job's directory
#
# Exit status: 0 once the job has a status (it may have ended by itself before); 66 when the
# directory is not there; 1 when no status came in time.
set -u
dir=$1
[ -d "$dir" ] || exit 66
[ -e "$dir/status" ] && exit 0
: > "$dir/stopped"
group=$(cat -- "$dir/pid" 2>/dev/null)
case $group in
  ''|*[!0-9]*) ;;
  *) kill -KILL "-$group" 2>/dev/null ;;
esac
tries=0
while [ ! -e "$dir/status" ]; do
  [ "$tries" -ge 150 ] && exit 1
  tries=$((tries + 1))
  sleep 0.1
done
