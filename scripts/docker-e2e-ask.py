"""What scripts/docker-e2e.sh asks the orchestrator, from inside its container (fed on stdin to
the image's python: nothing of the run is published to the host).

    generate PROMPT MAX_TOKENS WAIT_S   POST /api/generate until it answers; prints the tokens
    asymmetric FROM TO WAIT_S           `meshd doctor --json` until it names FROM→TO as a
                                        one-way pair; prints every asymmetric pair's detail

Each waits at most WAIT_S seconds and then exits with one line naming what it waited for;
a doctor that answers no JSON at all fails at once, with its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

DASHBOARD = "http://127.0.0.1:8080"


def generate(prompt: str, max_tokens: int, wait_s: float) -> str:
    deadline, last = time.monotonic() + wait_s, "no answer"
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json",
               "Authorization": "Bearer " + os.environ["MESHD_DASHBOARD_TOKEN"]}
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{DASHBOARD}/api/generate", body, headers)
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as r:
                return str(json.loads(r.read())["tokens"])
        except urllib.error.HTTPError as exc:  # 503 until every stage has joined
            last = f"{exc.code} {exc.read().decode(errors='replace')[:200]}"
        except (OSError, ValueError, KeyError) as exc:
            last = repr(exc)
        time.sleep(1)
    sys.exit(f"the orchestrator did not generate within {wait_s:g} s (last answer: {last})")


def asymmetric(a: str, b: str, wait_s: float) -> str:
    deadline, want, last = time.monotonic() + wait_s, f"{a}→{b}", "no problem"
    while time.monotonic() < deadline:
        r = subprocess.run(["meshd", "doctor", "--json", DASHBOARD], capture_output=True, text=True,
                           timeout=30)
        try:
            problems = json.loads(r.stdout)["problems"]
        except (ValueError, KeyError):  # the orchestrator has served: doctor itself is broken
            said = r.stderr.strip().splitlines() or [f"exit {r.returncode}"]
            sys.exit(f"meshd doctor failed: {said[-1]}")
        pairs = [p for p in problems if p["kind"] == "asymmetric"]
        if any(p["where"] == want for p in pairs):
            return " | ".join(p["detail"] for p in pairs)
        last = "; ".join(f"{p['kind']} {p['where']}" for p in problems) or "no problem"
        time.sleep(1)
    sys.exit(f"meshd doctor did not name {want} as a one-way pair within {wait_s:g} s (last: {last})")


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "generate":
        print(generate(argv[1], int(argv[2]), float(argv[3])))
    elif len(argv) == 4 and argv[0] == "asymmetric":
        print(asymmetric(argv[1], argv[2], float(argv[3])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
