# The keeper of a Kubernetes sandbox: the container's first process (PID 1), as the pod's user.
#
# It waits, doing nothing, until the pod ends: the lifetime is the cluster's to enforce (the pod's
# activeDeadlineSeconds), which ends it even when no worker is left to ask. On SIGTERM (the pod
# being deleted) it ends at once, so a deletion takes no grace period. Being PID 1 of the
# container's PID namespace, it is out of reach of kill(-1) and of every signal sent from inside
# that it does not trap, so the runner's closing kill(-1) never ends the sandbox.
#
# A shell waiting for its own child reaps every child it has, so the processes orphaned inside
# (adopted by PID 1) do not pile up as zombies.
trap 'exit 0' TERM INT
while :; do
  sleep 86400 &
  wait "$!"
done
