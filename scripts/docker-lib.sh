# shellcheck shell=bash
# Sourced by the docker scripts: the one child a script waits on, and the traps that end it.
# The sourcing script defines cleanup() (run on every exit; stop_child stops what still runs).

child=

# The script's own stdout and stderr, on fds 7 and 8: a trap can run while a command's output
# goes to a file (a signal during `run cmd >log`), and what cleanup says must reach the user.
exec 7>&1 8>&2
restore_output() { exec 1>&7 2>&8; }

# Runs "$@" in its own process group and waits for it, so a signal reaches the trap at once
# (bash runs traps only between foreground commands) and the trap can stop all of it.
run() {
    setsid "$@" <&0 &  # the caller's stdin: an asynchronous command's is /dev/null otherwise
    child=$!
    local rc=0
    wait "$child" || rc=$?
    child=
    return "$rc"
}

# The child run() waits on, if one runs: TERM to its whole process group, then waited for.
stop_child() {
    if [[ -n $child ]]; then
        kill -TERM -- "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
}

trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
