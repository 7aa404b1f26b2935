#!/bin/sh
# The steps of jaild's container image, shared by `make image` (image/build.py runs them in
# mmdebstrap's chroots) and image/Containerfile (RUN steps), so both give the same layout:
#
#   install.sh apt runtime|build     apt-get install image/packages-KIND.txt (Containerfile only:
#                                    build.py gives the same lists to mmdebstrap --include)
#   install.sh wheels SRC OUT        the wheelhouse: every wheel the image installs (jaild's
#                                    dependencies with its extras, the jail environments', the
#                                    build backend), python-prctl compiled; needs the network
#   install.sh jaild SRC WHEELS      jaild and its jail environments from the wheelhouse alone
#                                    (pip --no-index): the layout below
#
# SRC is a copy of the checkout (at least pyproject.toml, README.md, jaild/, policies/, envs/,
# image/); it is read, never written. The layout:
#
#   /opt/jaild/venv                  jaild (a wheel built from SRC) with EXTRAS, not editable
#   /usr/local/bin/jaild             -> /opt/jaild/venv/bin/jaild
#   /etc/jaild/jaild.toml            image/jaild.toml
#   /etc/jaild/policies/*.toml       the shipped policies
#   /var/lib/jaild/envs/NAME         each envs/NAME.txt, built by `jaild env build`
#   /run/jaild                       the socket's directory (a hostPath on Kubernetes)
#   /opt/jaild/image-manifest.txt    what is installed: Debian packages, pip freezes
set -eu

EXTRAS=mcp,otel
OPT=/opt/jaild
ETC=/etc/jaild
STATE=/var/lib/jaild

here=$(cd "$(dirname "$0")" && pwd)

# A private copy of what building the jaild wheel reads: setuptools writes build/ and
# *.egg-info beside the sources, and SRC may be a read-only bind mount.
copy_source() {
    rm -rf "$2" && mkdir -p "$2"
    cp -R "$1/pyproject.toml" "$1/README.md" "$1/jaild" "$2/"
    find "$2" -name __pycache__ -prune -exec rm -rf {} +
}

case "${1:-}" in
apt)
    list="$here/packages-${2:?runtime or build}.txt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    # shellcheck disable=SC2046
    apt-get install -y --no-install-recommends $(grep -v '^#' "$list")
    apt-get clean
    rm -rf /var/lib/apt/lists/*
    ;;

wheels)
    src=${2:?SRC} out=${3:?OUT}
    mkdir -p "$out"
    # No debug information in what is compiled here (python-prctl): it names the build's
    # random directory, so the same source would give other bytes each build.
    export CFLAGS="${CFLAGS:-} -g0"
    python3 -m venv /tmp/jaild-wheels-venv
    pip="/tmp/jaild-wheels-venv/bin/pip"
    copy_source "$src" /tmp/jaild-wheels-src
    # jaild's dependencies (jaild's own wheel is made from SRC by `install.sh jaild`)
    "$pip" wheel --use-pep517 --progress-bar off -w "$out" "/tmp/jaild-wheels-src[$EXTRAS]"
    rm -f "$out"/jaild-*.whl
    # each jail environment's, resolved on its own as `jaild env build` resolves it
    for req in "$src"/envs/*.txt; do
        "$pip" wheel --use-pep517 --progress-bar off -w "$out" -r "$req"
    done
    # the build backend pyproject.toml names, so the jaild wheel builds offline
    backend=$(python3 -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
        "$src/pyproject.toml")
    # shellcheck disable=SC2086
    "$pip" wheel --use-pep517 --progress-bar off -w "$out" $backend
    rm -rf /tmp/jaild-wheels-venv /tmp/jaild-wheels-src
    ls "$out"
    ;;

jaild)
    src=${2:?SRC} wheels=${3:?WHEELS}
    # Offline from here on: every wheel comes from the wheelhouse.
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheels" PIP_DISABLE_PIP_VERSION_CHECK=1
    export PIP_NO_CACHE_DIR=1 PIP_PROGRESS_BAR=off PIP_ROOT_USER_ACTION=ignore
    export PYTHONHASHSEED=0
    install -d -m 0755 "$OPT" "$ETC" "$ETC/policies" "$STATE" /run/jaild
    python3 -m venv "$OPT/venv"
    copy_source "$src" /tmp/jaild-wheel-src
    "$OPT/venv/bin/pip" wheel --no-deps -w /tmp/jaild-wheel /tmp/jaild-wheel-src
    wheel=$(ls /tmp/jaild-wheel/jaild-*.whl)
    "$OPT/venv/bin/pip" install "$wheel[$EXTRAS]"
    rm -rf /tmp/jaild-wheel-src /tmp/jaild-wheel
    ln -sfn "$OPT/venv/bin/jaild" /usr/local/bin/jaild
    install -m 0644 "$src/image/jaild.toml" "$ETC/jaild.toml"
    install -m 0644 "$src"/policies/*.toml "$ETC/policies/"
    for req in "$src"/envs/*.txt; do
        name=$(basename "$req" .txt)
        "$OPT/venv/bin/jaild" env build "$name" -r "$req" --state-dir "$STATE" --quiet
    done
    {
        echo "# jaild's image: what is installed (image/install.sh)"
        echo "jaild $("$OPT/venv/bin/jaild" --version | cut -d' ' -f2) extras $EXTRAS"
        echo "revision ${JAILD_REVISION:-unknown}"
        echo
        echo "## Debian packages (dpkg-query -W)"
        dpkg-query -W -f '${Package} ${Version}\n'
        echo
        echo "## $OPT/venv (pip freeze)"
        "$OPT/venv/bin/pip" freeze --all
        for env in "$STATE"/envs/*/; do
            echo
            echo "## ${env%/} (pip freeze)"
            "${env}bin/pip" freeze --all
        done
    } > "$OPT/image-manifest.txt"
    chmod 0644 "$OPT/image-manifest.txt"
    rm -rf /root/.cache
    ;;

*)
    echo "usage: install.sh apt runtime|build | wheels SRC OUT | jaild SRC WHEELS" >&2
    exit 2
    ;;
esac
