# Write to standard output one tar archive per request, concatenated, every member's name starting
# with the request's index ("0/a.csv"). Symlinks are followed (tar -h) and hard links stored whole,
# so the archive holds the files as the sandbox sees them.
#   KIND PATH [KIND PATH ...]    KIND: file (one regular file), tree (a directory), glob (PATH is
#                                BASE<newline>PATTERN, PATTERN expanded by sh in BASE; no match: nothing)
# On failure, the line "sandbox-export-failed:<index>" on stderr, and exit status 66 (missing),
# 67 (a directory, for file), 68 (not a regular file, or not a directory for tree) or 70 (tar failed).
i=0
fail() { echo "sandbox-export-failed:$i" >&2; exit "$1"; }
# The names in BASE that PATTERN matches, NUL-terminated (the expansion happens here, and only here).
matches() (
  cd -- "$base" || exit 0
  IFS=''
  # shellcheck disable=SC2086
  for m in $pattern; do
    if [ -e "$m" ] || [ -L "$m" ]; then printf '%s\0' "$m"; fi
  done
)
pack() { tar -c -h --hard-dereference -f - --transform "s,^,$i/," "$@" || fail 70; }
while [ $# -ge 2 ]; do
  kind=$1 p=$2
  shift 2
  case $kind in
    file)
      [ -e "$p" ] || fail 66
      [ -d "$p" ] && fail 67
      [ -f "$p" ] || fail 68
      pack -C "$(dirname -- "$p")" -- "$(basename -- "$p")" ;;
    tree)
      [ -e "$p" ] || fail 66
      [ -d "$p" ] || fail 68
      pack -C "$p" -- . ;;
    glob)
      base=${p%%
*} pattern=${p#*
}
      if [ -d "$base" ] && [ -n "$(matches | head -c 1)" ]; then
        matches | pack -C "$base" --null --verbatim-files-from -T - || fail 70
      fi ;;
    *) echo "export_tree.sh: unknown kind $kind" >&2; exit 2 ;;
  esac
  i=$((i + 1))
done
