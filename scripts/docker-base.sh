#!/usr/bin/env bash
# The base for docker/Dockerfile where no image registry is reachable: a Debian bookworm root
# (debootstrap --variant=minbase, with python3, python3-venv and nftables) as a tarball that
# `docker import` turns into an image. Root only; about 1.5 minutes, once: the tarball is kept.
#   scripts/docker-base.sh           prints the tarball's path, making it if it is not there
#   scripts/docker-base.sh --path    prints where the tarball is (or would be), makes nothing
#   scripts/docker-base.sh --tag     prints the image tag that tarball is imported as
# Needs no Docker engine, so CI can make it while other work runs (.ci/run does). Two at once
# are safe: the second waits for the first (at most 15 minutes) and uses its tarball.
set -euo pipefail

packages=python3,python3-venv,nftables
suite=bookworm
mirror=${MESHD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
recipe=$(printf '%s %s minbase' "$suite" "$packages" | sha256sum | cut -c1-12)
tag=meshd-base:$suite-$recipe
cache=${XDG_CACHE_HOME:-$HOME/.cache}/meshd/docker-base
tarball=$cache/$suite-$recipe.tar

case ${1:-} in
--tag) echo "$tag" && exit 0 ;;
--path) echo "$tarball" && exit 0 ;;
'') ;;
*) echo "usage: $0 [--path | --tag]" >&2 && exit 2 ;;
esac
die() {
    echo "docker-base: $*" >&2
    exit 1
}
if [[ -f $tarball ]]; then
    echo "$tarball"
    exit 0
fi
command -v debootstrap >/dev/null || die "no debootstrap here (apt-get install debootstrap)"
[[ $(id -u) == 0 ]] || die "debootstrap needs root"
mkdir -p "$cache"
exec 9>"$tarball.lock"
flock -w 900 9 || die "another docker-base.sh held $tarball.lock for 15 minutes"
if [[ -f $tarball ]]; then  # made by the one we waited for
    echo "$tarball"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/meshd-base.XXXXXX")
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    restore_output
    stop_child
    # debootstrap mounts /proc and /sys inside its root: never remove through a mount.
    awk -v d="$work/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r |
        while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$work" "$tarball.tmp"
    exit "$rc"
}
source "$(dirname "$0")/docker-lib.sh"

rc=0
run timeout 900 debootstrap --variant=minbase --include="$packages" "$suite" "$work/root" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || rc=$?
if [[ $rc -ne 0 ]]; then
    tail -n 5 "$work/debootstrap.log" >&2
    die "debootstrap of $suite from $mirror failed (exit $rc; log above)"
fi
# The package cache and lists are not needed in an image that installs nothing more.
rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"*
tar -C "$work/root" -cf "$tarball.tmp" .
mv "$tarball.tmp" "$tarball"
echo "$tarball"
