# List the directory $1 as NUL-terminated "<type> <name>" records (type d for a directory).
# Exit status 66 when $1 is not a directory.
[ -d "$1" ] || exit 66
case $1 in -*) set -- "./$1" ;; esac
exec find "$1" -mindepth 1 -maxdepth 1 -printf '%y %f\0'
