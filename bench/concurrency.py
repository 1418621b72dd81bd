#!/usr/bin/env python3
"""Many concurrent requests against a process pipeline: do they all complete, and what does
each stage hold meanwhile?

    .venv/bin/python bench/concurrency.py [--requests 100] [--max-running 16] [--tokens 32]

The `small` preset, 3 stages, one `meshd run` process per node, `--max-running N` on the
orchestrator (the rest wait in its queue).  Fires every request at once through
POST /api/generate and, while they run, samples each stage's `meshd_stage_requests` and
`meshd_stage_kv_cache_bytes` (from /metrics) and its resident memory.  Prints how many
completed, the status codes, the queue waits, and each stage's peak requests, KV cache
and RSS against its --kv-budget-mb.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from meshd.pipeline.checkpoint import init_checkpoint  # noqa: E402
from meshd.testing.processes import start_mesh  # noqa: E402
from meshd.testing.stranger import rss_bytes  # noqa: E402

PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground there lived a hobbit.",
           "Hello", "Pipeline parallel inference splits the layers", "A long time ago"]


def url_of(proc) -> str:
    line = proc.wait_for(lambda s: s.startswith("meshd dashboard url="), 20, "dashboard URL")
    return line.split("=", 1)[1].split()[0]


def held(client: httpx.Client) -> tuple[float, float]:
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    value = {name: sum(s.value for s in families[name].samples) if name in families else 0.0
             for name in ("meshd_stage_requests", "meshd_stage_kv_cache_bytes")}
    return value["meshd_stage_requests"], value["meshd_stage_kv_cache_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kv-budget-mb", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as tmp:
        init_checkpoint(tmp, "small", seed=0)
        procs = start_mesh(3, extra=["--model", tmp, "--max-running", str(args.max_running),
                                     "--kv-budget-mb", str(args.kv_budget_mb), "--dashboard", "127.0.0.1:0"])
        try:
            orch = httpx.Client(base_url=url_of(procs[0]), timeout=600)
            stages = [httpx.Client(base_url=url_of(p), timeout=10) for p in procs[1:]]
            deadline = time.monotonic() + 30
            while orch.post("/api/generate", json={"prompt": "Hi", "max_tokens": 2}).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("the pipeline did not become ready in 30 s")
                time.sleep(0.2)
            peaks = [[0.0, 0.0, 0] for _ in stages]
            done = threading.Event()

            def watch() -> None:
                while not done.is_set():
                    for k, (client, proc) in enumerate(zip(stages, procs[1:], strict=True)):
                        requests, kv = held(client)
                        peak = peaks[k]
                        peak[0], peak[1] = max(peak[0], requests), max(peak[1], kv)
                        peak[2] = max(peak[2], rss_bytes(proc.proc.pid))
                    time.sleep(0.05)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()

            def one(i: int) -> tuple[int, float, int]:
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.tokens, "seed": i,
                        "temperature": 0.0 if i % 2 else 0.8, "top_k": 20}
                r = orch.post("/api/generate", json=body)
                if r.status_code != 200:
                    return r.status_code, 0.0, 0
                return 200, r.json()["timings"]["queued_s"], len(r.json()["tokens"])

            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
                results = list(pool.map(one, range(args.requests)))
            wall = time.perf_counter() - t0
            done.set()
            watcher.join()
            after = [held(c) for c in stages]
        finally:
            for p in procs:
                p.stop(timeout=5)
    codes = [r[0] for r in results]
    waits = [r[1] for r in results if r[0] == 200]
    print(f"small preset, 3 stages, one process per node; {args.requests} concurrent requests of "
          f"{args.tokens} tokens, --max-running {args.max_running}, --kv-budget-mb {args.kv_budget_mb}")
    print(f"  completed: {codes.count(200)} of {args.requests} "
          f"(status codes: {dict((c, codes.count(c)) for c in sorted(set(codes)))}) in {wall:.1f} s, "
          f"{sum(r[2] for r in results) / wall:.1f} tokens/s in all")
    print(f"  queue wait: median {statistics.median(waits):.2f} s, max {max(waits):.2f} s; "
          f"{sum(w > 0 for w in waits)} requests waited")
    for k, (requests, kv, rss) in enumerate(peaks):
        print(f"  stage-{k}: at most {requests:.0f} requests held, KV cache peak {kv / 2**20:.2f} MiB "
              f"(budget {args.kv_budget_mb} MiB), RSS peak {rss / 2**20:.0f} MiB; after: "
              f"{after[k][0]:.0f} requests, {after[k][1] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
