# Starts one command detached in a sandbox and returns at once; the command's output and exit status
# stay in the job's directory, for job_poll.sh to read while it runs and after it ended.
#
#   $1  the job's directory (made here, mode 0700; it must not exist yet)
#   $2  the deadline, as coreutils timeout reads it (seconds, never 0)
#   $3  the deadline in hundredths of a second (a whole number), to tell a timeout from a kill
#   $4  bytes per output segment (a whole number, at least 1)
#   $5  segments kept per stream: older ones are removed as new ones begin, so the output kept
#       stays under $4 * $5 bytes per stream however much the command writes
#   $6  the text of job_run.sh, the runner, started in a session of its own (setsid)
#   $7  the command, for sh -c, in the current directory, its standard input /dev/null
#
# It waits until the runner has started the command (the file "started" in the directory), at most
# 30 seconds. Standard output: "airflow-sandbox-job started". Exit status: 0 once started; 125 with
# a line on standard error when the job cannot start (the directory exists, no mkfifo, no timeout).
set -u
dir=$1
for tool in timeout mkfifo split tr wc expr; do
  command -v "$tool" >/dev/null 2>&1 || { echo "airflow-sandbox: this sandbox has no '$tool' command (GNU coreutils), which detached commands need; use an image with coreutils" >&2; exit 125; }
done
split --filter=: /dev/null 2>/dev/null || { echo "airflow-sandbox: this sandbox's split has no --filter (GNU coreutils 8.13 or later), which detached commands need; use an image with GNU coreutils" >&2; exit 125; }
mkdir -m 700 -- "$dir" || { echo "airflow-sandbox: cannot make the job directory $dir" >&2; exit 125; }
if command -v setsid >/dev/null 2>&1; then
  setsid sh -c "$6" airflow-sandbox-job "$dir" "$2" "$3" "$4" "$5" "$7" </dev/null >/dev/null 2>&1 &
else
  sh -c "$6" airflow-sandbox-job "$dir" "$2" "$3" "$4" "$5" "$7" </dev/null >/dev/null 2>&1 &
fi
tries=0
while [ ! -e "$dir/started" ]; do
  if [ -e "$dir/failed" ] || [ "$tries" -ge 300 ]; then
    echo "airflow-sandbox: the job runner did not start the command: $(cat "$dir/failed" 2>/dev/null)" >&2
    exit 125
  fi
  tries=$((tries + 1))
  sleep 0.1
done
echo "airflow-sandbox-job started"
