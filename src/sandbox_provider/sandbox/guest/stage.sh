# Extract the tar archive on standard input (made by the worker: regular files only, names relative
# to the working directory or absolute), then, with $1, run that shell command with standard input
# from /dev/null, in the same process (so the files and the command cost one sandbox launch).
# GNU tar replaces a file or symlink at a member's path rather than writing through it.
#   [COMMAND]
# Exit status 125, after the line "sandbox-stage-failed" on stderr, when the archive could not be
# extracted (the command did not run); otherwise the command's own.
tar -x -P -f - --no-same-owner --no-same-permissions || { echo sandbox-stage-failed >&2; exit 125; }
[ $# -eq 0 ] && exit 0
exec sh -c "$1" < /dev/null
