# Extract what export_tree.sh packs (its text is $2) into the directory $1, in this sandbox: member
# "<index>/<name>" lands at $1/<index>/<name>, where the caller has put request <index>'s directory.
# The caller checks everything written there afterwards; this program only moves the bytes.
#   DIR TREE_PROGRAM KIND PATH [KIND PATH ...]
# Exit status: export_tree.sh's when it failed (its "sandbox-export-failed:<index>" line is on
# stderr), else 70 when the extraction failed, else 0.
dir=$1 tree=$2
shift 2
# Each side's exit status comes back on descriptor 3; an empty archive ends the stream, so tar always has one.
statuses=$( { { sh -c "$tree" export_tree.sh "$@"; echo "tree $?" >&3; tar -c -f - -T /dev/null; } |
  { tar -x -i -f - -C "$dir" --no-same-owner --no-same-permissions; echo "unpack $?" >&3; }; } 3>&1 >&2)
case $statuses in *"tree 0"*) ;; *) s=${statuses#*tree }; exit "${s%%[!0-9]*}" ;; esac
case $statuses in *"unpack 0"*) exit 0 ;; esac
exit 70
