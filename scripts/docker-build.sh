#!/usr/bin/env bash
# Build the meshd image from docker/Dockerfile, with no network during the build.
#   scripts/docker-build.sh          the image is $MESHD_IMAGE (default meshd:latest)
# The base image, first that applies:
#   $MESHD_BASE_IMAGE if set (pulled if the engine does not have it);
#   python:3.11-slim if the engine has it;
#   meshd-base:bookworm-<recipe>, the Debian root scripts/docker-base.sh makes with debootstrap,
#   if the engine has it (it stays, by tag, between runs);
#   python:3.11-slim pulled, where a registry answers;
#   else that Debian root imported as meshd-base:bookworm-<recipe>: from the tarball
#   scripts/docker-base.sh keeps, made now if it is not there (root only; about 1.5 min, once).
# The wheels are made on the host: meshd's from this tree, its dependencies' (and pip's)
# downloaded for the base's python, glibc and machine, cached in ~/.cache/meshd/docker-wheels/.
# An image built from the same tree, base and wheels is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

image=${MESHD_IMAGE:-meshd:latest}
slim=python:3.11-slim
deb_tag=$(scripts/docker-base.sh --tag)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/meshd/docker-wheels

say() { echo "docker-build: $*"; }
die() {
    echo "docker-build: $*" >&2
    exit 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/meshd-build.XXXXXX")
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    restore_output
    stop_child
    rm -rf "$work"
    exit "$rc"
}
source scripts/docker-lib.sh

have() { docker image inspect "$1" >/dev/null 2>&1; }

started=$SECONDS
if [[ -n ${MESHD_BASE_IMAGE:-} ]]; then
    base=$MESHD_BASE_IMAGE
    if ! have "$base"; then
        run timeout 300 docker pull -q "$base" >/dev/null || die "cannot pull the base image $base"
    fi
    say "base $base"
elif have "$slim"; then
    base=$slim
    say "base $base (the engine has it)"
elif have "$deb_tag"; then
    base=$deb_tag
    say "base $base (made with debootstrap earlier, reused)"
elif run timeout 120 docker pull -q "$slim" >/dev/null 2>&1; then
    base=$slim
    say "base $base (pulled)"
else
    base=$deb_tag
    t0=$SECONDS
    tarball=$(scripts/docker-base.sh --path)
    if [[ -f $tarball ]]; then
        say "no $slim here and no registry: $base from $tarball (debootstrap, made earlier)"
    else
        say "no $slim here and no registry: making $base with debootstrap (about 1.5 min, once)"
    fi
    run scripts/docker-base.sh >/dev/null ||
        die "no base image: $slim cannot be pulled and debootstrap could not make one (see above)"
    run docker import -c 'CMD ["/bin/bash"]' "$tarball" "$base" >/dev/null || die "docker import of $tarball failed"
    say "imported $base in $((SECONDS - t0)) s"
fi

# What the wheels must fit: the base's python, glibc and machine.
read -r pyver glibc machine < <(docker run --rm --network none --entrypoint python3 "$base" -c \
    'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}", platform.libc_ver()[1], platform.machine())') ||
    die "cannot run python3 in the base image $base"
[[ $glibc =~ ^2\.([0-9]+)$ ]] || die "the base image $base has no glibc that pip wheels fit (libc_ver: '$glibc')"
platforms=("--platform" "manylinux2014_$machine")
for ((m = 17; m <= BASH_REMATCH[1]; m++)); do
    platforms+=("--platform" "manylinux_2_${m}_$machine")
done

python=.venv/bin/python
[[ -x $python ]] || python=python3
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip: the wheels are made on the host with it"
mapfile -t deps < <("$python" -c \
    'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
deps+=(pip)  # the image's venv is made without pip; this one installs the wheels, and stays
key=$(printf '%s\n' "$pyver" "$glibc" "$machine" "${deps[@]}" | sha256sum | cut -c1-16)
wheels=$cache/py$pyver-$machine-$key
if [[ ! -d $wheels ]]; then
    say "downloading the dependencies' wheels for python $pyver, glibc $glibc, $machine"
    mkdir -p "$cache"
    run timeout 600 "$python" -m pip download -q --timeout 60 --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${platforms[@]}" -d "$work/deps" "${deps[@]}" >"$work/pip.log" 2>&1 || {
        grep -v '^WARNING: Location' "$work/pip.log" | tail -n 5 >&2
        die "pip download of meshd's dependencies failed (log above)"
    }
    rm -rf "$wheels.tmp" && mv "$work/deps" "$wheels.tmp" && mv "$wheels.tmp" "$wheels"
fi

# What the image is made of: this tree's package and docker files, the base, the wheels. An
# image already built from the same is kept as it is.
sources=(pyproject.toml README.md meshd dashboard docker/Dockerfile docker/meshd-node)
stamp=$({
    tar -c --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --exclude=__pycache__ "${sources[@]}"
    docker image inspect -f '{{.Id}}' "$base"
    echo "$key"
} | sha256sum | cut -c1-16)
if [[ $(docker image inspect -f '{{index .Config.Labels "meshd.build"}}' "$image" 2>/dev/null) == "$stamp" ]]; then
    say "$image is up to date (built from this tree on $base)"
    exit 0
fi

# The context: meshd's wheel, built from a copy of this tree (the build writes into it), the
# dependencies' wheels, and docker/.
mkdir -p "$work/src" "$work/ctx/wheels/meshd" "$work/ctx/docker"
tar -c --exclude=__pycache__ pyproject.toml README.md meshd dashboard | tar -x -C "$work/src"
run timeout 300 "$python" -m pip wheel -q --timeout 60 --no-deps -w "$work/ctx/wheels/meshd" "$work/src" \
    >"$work/pip.log" 2>&1 || {
    grep -v '^WARNING: Location' "$work/pip.log" | tail -n 5 >&2
    die "pip wheel of meshd failed (log above)"
}
listing=$("$python" -m zipfile -l "$work/ctx/wheels/meshd/"meshd-*.whl)
[[ $listing == *dashboard/static/index.html* ]] ||
    die "meshd's wheel has no dashboard/static/ (the dashboard could not start): pyproject.toml needs [tool.setuptools.package-data] dashboard = [\"static/*\"]"
cp -r "$wheels" "$work/ctx/wheels/deps"
cp docker/meshd-node "$work/ctx/docker/"

old=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
run docker build --network none --force-rm -f docker/Dockerfile --build-arg "BASE=$base" \
    --label "meshd.build=$stamp" \
    -t "$image" "$work/ctx" \
    >"$work/build.log" 2>&1 || {
    tail -n 15 "$work/build.log" >&2
    die "docker build of $image failed (log above)"
}
new=$(docker image inspect -f '{{.Id}}' "$image")
if [[ -n $old && $old != "$new" ]]; then
    docker rmi "$old" >/dev/null 2>&1 || true  # the image this tag held before, if nothing else uses it
fi
say "built $image from $base in $((SECONDS - started)) s"
