# The runner of one detached command (started by job_start.sh, in a session of its own).
#
#   $1  the job's directory     $2  the deadline for coreutils timeout     $3  the same in hundredths
#   $4  bytes per segment       $5  segments kept per stream               $6  the command
#
# The command's standard output and error go through two FIFOs to two segment writers, which write
# each stream in segments of $4 bytes, "out.N" and "err.N" for the Nth, N in 9 digits (so byte B of a
# stream is in segment B / $4, at B % $4), remove segment N - $5 as segment N begins, and count the
# newlines of each finished segment in "out.lines" and "err.lines". The command runs under coreutils timeout,
# which puts it in a process group of its own ("pid" holds its number) and kills it at the deadline;
# when it ends, whatever it left in its group is killed too. Once the writers have finished (at most
# 10 seconds after: a process that left the group may hold a FIFO open), "status" is written
# atomically: "<exit status> <1 if the deadline stopped it, else 0>". "stopped" is job_stop.sh's mark.
set -u
dir=$1 deadline=$2 hundredths=$3 seg=$4 keep=$5 command=$6

fail() { echo "$1" > "$dir/failed"; exit 125; }

centis() { read -r up _ < /proc/uptime; expr "${up%.*}${up#*.}" + 0; }

# One stream: GNU split writes it in segments of $seg bytes as it arrives, each through the filter,
# which removes the segment $keep before it, copies its own (cat writes as it reads), then adds its
# newlines to the stream's count. split runs one filter at a time, in order.
segments() {
  JOB_KEEP=$keep SHELL=/bin/sh split -a 9 -d -b "$seg" --filter='
n=$(expr "${FILE##*.}" + 0)
[ "$n" -lt "$JOB_KEEP" ] || rm -f -- "${FILE%.*}.$(printf %09d $((n - JOB_KEEP)))"
cat > "$FILE"
lines=$(cat -- "${FILE%.*}.lines" 2>/dev/null || echo 0)
echo $((lines + $(tr -cd "\n" < "$FILE" | wc -c))) > "$FILE.tmp" && mv -f -- "$FILE.tmp" "${FILE%.*}.lines"' - "$dir/$1."
}

mkfifo -m 600 "$dir/out.fifo" "$dir/err.fifo" || fail "cannot make FIFOs in $dir"
segments out < "$dir/out.fifo" &
writer_out=$!
segments err < "$dir/err.fifo" &
writer_err=$!
began=$(centis)
timeout -s KILL "$deadline" sh -c "$command" < /dev/null > "$dir/out.fifo" 2> "$dir/err.fifo" &
group=$!
echo "$group" > "$dir/pid"
: > "$dir/started"
wait "$group"
rc=$?
ended=$(centis)
kill -KILL "-$group" 2>/dev/null
timed=0
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  [ -e "$dir/stopped" ] || [ $((ended - began)) -lt "$hundredths" ] || timed=1
fi
waited=0
while kill -0 "$writer_out" 2>/dev/null || kill -0 "$writer_err" 2>/dev/null; do
  if [ "$waited" -ge 100 ]; then
    kill -KILL "$writer_out" "$writer_err" 2>/dev/null
    break
  fi
  waited=$((waited + 1))
  sleep 0.1
done
wait "$writer_out" "$writer_err" 2>/dev/null
rm -f -- "$dir/out.fifo" "$dir/err.fifo"
echo "$rc $timed" > "$dir/status.tmp" && mv -f -- "$dir/status.tmp" "$dir/status"
