#!/usr/bin/env python3
"""A long prompt arriving while another request decodes: does the decode stall?

    .venv/bin/python bench/prefill.py [--prompt-tokens 2000] [--runs 5]

The `small` preset's shapes with a 4096-position context, 3 stages, one `meshd run` process
per node, two meshes side by side:

- chunked: this tree, a prompt runs as chunks of PREFILL_CHUNK rows, one worker thread each,
  beside the decode passes of the requests in flight;
- one pass: the same tree with the prompt run as one pass in a thread beside the decode
  passes (``bench/whole_prefill/sitecustomize.py`` patches that in).

In each run, on each mesh in turn: stream A decodes (``/v1/completions``, streamed); after
its 20th token, request B sends a prompt of ``--prompt-tokens`` tokens for one token.
Prints, as medians over the runs: the longest gap between A's tokens while B prefills,
A's median gap before B, and B's time to its token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from meshd.pipeline.checkpoint import init_checkpoint  # noqa: E402
from meshd.pipeline.model import PREFILL_CHUNK  # noqa: E402
from meshd.testing.processes import start_mesh  # noqa: E402

WHOLE = str(Path(__file__).resolve().parent / "whole_prefill")


def ready_client(procs, label: str) -> httpx.Client:
    line = procs[0].wait_for(lambda s: s.startswith("meshd dashboard url="), 20, "dashboard URL")
    client = httpx.Client(base_url=line.split("=", 1)[1].split()[0], timeout=300)
    deadline = time.monotonic() + 60
    while client.post("/api/generate", json={"prompt": "warm up", "max_tokens": 4}).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {label} pipeline did not become ready in 60 s")
        time.sleep(0.2)
    return client


def one_run(client: httpx.Client, prompt_tokens: int, seed: int) -> tuple[float, float, float]:
    """(A's longest gap while B prefills, A's median gap before B, B's time to its token), in s."""
    arrivals: list[float] = []
    b_span: list[float] = []
    started = threading.Event()

    def long_prompt() -> None:
        started.wait(60)
        text = "".join(chr(97 + (seed + i) % 26) for i in range(prompt_tokens - 1))  # a byte each, after BOS
        t0 = time.perf_counter()
        r = client.post("/api/generate", json={"prompt": text, "max_tokens": 1})
        r.raise_for_status()
        b_span.extend([t0, time.perf_counter()])

    b = threading.Thread(target=long_prompt)
    b.start()
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "seed": seed}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 20:
                    started.set()
    b.join()
    t0, t1 = b_span
    before = [y - x for x, y in zip(arrivals, arrivals[1:], strict=False) if y <= t0]
    during = [y - x for x, y in zip(arrivals, arrivals[1:], strict=False) if y > t0 and x < t1]
    return max(during, default=t1 - t0), statistics.median(before), t1 - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    results: dict[str, list[tuple[float, float, float]]] = {"chunked": [], "one pass": []}
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as tmp:
        init_checkpoint(tmp, "small", max_position_embeddings=4096)
        meshes, clients = {}, {}
        try:
            for label in results:
                saved = os.environ.get("PYTHONPATH")
                if label == "one pass":
                    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (WHOLE, saved) if p)
                try:
                    meshes[label] = start_mesh(3, extra=["--model", tmp])
                finally:
                    os.environ.pop("PYTHONPATH", None)
                    if saved is not None:
                        os.environ["PYTHONPATH"] = saved
            clients = {label: ready_client(procs, label) for label, procs in meshes.items()}
            for run in range(args.runs):
                cells = []
                for label, client in clients.items():
                    results[label].append(one_run(client, args.prompt_tokens, run))
                    gap, base, ttft = results[label][-1]
                    cells.append(f"{label}: longest gap {gap * 1000:.0f} ms "
                                 f"(median before {base * 1000:.0f} ms), prompt's token {ttft * 1000:.0f} ms")
                print(f"  run {run + 1}/{args.runs}: " + "; ".join(cells), flush=True)
        finally:
            for client in clients.values():
                client.close()
            for procs in meshes.values():
                for p in procs:
                    p.stop(timeout=5)
    print(f"small preset's shapes, 4096 positions, 3 stages, one process per node; "
          f"a {args.prompt_tokens}-token prompt beside a decoding stream; "
          f"PREFILL_CHUNK {PREFILL_CHUNK}; medians of {args.runs} runs")
    med = {label: [statistics.median(r[i] for r in rows) for i in range(3)]
           for label, rows in results.items()}
    for label, (gap, base, ttft) in med.items():
        print(f"  {label:<9} stream's longest gap {gap * 1000:6.0f} ms "
              f"(its median gap before: {base * 1000:.0f} ms); "
              f"the prompt's token after {ttft * 1000:6.0f} ms")
    print(f"  ratios one pass / chunked: longest gap {med['one pass'][0] / med['chunked'][0]:.2f}x, "
          f"prompt's token {med['one pass'][2] / med['chunked'][2]:.2f}x")


if __name__ == "__main__":
    main()
