#!/usr/bin/env bash
# Docker end to end: build the image (scripts/docker-build.sh), bring up docker/compose.yaml's
# relay, orchestrator and N stages on an internal Docker network (nothing routed out of it),
# with stage-0's direct packets to stage-1 (to the orchestrator when N=1) dropped inside a
# container; generate once through the orchestrator, check the tokens against `meshd generate`
# run in the same image on the same checkpoint, show `meshd doctor`'s view of the one-way pair,
# tear it all down (containers, network, volumes) and fail if anything of the run is left.
#   scripts/docker-e2e.sh N        (1 <= N <= 16)
# The drop is an nftables rule on the receiving container's input hook (it starts as root with
# cap_add NET_ADMIN, installs the rule, and runs meshd as the meshd user); where the engine
# refuses the capability or the image has no nft (or MESHD_E2E_DROP_BY=fault), it is the sending
# node's own --fault drop:.
# Works with `docker compose` (v2) or `docker-compose` (v1). Exit 0 only if the run passed; 3
# when there is no engine or no compose to run it with.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
if [[ ! $n =~ ^[0-9]+$ || $n -lt 1 || $n -gt 16 ]]; then
    echo "usage: $0 N   (1 <= N <= 16 stages)" >&2
    exit 2
fi
if ! command -v docker >/dev/null 2>&1; then
    echo "docker-e2e: no Docker engine here (no docker command); nothing was started" >&2
    exit 3
elif ! docker info >/dev/null 2>&1; then
    echo "docker-e2e: no Docker engine running here (docker info failed); nothing was started" >&2
    exit 3
fi
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1 && docker-compose version >/dev/null 2>&1; then
    compose=(docker-compose)
else
    echo "docker-e2e: neither \`docker compose\` (v2 plugin) nor \`docker-compose\` (v1) is here; nothing was started" >&2
    exit 3
fi

say() { echo "docker-e2e: $*"; }
started=$SECONDS
project=meshd-e2e-$$
prompt="Once upon a time"
max_tokens=16
wait_s=${MESHD_E2E_WAIT_S:-180}
export COMPOSE_PROJECT_NAME=$project MESHD_STAGES=$n MESHD_IMAGE=${MESHD_IMAGE:-meshd:latest}
export MESHD_PRESET=tiny
[[ $n -le 4 ]] || MESHD_PRESET=deep  # tiny has 4 layers, deep 16: a layer per stage at least
export MESHD_DASHBOARD_TOKEN=${MESHD_DASHBOARD_TOKEN:-$(python3 -c "import secrets; print(secrets.token_urlsafe(24))")}
export MESHD_MESH_KEY=${MESHD_MESH_KEY:-$(python3 -c "import base64, os; print(base64.b64encode(os.urandom(32)).decode())")}
from=stage-0
to=stage-1
[[ $n -ge 2 ]] || to=orchestrator

work=$(mktemp -d "${TMPDIR:-/tmp}/meshd-e2e.XXXXXX")
files=(-f docker/compose.yaml -f "$work/e2e.yaml")

# Everything of the run carries the compose project's label.
leftovers() {
    local label=label=com.docker.compose.project=$project
    {
        docker ps -aq --filter "$label" | sed 's/^/container /'
        docker network ls -q --filter "$label" | sed 's/^/network /'
        docker volume ls -q --filter "$label" | sed 's/^/volume /'
    } 2>/dev/null
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    restore_output
    stop_child
    if [[ -f $work/e2e.yaml ]]; then
        timeout 120 "${compose[@]}" "${files[@]}" down --volumes --remove-orphans --timeout 5 \
            >"$work/down.log" 2>&1 || cat "$work/down.log" >&2
    fi
    # What compose down left (a container the engine was still creating when `up` was stopped,
    # say) goes by force; a few rounds, since one may appear while the last is removed.
    local left round
    for round in 1 2 3; do
        left=$(leftovers)
        [[ -n $left ]] || break
        echo "docker-e2e: compose down left $(echo "$left" | tr '\n' ' '); removing by force" >&2
        echo "$left" | while read -r kind id; do
            case $kind in
            container) docker rm -f "$id" ;;
            network) docker network rm "$id" ;;
            volume) docker volume rm -f "$id" ;;
            esac >/dev/null 2>&1 || true
        done
        sleep "$round"
    done
    left=$(leftovers)
    if [[ -n $left ]]; then
        echo "docker-e2e: left behind by the run: $(echo "$left" | tr '\n' ' ')" >&2
        rc=1
    elif [[ -f $work/e2e.yaml ]]; then
        say "torn down: no container, network or volume of $project is left"
    fi
    rm -rf "$work"
    exit "$rc"
}
source scripts/docker-lib.sh

fail() {
    echo "docker-e2e: $*" >&2
    exit 1
}

run scripts/docker-build.sh || fail "the image $MESHD_IMAGE could not be built (see above)"

# The drop: nftables on the receiving container where the engine grants NET_ADMIN and the image
# has nft; else the sending node's own --fault.
if [[ ${MESHD_E2E_DROP_BY:-} != fault ]] &&
    docker run --rm --network none --user root --cap-add NET_ADMIN --entrypoint nft "$MESHD_IMAGE" \
        add table inet meshd_probe >/dev/null 2>&1; then
    drop_by=nftables
    say "$from→$to: dropped by nftables on $to's input hook (cap_add NET_ADMIN)"
else
    drop_by=fault
    say "$from→$to: dropped by $from's own --fault (no nftables with NET_ADMIN in the container)"
fi

# The run's additions to docker/compose.yaml: the network is internal, stages past stage-2,
# and the firewalled pair.
{
    echo "services:"
    for ((k = 3; k < n; k++)); do
        cat <<EOF
  stage-$k:
    extends: {file: compose.yaml, service: stage-2}
    command: ["stage", "$k"]
EOF
    done
    if [[ $drop_by == nftables ]]; then
        cat <<EOF
  $to:
    user: root
    cap_add: [NET_ADMIN]
    environment: {MESHD_DROP_FROM: $from}
EOF
    else
        cat <<EOF
  $from:
    environment: {MESHD_DROP_TO: $to}
EOF
    fi
    cat <<EOF
networks:
  mesh:
    internal: true
EOF
} >"$work/e2e.yaml"
# extends names its file relative to the compose file that holds it; this one lives elsewhere.
sed -i "s|{file: compose.yaml|{file: $PWD/docker/compose.yaml|" "$work/e2e.yaml"
stages=()
for ((k = 0; k < n; k++)); do stages+=("stage-$k"); done

compose_run() { run timeout "$1" "${compose[@]}" "${files[@]}" "${@:2}"; }

t0=$SECONDS
compose_run 180 up -d model relay orchestrator "${stages[@]}" >"$work/up.log" 2>&1 || {
    cat "$work/up.log" >&2
    fail "compose up failed (log above)"
}
orchestrator=$("${compose[@]}" "${files[@]}" ps -q orchestrator)
[[ -n $orchestrator ]] || fail "compose up started no orchestrator container"
internal=$(docker network inspect -f '{{.Internal}}' "${project}_mesh" 2>/dev/null || true)
[[ $internal == true ]] || fail "the network ${project}_mesh is not internal (Internal: '$internal')"
say "up in $((SECONDS - t0)) s: model ($MESHD_PRESET checkpoint in volume ${project}_model), relay, orchestrator, ${stages[*]}; network ${project}_mesh internal"

# Everything is asked from inside the orchestrator's container (scripts/docker-e2e-ask.py on the
# image's python): nothing of the run is published to the host.
ask() { run timeout "$((wait_s + 30))" docker exec -i "$orchestrator" python - "$@" <scripts/docker-e2e-ask.py; }
show_logs() { "${compose[@]}" "${files[@]}" logs --no-color --tail 15 >&2 || true; }

t0=$SECONDS
ask generate "$prompt" "$max_tokens" "$wait_s" >"$work/generated" || {
    show_logs
    fail "no generation through the orchestrator (the nodes' logs above)"
}
generated=$(<"$work/generated")
say "the orchestrator generated in $((SECONDS - t0)) s: $generated"
run timeout 120 docker exec "$orchestrator" meshd generate --model /model/checkpoint --prompt "$prompt" \
    --max-tokens "$max_tokens" --json >"$work/reference.json" || fail "meshd generate in the image failed"
reference=$(tail -n 1 "$work/reference.json" | python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens"])')
say "meshd generate in the same image:  $reference"
[[ $generated == "$reference" ]] || fail "the pipeline's tokens differ from meshd generate's"
say "tokens equal meshd generate's: yes ($max_tokens tokens through $n stage(s))"

t0=$SECONDS
ask asymmetric "$from" "$to" "$wait_s" >"$work/pair" || {
    show_logs
    fail "meshd doctor never named $from→$to (the nodes' logs above)"
}
say "meshd doctor on the orchestrator (it named the pair after $((SECONDS - t0)) s):"
run timeout 60 docker exec "$orchestrator" meshd doctor "http://127.0.0.1:8080" >"$work/doctor.txt" || true
sed 's/^/    /; s/[[:space:]]*$//' "$work/doctor.txt"
say "asymmetric pair reported: $(<"$work/pair")"
say "passed in $((SECONDS - started)) s"
