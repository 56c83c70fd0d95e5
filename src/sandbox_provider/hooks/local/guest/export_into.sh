# Extract what export_tree.sh packs (its text is $2) into the directory $1, in this sandbox: member
# "<index>/<name>" lands at $1/<index>/<name>, where the caller has put request <index>'s directory.
# The caller checks everything written there afterwards; this program only moves the bytes, and
# stops tar once the members' sizes pass MAX_BYTES or their number MAX_ENTRIES (tar lists each
# member before it writes it; links and sparse files come out whole, so they count whole).
#   DIR TREE_PROGRAM MAX_BYTES MAX_ENTRIES KIND PATH [KIND PATH ...]
# Exit status: 71 past MAX_BYTES, 72 past MAX_ENTRIES; else export_tree.sh's when it failed (its
# "sandbox-export-failed:<index>" line is on stderr), else 70 when the extraction failed, else 0.
dir=$1 tree=$2 bytes=$3 entries=$4
shift 4
# mawk reads a pipe a buffer at a time unless told otherwise; tar's listing must count as it comes.
case $(awk -W version 2>&1) in *mawk*) awk="awk -W interactive" ;; *) awk=awk ;; esac
# tar's listing a line at a time where stdbuf works, so tar is stopped within a member or so.
if stdbuf -oL true 2> /dev/null; then lines="stdbuf -oL"; else lines=""; fi
# Each stage reports on descriptor 3; an empty archive ends the stream, so tar always has one.
# tar -vv lists "mode owner size date time name": the third field is the size.
statuses=$( { { sh -c "$tree" export_tree.sh "$@"; echo "tree $?" >&3; tar -c -f - -T /dev/null; } |
  { { $lines tar -x -vv -i -f - -C "$dir" --no-same-owner --no-same-permissions; echo "unpack $?" >&3; } |
    { $awk -v most="$entries" -v room="$bytes" \
        '{ total += $3 } NR > most { exit 72 } total > room { exit 71 }'; echo "awk $?" >&3; }; }
  } 3>&1 >&2)
case $statuses in *"awk 71"*) exit 71 ;; *"awk 72"*) exit 72 ;; esac
case $statuses in *"tree 0"*) ;; *) s=${statuses#*tree }; exit "${s%%[!0-9]*}" ;; esac
case $statuses in *"unpack 0"*) exit 0 ;; esac
exit 70
