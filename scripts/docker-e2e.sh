#!/usr/bin/env bash
# Docker end to end: build the image, bring up a relay, an orchestrator and N stages with
# docker/compose.yaml, generate once through the orchestrator's JSON API, tear it all down,
# and fail if any container of the run is left.
#   scripts/docker-e2e.sh N
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
if [[ ! $n =~ ^[0-9]+$ || $n -lt 1 ]]; then
    echo "usage: $0 N   (N >= 1 stages)" >&2
    exit 2
fi
if ! command -v docker >/dev/null 2>&1; then
    echo "docker-e2e: no Docker engine here (no docker command); nothing was started" >&2
    exit 3
elif ! docker info >/dev/null 2>&1; then
    echo "docker-e2e: no Docker engine running here (docker info failed); nothing was started" >&2
    exit 3
fi
export MESHD_STAGES=$n COMPOSE_PROJECT_NAME="meshd-e2e-$$" MESHD_DASHBOARD_PORT=${MESHD_DASHBOARD_PORT:-18080}
export MESHD_DASHBOARD_TOKEN=${MESHD_DASHBOARD_TOKEN:-$(python3 -c "import secrets; print(secrets.token_urlsafe(24))")}
export MESHD_MESH_KEY=${MESHD_MESH_KEY:-$(python3 -c "import base64, os; print(base64.b64encode(os.urandom(32)).decode())")}
compose=(docker compose -f docker/compose.yaml)
cleanup() {
    "${compose[@]}" down --remove-orphans --timeout 5 >/dev/null 2>&1 || true
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | wc -l)
    if [[ $left -ne 0 ]]; then
        echo "docker-e2e: $left container(s) left behind" >&2
        exit 1
    fi
}
trap cleanup EXIT
"${compose[@]}" up -d --build --quiet-pull
url="http://127.0.0.1:$MESHD_DASHBOARD_PORT/api/generate"
for _ in $(seq 1 120); do
    if out=$(python3 - "$url" <<'PY'
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1], json.dumps({"prompt": "Once upon a time", "max_tokens": 16}).encode(),
                             {"Content-Type": "application/json",
                              "Authorization": "Bearer " + os.environ["MESHD_DASHBOARD_TOKEN"]})
try:
    out = json.loads(urllib.request.urlopen(req, timeout=60).read())
except Exception:
    sys.exit(1)
assert len(out["tokens"]) == 16, out
print(json.dumps(out))
PY
    ); then
        echo "docker-e2e: $n stages generated: $out"
        exit 0
    fi
    sleep 1
done
echo "docker-e2e: the pipeline never answered at $url" >&2
"${compose[@]}" logs --tail 20 >&2 || true
exit 1
