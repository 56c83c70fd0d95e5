# Starts the first program in a new Docker sandbox once its keeper is ready: waits up to $1 ticks
# of 10 ms for the keeper's witness file $2, then writes "sandbox-started" on standard output (the
# hook takes that line off) and runs the rest of the arguments in place of itself.
# If the keeper never gets there, prints "sandbox-keeper-missing" on stderr and exits 125.
i=0
until [ -e "$2" ]; do
  [ "$i" -lt "$1" ] || { echo "sandbox-keeper-missing" >&2; exit 125; }
  i=$((i + 1))
  sleep 0.01
done
shift 2
echo sandbox-started
exec "$@"
