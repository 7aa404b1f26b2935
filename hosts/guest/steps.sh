#!/bin/bash
# The harness's steps inside a guest, as a new user would run them. Started by
# jaild-hosts.service from the run's 9p share (/mnt/hosts); each step's output goes
# to /mnt/hosts/<step>.log and one line "step<TAB>pass|fail<TAB>seconds" to
# /mnt/hosts/results.tsv. The guest powers off when this script ends.
set -u
SHARE=/mnt/hosts
source "$SHARE/config.env"   # COMMIT, SUITE, STEPS
WORK=/root/work              # a 0700 directory, like a user's home
CLONE=$WORK/jaild
export HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# under TCG everything is ~10x slower: the suite's liveness guards stretch (tests/conftest.py)
[ "$(cat "$SHARE/accel" 2>/dev/null)" = tcg ] && export JAILD_TEST_TIME_SCALE=10

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME COMMAND...: run, time and record one step
    local name=$1; shift
    wanted "$name" || return 0
    local t0=$SECONDS status
    echo "=== $name: $*" > "$SHARE/$name.log"
    if ( "$@" ) >> "$SHARE/$name.log" 2>&1; then status=pass; else status=fail; fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >> "$SHARE/results.tsv"
    echo "[guest] $name: $status in $((SECONDS - t0)) s" > /dev/console
    [ "$status" = pass ]
}

info() {
    uname -a; systemctl --version | head -1; cat /etc/debian_version
    stat -f -c 'cgroup fs: %T' /sys/fs/cgroup
    echo "controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
    for f in memory.peak pids.peak memory.swap.max memory.events cpu.stat; do
        if [ -e /sys/fs/cgroup/system.slice/$f ] || [ -e /sys/fs/cgroup/init.scope/$f ]; then
            echo "$f: present"; else echo "$f: ABSENT"; fi
    done
    nproc; free -m
}

clone() {
    install -d -m 0700 "$WORK"
    git clone -q "$SHARE/jaild.bundle" "$CLONE"
    git -C "$CLONE" checkout -q "$COMMIT"
    git -C "$CLONE" log -1 --oneline
}

in_clone() { cd "$CLONE" && "$@"; }

test_suite() {
    cd "$CLONE"
    if [ "$SUITE" = "-" ]; then echo "suite: none"; return 0; fi
    if [ -n "$SUITE" ]; then
        make test PYTEST_ARGS="$SUITE -p no:cacheprovider --junitxml=$SHARE/junit.xml"
    else
        make test PYTEST_ARGS="-p no:cacheprovider --junitxml=$SHARE/junit.xml"
    fi
}

socket_on() {
    systemctl enable --now jaild.socket
    systemctl is-active jaild.socket
}

installed_job() {
    cd /
    # the installed client, through the installed socket (activates the service)
    /usr/local/bin/jaild run --socket /run/jaild/jaild.sock --json \
        -c 'import os, sys; print("uid", os.getuid()); sys.version_info[:2]' | tee /tmp/job.json
    grep -q '"status": "ok"' /tmp/job.json
    systemctl is-active jaild.service
    systemctl status --no-pager jaild.service | head -30
}

doctor() {
    cd /
    /usr/local/bin/jaild doctor
}

service_checks() {
    cd "$CLONE"
    .venv/bin/python -m pytest -p no:cacheprovider -v "$SHARE/checks" \
        --junitxml="$SHARE/junit-service.xml"
}

info > "$SHARE/info.log" 2>&1
step clone clone || { printf 'finished\tfail\t0\n' >> "$SHARE/results.tsv"; exit 1; }
step demo in_clone make demo
step test test_suite
step install in_clone make install
step socket socket_on
step installed-job installed_job
step doctor doctor
step service service_checks
journalctl -b --no-pager -u jaild.service -u jaild.socket > "$SHARE/journal-jaild.log" 2>&1
journalctl -b --no-pager -k > "$SHARE/kernel.log" 2>&1
systemd-analyze security --no-pager jaild.service > "$SHARE/security.log" 2>&1
printf 'finished\tpass\t%s\n' "$SECONDS" >> "$SHARE/results.tsv"
sync
