#!/usr/bin/env bash
# netns end to end: relay, orchestrator and N stages, each in its own network namespace on a
# bridge, faults as real packet filters (nftables, tc netem, a NAT router). Root only.
#   scripts/netns-e2e.sh N [--fault SPEC ...] [any other smoke-run flag]
# e.g. scripts/netns-e2e.sh 3 --fault nat:orchestrator --fault drop:stage-2->stage-0
# Exit 0 only if the run passed; every namespace and rule is gone afterwards either way.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N [--fault SPEC ...] [smoke-run flags]" >&2
    exit 2
fi
n=$1
shift
python=.venv/bin/python
[[ -x $python ]] || python=python3
exec "$python" -m meshd smoke-run --provider netns --stages "$n" --max-tokens "${MAX_TOKENS:-16}" "$@"
