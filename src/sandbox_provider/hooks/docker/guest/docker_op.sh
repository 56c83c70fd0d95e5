# Runs one file operation in a Docker sandbox, as the command user: the guest program text $1 under
# sh, named $2, with the arguments after them (its standard streams are the exec's own).
#
# With AIRFLOW_SANDBOX_STATUS set (the hook's token for this exec), it then writes the status
# trailer "\036sandbox-status:<token>:<status>" as its last line on stderr, so that the hook needs no
# request to learn the status. No process of the command user runs beside a file operation (the
# hook ends them all after each command), so nothing else can write that line.
t=${AIRFLOW_SANDBOX_STATUS-}
unset AIRFLOW_SANDBOX_STATUS
p=$1
shift
sh -c "$p" "$@"
rc=$?
[ -z "$t" ] || printf '\036sandbox-status:%s:%s\n' "$t" "$rc" >&2
exit "$rc"
