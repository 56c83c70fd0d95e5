# Write a file atomically: the bytes go to a temporary sibling first, renamed over the path at the
# end, so a reader never sees half a file and a symlink at the path is replaced, not followed.
# The new, empty sibling is opened without truncating it (1<>): ext4 flushes a file truncated to
# zero and rewritten at close, which would cost a large copy its page-cache speed.
#   stdin PATH [SIZE]   copy standard input to PATH; with SIZE, exactly SIZE bytes of it (for a
#                       caller that cannot close the stream after them)
#   copy PATH SIZE      copy standard input, a regular file, to PATH (cat copies in the kernel);
#                       exit status 3 when it did not hold exactly SIZE bytes (nothing is written)
#   start PATH          print the name of a new temporary sibling of PATH (parents made)
#   append TMP B64      append the base64 text B64, decoded, to TMP
#   concat TMP PART     append the file PART to TMP, then remove PART (for pieces a file API wrote)
#   commit TMP PATH     rename TMP over PATH
#   abort TMP           remove TMP
mode=$1
case $mode in
  stdin)
    d=$(dirname -- "$2") && mkdir -p -- "$d" && t=$(mktemp "$d/.sandbox-write.XXXXXX") || exit 1
    if { if [ -n "$3" ]; then head -c "$3"; else cat; fi; } 1<> "$t" && mv -fT -- "$t" "$2"; then exit 0; fi
    rm -f -- "$t"; exit 1 ;;
  copy)
    d=$(dirname -- "$2") && mkdir -p -- "$d" && t=$(mktemp "$d/.sandbox-write.XXXXXX") || exit 1
    if cat 1<> "$t"; then
      n=$(wc -c < "$t")
      if [ "$n" -ne "$3" ]; then
        rm -f -- "$t"; echo "write.sh: the source held $n bytes, not $3" >&2; exit 3
      fi
      mv -fT -- "$t" "$2" && exit 0
    fi
    rm -f -- "$t"; exit 1 ;;
  start)
    d=$(dirname -- "$2") && mkdir -p -- "$d" && mktemp "$d/.sandbox-write.XXXXXX" ;;
  append) printf %s "$3" | base64 -d >> "$2" ;;
  concat) cat -- "$3" >> "$2" && rm -f -- "$3" ;;
  commit) mv -fT -- "$2" "$3" ;;
  abort) rm -f -- "$2" ;;
  *) echo "write.sh: unknown mode $mode" >&2; exit 2 ;;
esac
