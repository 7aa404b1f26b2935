# The harness's step runner, sourced by steps.sh in the guest (and by the unit tests on the
# host). Needs SHARE (where logs, results.tsv and current go) and STEPS; BUDGETS is optional
# ("name=seconds ..."); CONSOLE is where a line per step goes besides (the guest's console).

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

budget() {  # the step's budget in seconds, or nothing
    local pair
    for pair in ${BUDGETS:-}; do [ "${pair%%=*}" = "$1" ] && echo "${pair#*=}"; done
}

step() {  # step NAME FUNCTION: run, time and record one step
    local name=$1; shift
    wanted "$name" || return 0
    local t0=$SECONDS status limit
    limit=$(budget "$name")
    echo "$name" > "$SHARE/current"
    echo "=== $name: $*${limit:+ (budget $limit s)}" > "$SHARE/$name.log"
    if [ -n "$limit" ]; then
        # timeout puts the step in a process group of its own and signals all of it
        timeout --kill-after=30 "$limit" bash -c '"$@"' step "$@" >> "$SHARE/$name.log" 2>&1
    else
        ( "$@" ) >> "$SHARE/$name.log" 2>&1
    fi
    case $? in
        0) status=pass;;
        124|137) if [ -n "$limit" ] && [ $((SECONDS - t0)) -ge "$limit" ]; then
                     status=timeout
                     echo "=== $name: TIMEOUT: still running after its budget of $limit s" \
                         >> "$SHARE/$name.log"
                 else status=fail; fi;;
        *) status=fail;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >> "$SHARE/results.tsv"
    echo "[guest] $name: $status in $((SECONDS - t0)) s" > "${CONSOLE:-/dev/console}"
    [ "$status" = pass ]
}
