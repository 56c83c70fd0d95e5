# Wraps every command. ``timeout`` SIGKILLs the command's process group at the deadline; then, and
# also when the command ends by itself, every orphan the container's init adopted is killed, round
# after round, so background jobs, nohup'd and setsid'd processes do not outlive the command (as
# they cannot on the local backend, whose PID namespace ends with the command). The container's
# main ``sleep`` is the oldest child of init, which no process can fake; it is spared. Zombies are
# left to init to reap. Positional arguments: the deadline in seconds, then the command.
timeout -s KILL "$1" sh -c "$2"
rc=$?
sweep() {
  main=""; oldest=""; found=""
  for d in /proc/[0-9]*; do
    read -r s < "$d/stat" 2>/dev/null || continue
    s=${s##*) }; set -- $s
    [ "$2" = 1 ] || continue
    if [ -z "$oldest" ] || [ "${20}" -lt "$oldest" ]; then oldest=${20}; main=${d#/proc/}; fi
  done
  for d in /proc/[0-9]*; do
    read -r s < "$d/stat" 2>/dev/null || continue
    s=${s##*) }; set -- $s
    [ "$2" = 1 ] && [ "$1" != Z ] && [ "${d#/proc/}" != "$main" ] || continue
    kill -9 "${d#/proc/}" 2>/dev/null && found=1
  done
  [ -n "$found" ]
}
i=0
while sweep && [ "$i" -lt 50 ]; do i=$((i + 1)); sleep 0.05; done
exit "$rc"
