#!/usr/bin/env bash
# Base images for the container stack, for machines that cannot reach an image registry.
#
# For each base image the stack needs, in order: use the official image when it is
# already present or can be pulled; else use the local stand-in when it was built
# before; else build the stand-in from Debian's packages (debootstrap --variant=minbase
# from the Debian mirror apt already uses, then `docker import`):
#
#   official            stand-in built here             what
#   redis:7             turnbus-local/redis:7           redis-server 7 (Debian's), /data, runs as redis
#   python:3.11-slim    turnbus-local/python:3.11       python3.11 with venv and pip (Dockerfile BASE_IMAGE)
#
# Progress goes to stderr; stdout gets the two lines to use the result, e.g.
#   eval "$(docker/build-base-images.sh)"   # sets TURNBUS_REDIS_IMAGE and TURNBUS_PYTHON_IMAGE
#   docker compose up --build
#
# Running it again changes nothing. Building needs root (debootstrap; sudo when not root).
# Environment: DEBIAN_MIRROR (default: the mirror in apt's sources; none is an error),
# DEBIAN_SUITE (default bookworm),
# TURNBUS_BASE_CACHE (downloaded .debs; default ~/.cache/turnbus-base-images).
set -euo pipefail
shopt -s inherit_errexit

log() { echo "build-base-images: $*" >&2; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# The tags promise Redis 7 and Python 3.11: bookworm's versions.
suite="${DEBIAN_SUITE:-bookworm}"

# The Debian mirror apt on this machine uses, read from its own configuration: one-line
# sources (sources.list, sources.list.d/*.list: "deb [opts] URI SUITE COMPONENTS") and
# deb822 ones (sources.list.d/*.sources: "URIs:" beside "Suites:"). The first source of
# the suite wins, else the first one that is not a security archive. Nothing is guessed: with
# none and DEBIAN_MIRROR unset, the build stops and says so.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local files=() f uri=""
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] && files+=("$f")
    done
    if [ "${#files[@]}" -gt 0 ]; then
        uri="$(awk -v suite="$suite" '
            function pick(uri, suites) {
                if (uri == "" || suites == "") return
                if (exact == "" && index(" " suites " ", " " suite " ")) exact = uri
                if (other == "" && suites !~ /-security/) other = uri
            }
            function stanza() {
                if (enabled != "no") pick(uris, suites)
                uris = ""; suites = ""; enabled = ""
            }
            FNR == 1 { stanza() }
            /^[[:space:]]*#/ { next }
            FILENAME ~ /[.]sources$/ {
                if ($0 ~ /^[[:space:]]*$/) stanza()
                else if (tolower($1) == "uris:") uris = $2
                else if (tolower($1) == "suites:") { $1 = ""; suites = $0 }
                else if (tolower($1) == "enabled:") enabled = tolower($2)
                next
            }
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
                pick($i, $(i + 1))
            }
            END { stanza(); print (exact != "" ? exact : other) }
        ' "${files[@]}")"
    fi
    if [ -z "$uri" ]; then
        log "no Debian mirror in apt's sources (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list, *.sources); set DEBIAN_MIRROR to one"
        return 1
    fi
    echo "$uri"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# Everything this machine's TLS clients trust beyond Debian's own list (a company proxy's
# CA, say) goes into the images too, so pip inside a build reaches the package index.
copy_local_cas() {
    local rootfs="$1" found=0 cert
    [ -d "$rootfs/usr/local/share/ca-certificates" ] || return 0 # no ca-certificates package
    for cert in /usr/local/share/ca-certificates/*.crt; do
        [ -e "$cert" ] || continue
        $SUDO cp "$cert" "$rootfs/usr/local/share/ca-certificates/"
        found=1
    done
    if [ "$found" -eq 1 ]; then
        $SUDO chroot "$rootfs" update-ca-certificates >/dev/null
    fi
}

# A debootstrapped tree made smaller: no package lists, caches, docs, man pages or locales.
slim_rootfs() {
    local rootfs="$1"
    $SUDO chroot "$rootfs" apt-get clean
    $SUDO rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
    $SUDO find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' \
        -exec rm -rf {} + 2>/dev/null || true
}

build_stand_in() {
    local name="$1" packages="$2" after="$3"
    shift 3
    local work cache mirror
    cache="${TURNBUS_BASE_CACHE:-$HOME/.cache/turnbus-base-images}"
    mkdir -p "$cache"
    work="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "$SUDO rm -rf '$work'" RETURN
    mirror="$(debian_mirror)"
    log "building $name from Debian $suite ($mirror): $packages"
    $SUDO debootstrap --variant=minbase --cache-dir="$cache" --include="$packages" \
        "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        log "debootstrap failed for $name"
        return 1
    }
    copy_local_cas "$work/rootfs"
    $SUDO chroot "$work/rootfs" sh -c "$after"
    slim_rootfs "$work/rootfs"
    $SUDO tar -C "$work/rootfs" -c . | docker import "$@" - "$name" >/dev/null
    log "built $name ($(docker image inspect -f '{{.Size}}' "$name" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
}

# Prints the image to use for one base: the official one, else the stand-in.
resolve() {
    local official="$1" stand_in="$2"
    shift 2
    if have_image "$official"; then
        log "$official present"
        echo "$official"
    elif docker pull -q "$official" >/dev/null 2>&1; then
        log "pulled $official"
        echo "$official"
    elif have_image "$stand_in"; then
        log "$official cannot be pulled; $stand_in present"
        echo "$stand_in"
    else
        log "$official cannot be pulled"
        "$@" >&2
        echo "$stand_in"
    fi
}

docker version --format '{{.Server.Version}}' >/dev/null || {
    log "no Docker engine answers"
    exit 1
}

redis_image="$(resolve redis:7 turnbus-local/redis:7 \
    build_stand_in turnbus-local/redis:7 redis-server \
    'mkdir -p /data && chown redis:redis /data' \
    -c 'USER redis' -c 'WORKDIR /data' -c 'EXPOSE 6379' -c 'ENV LANG=C.UTF-8' \
    -c 'CMD ["redis-server", "--protected-mode", "no"]')"

python_image="$(resolve python:3.11-slim turnbus-local/python:3.11 \
    build_stand_in turnbus-local/python:3.11 \
    python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    'python3 --version >/dev/null' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]')"

echo "export TURNBUS_REDIS_IMAGE=$redis_image"
echo "export TURNBUS_PYTHON_IMAGE=$python_image"
