#!/bin/bash
# The harness's steps inside a guest, as a new user would run them. Started by
# jaild-hosts.service from the run's 9p share (/mnt/hosts); each step's output goes
# to /mnt/hosts/<step>.log and one line "step<TAB>pass|fail|timeout<TAB>seconds" to
# /mnt/hosts/results.tsv; the running step's name is in /mnt/hosts/current. A step with a
# budget (BUDGETS) is killed, its whole process group, when it runs past it: "timeout", and
# the steps after it still run. The guest powers off when this script ends.
set -u
SHARE=/mnt/hosts
source "$SHARE/config.env"   # COMMIT, SUITE, STEPS, OFFLINE, BUDGETS, TEST_TARGET
WORK=/root/work              # a 0700 directory, like a user's home
CLONE=$WORK/jaild
export SHARE WORK CLONE COMMIT SUITE TEST_TARGET
export HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# under TCG everything is ~10x slower: the suite's liveness guards stretch (tests/conftest.py)
[ "$(cat "$SHARE/accel" 2>/dev/null)" = tcg ] && export JAILD_TEST_TIME_SCALE=10

source "$SHARE/lib.sh"       # wanted, budget, step

# a provisioned image (hosts/image.py) and no network device: pip takes every package from
# the image's wheelhouse, and the jail environments it carries are up to date. Nor does pip
# byte-compile what it installs (half its time, natively; Python compiles what it imports):
# under emulation the venv and `make install` took 390 s and ~170 s with it.
if [ "${OFFLINE:-0}" = 1 ]; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=/var/cache/jaild-wheels PIP_COMPILE=0
fi

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

make_demo() {  # the README's first command, on a clone nothing was set up in
    cd "$CLONE" || return
    local t0=$SECONDS
    make demo || return
    echo "=== make demo (its set-up too): $((SECONDS - t0)) s"
}

make_install() { cd "$CLONE" && make install; }

test_suite() {
    cd "$CLONE"
    if [ "$SUITE" = "-" ]; then echo "suite: none"; return 0; fi
    # -v: the log names each test as it starts, so a step killed at its budget shows which ran
    # the container tests load the host's build of the image, when the run carries one
    [ -f "$SHARE/jaild-image.oci.tar" ] && export JAILD_TEST_IMAGE_ARCHIVE=$SHARE/jaild-image.oci.tar
    local args=(-v -p no:cacheprovider "--junitxml=$SHARE/junit.xml")
    if [ "${TEST_TARGET:-test}" = test ]; then
        make test PYTEST_ARGS="$SUITE ${args[*]}"
    else  # the targets that prepare, then these tests alone
        # shellcheck disable=SC2086 # TEST_TARGET and SUITE are word lists
        make $TEST_TARGET && .venv/bin/python -m pytest $SUITE "${args[@]}"
    fi
}

socket_on() {
    # the checks' own policy (hosts/checks/test_jobs.py: spawned jails), in place before the
    # service first starts, so that the checks need no restart of their own to load it
    install -m 0644 "$SHARE/checks/hosts-spawn.toml" /etc/jaild/policies/
    systemctl enable --now jaild.socket
    systemctl is-active jaild.socket
}

installed_job() {
    cd /
    # socket activation: the service is not running until the first connection starts it
    # (the service checks rely on this step for it)
    [ "$(systemctl is-active jaild.service)" = inactive ] || { echo "jaild.service runs already"; return 1; }
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
    make venv-test || return  # make demo installed the package alone
    .venv/bin/python -m pytest -p no:cacheprovider -v "$SHARE/checks" \
        --junitxml="$SHARE/junit-service.xml"
}

export -f clone make_demo test_suite make_install socket_on installed_job doctor service_checks

info > "$SHARE/info.log" 2>&1
step clone clone || { printf 'finished\tfail\t0\n' >> "$SHARE/results.tsv"; exit 1; }
step demo make_demo
step test test_suite
step install make_install
step socket socket_on
step installed-job installed_job
step doctor doctor
step service service_checks
: > "$SHARE/current"
journalctl -b --no-pager -u jaild.service -u jaild.socket > "$SHARE/journal-jaild.log" 2>&1
journalctl -b --no-pager -k > "$SHARE/kernel.log" 2>&1
systemd-analyze security --no-pager jaild.service > "$SHARE/security.log" 2>&1
printf 'finished\tpass\t%s\n' "$SECONDS" >> "$SHARE/results.tsv"
sync
