# Runs one file operation in a Kubernetes sandbox, through exec, as the pod's user: in the working
# directory $1, the guest program text $2 under sh, named $3, with the arguments after them (its
# standard streams are the exec's own).
cd -- "$1" || { echo "airflow-sandbox: cannot enter the working directory $1" >&2; exit 125; }
p=$2
shift 2
exec sh -c "$p" "$@"
