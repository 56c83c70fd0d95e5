# Reads what a detached command (job_start.sh) wrote since the given byte offsets, and how it ended.
#
#   $1  the job's directory   $2  bytes per segment (as the job was started with)
#   $3  the offset in standard output to read from    $4  the same in standard error
#       ("-N" for either: the last N bytes of that stream)
#   $5  the most bytes of each stream to read now
#   $6  "keep": record $3 and $4 in the job's directory as where the reader stands (it has handed on
#       everything before them), and the ends of what this poll returns as in flight (the reader is
#       handing them on, until its next record); "commit": record $3 and $4 with nothing in flight;
#       either unless the reader stood further already; anything else records nothing
#
# Standard output, five lines and two more:
#   "airflow-sandbox-job <state>"   state: "running", "ended <exit status> <timed out 0|1> <stopped 0|1>"
#   "kept <stdout> <stderr> <in flight stdout> <in flight stderr>"   the offsets a reader recorded it
#                                   stood at ("kept 0 0 0 0": none did), and the ends of what it was
#                                   handing on then, as the record stood before this poll
#   "out <from> <total> <newlines>" then the bytes of standard output from byte <from> on (at least
#                                   the offset asked; more when the segments before were removed),
#                                   base64 on one line (empty when none)
#   "err ..." and its line, the same for standard error
# <total> is the bytes the stream holds so far; <newlines> those in its finished segments (in all of
# it once the job ended). The state is read first: once it says ended, the output is complete.
# Exit status: 0; 66 when the directory is not there (no such job, or the sandbox was replaced).
set -u
dir=$1 seg=$2 max=$5 keep=${6-}
[ -d "$dir" ] || exit 66
kept_out=0 kept_err=0 fly_out= fly_err=
[ -f "$dir/kept" ] && read -r kept_out kept_err fly_out fly_err < "$dir/kept"
case $kept_out$kept_err in ''|*[!0-9]*) kept_out=0 kept_err=0 fly_out= fly_err= ;; esac
case $fly_out$fly_err in ''|*[!0-9]*) fly_out=$kept_out fly_err=$kept_err ;; esac
record=
if { [ "$keep" = keep ] || [ "$keep" = commit ]; } && [ "$3" -ge "$kept_out" ] && [ "$4" -ge "$kept_err" ]; then
  record=$keep kept_out=$3 kept_err=$4
fi
if [ -e "$dir/status" ]; then
  read -r rc timed < "$dir/status"
  stopped=0
  [ -e "$dir/stopped" ] && stopped=1
  echo "airflow-sandbox-job ended $rc $timed $stopped"
else
  echo "airflow-sandbox-job running"
fi
echo "kept $kept_out $kept_err $fly_out $fly_err"

stream() {
  name=$1 since=$2 tail= got=0
  case $since in -*) tail=${since#-} since=0 ;; esac
  first= last=
  for n in $(ls -- "$dir" | sed -n "s/^$name\.0*\([0-9][0-9]*\)\$/\1/p" | sort -n); do
    [ -n "$first" ] || first=$n
    last=$n
  done
  lines=$(cat -- "$dir/$name.lines" 2>/dev/null || echo 0)
  if [ -z "$last" ]; then
    echo "$name $since 0 $lines"
    echo
    eval "end_$name=\$since"
    return
  fi
  size=$(wc -c < "$dir/$name.$(printf %09d "$last")" 2>/dev/null || echo 0)
  total=$((last * seg + size))
  from=$since
  [ -n "$tail" ] && from=$((total - tail))
  [ "$from" -lt $((first * seg)) ] && from=$((first * seg))
  [ "$from" -gt "$total" ] && from=$total
  part="$dir/poll.$$.$name"
  : > "$part"
  i=$((from / seg)) skip=$((from % seg)) left=$max
  while [ "$i" -le "$last" ] && [ "$left" -gt 0 ]; do
    tail -c "+$((skip + 1))" -- "$dir/$name.$(printf %09d "$i")" 2>/dev/null | head -c "$left" >> "$part" || break
    got=$(wc -c < "$part")
    left=$((max - got))
    [ $((from + got)) -lt $(((i + 1) * seg)) ] && break
    i=$((i + 1)) skip=0
  done
  eval "end_$name=\$((from + got))"
  echo "$name $from $total $lines"
  base64 < "$part" | tr -d '\n'
  echo
  rm -f -- "$part"
}

end_out=0 end_err=0
stream out "$3"
stream err "$4"
# The record is written last, once what is in flight is known, and replaced whole (never half written).
if [ -n "$record" ]; then
  [ "$record" = commit ] && end_out=$3 end_err=$4
  echo "$3 $4 $end_out $end_err" > "$dir/kept.$$" && mv -f -- "$dir/kept.$$" "$dir/kept"
fi
