# The keeper of a Docker sandbox: the container's first process (PID 1), run as root.
#
#   $1  uid:gid to hand the working directory to ("" leaves it as it is)
#   $2  the lifetime, in whole seconds
#   $3  the provider's state directory (default /.airflow-sandbox): root's, passable but not
#       readable by others
#
# It lives for the lifetime and then ends, which ends the container (the Engine then removes it).
# Being PID 1, it is out of reach of kill(-1) and of every signal sent from inside that it does not
# trap; the commands run as another user without capabilities, so they cannot signal, stop or trace
# it at all. The lifetime is counted on /proc/uptime, read by the shell itself.
#
# A shell waiting for its own child reaps every child it has, so the processes orphaned inside
# (adopted by PID 1) do not pile up as zombies.
#
# On SIGUSR1, which the hook sends through the Engine, it kills every other process in the container
# with one kill(-1), then appends one byte to "$3/swept": the size of that file counts the sweeps
# done, so the hook can tell that its sweep ran. One kill(-1) is enough: the kernel signals every
# process in one pass that no fork can slip through, and a process with SIGKILL pending forks no more.
# The trap runs only shell builtins, so a sandbox whose process table is full is swept all the same.
state=${3:-/.airflow-sandbox}
umask 077
mkdir -p "$state" && chmod 711 "$state" || exit 1
# The runner's shell: a copy the command user may run but not read. The kernel marks a process
# that runs a file it cannot read as not dumpable, so the command cannot trace the runner or
# change its memory, and the runner's closing kill(-1) cannot be skipped (only killed or stopped,
# which the hook sees).
cp /bin/sh "$state/sh" && chmod 711 "$state/sh" || exit 1
# Some storage drivers (btrfs) make the container's root directory 0700, which no other user passes.
[ -z "$1" ] || { chown "$1" . && chmod go+rx /; } || echo "sandbox keeper: could not set up the workdir for $1" >&2
read -r up _ < /proc/uptime
end=$((${up%.*} + $2))
trap 'kill -KILL -1 2>/dev/null; echo >> "$state/swept"' USR1
: >> "$state/swept"
while read -r up _ < /proc/uptime && [ "${up%.*}" -lt "$end" ]; do
  sleep "$((end - ${up%.*}))" &
  wait "$!"
done
