# Check that $1 is a readable regular file of at most $2 bytes ("-" for no limit), print its size
# to stderr as "sandbox-size:<bytes>", then act on it as $3 says:
#   check          nothing more
#   head           copy at most $2 + 1 bytes to stdout (the caller sees an overflow)
#   cat            copy the whole file to stdout
#   base64         at most $2 + 1 bytes, base64-encoded
#   chunk OFF LEN  LEN bytes from byte OFF, base64-encoded
# Exit statuses: 66 missing or unreadable, 67 a directory, 68 not a regular file, 69 over the limit.
p=$1 max=$2 mode=$3
[ -e "$p" ] && [ -r "$p" ] || exit 66
[ -d "$p" ] && exit 67
[ -f "$p" ] || exit 68
size=$(stat -Lc %s -- "$p") || exit 66
echo "sandbox-size:$size" >&2
if [ "$max" != - ] && [ "$size" -gt "$max" ]; then exit 69; fi
case $mode in
  check) exit 0 ;;
  head) exec head -c "$((max + 1))" -- "$p" ;;
  cat) exec cat -- "$p" ;;
  base64) head -c "$((max + 1))" -- "$p" | base64 ;;
  chunk) tail -c "+$(($4 + 1))" -- "$p" | head -c "$5" | base64 ;;
  *) echo "file.sh: unknown mode $mode" >&2; exit 2 ;;
esac
