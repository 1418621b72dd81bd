#!/usr/bin/env python3
"""Monolithic vs pipelined generation on the `small` preset, side by side in one run.

Two pipelines, each against the monolithic reference (`generate` with the
whole model loaded once):

- nodes in this process: an orchestrator and N stage nodes on loopback (real
  UDP gossip, real TCP data streams) in one interpreter, so every node's work
  shares one thread;
- one `meshd run` process per node, driven through POST /api/generate, as a
  user runs it.

Runs alternate, monolithic then pipelined, so both see the same machine; the
latency ratio is the median of the per-pair ratios.  On a shared 2-core VM a
single pair's ratio ranges about 0.2 either side of the median (the
monolithic run's own speed changes by a fifth from one run to the next), so
the default is 9 pairs.  Prints tokens/s for
both, for one stream and for W concurrent streams, the median per-hop transit
time, and where a token's time goes.

``--blas-threads`` (default 1) sets OPENBLAS_NUM_THREADS for this process and
the node processes alike: one core per stage, as on separate hosts, and one
core for the monolithic run.  The process pipelines' stages run on CPUs of
their own, as smoke-run places stages that share a host (``--cpus``, see
``meshd.pipeline.threads.stage_cpus``); the monolithic run is not pinned.

``--mesh-key`` instead measures what the mesh key costs: two process
pipelines side by side, one whose nodes share a mesh key (every gossip
datagram and relay payload sealed) and one without, requests alternating
between them; both encrypt the data channel, which is always on.  Prints the
per-token latency of each and the median of the per-pair ratios.

    .venv/bin/python bench/pipeline.py [--stages 3] [--tokens 64] [--streams 4] [--runs 9]
    .venv/bin/python bench/pipeline.py --mesh-key [--runs 15]
    .venv/bin/python bench/pipeline.py --batching [--runs 5]

``--batching`` runs two process pipelines of this tree in turn, one up at a time, one
batching (``--max-batch 16``) and one not (``--max-batch 1``), and for 1, 4, 8 and 16
concurrent streams (mixed prompts; greedy and sampled) prints the aggregate tokens/s of
each next to the monolithic single stream, each one's single-stream latency ratio, and
the share of each pass spent before its last stream's first token (the prompts' prefills,
which the aggregate includes).  Last, this host's wake after a 5 ms sleep (``bench/wake.py``),
which a hop pays where its stage sleeps: a stage serving one request polls instead
(``meshd run --poll-ms``), and the other processes on the host (the bench's own, the
orchestrator) still sleep and wake; on a VM it moves the latency ratio from hour to hour.
``bench/ring.py`` measures the floor under that ratio: the same three stages' compute over
plain blocking sockets, with none of meshd's own work between the processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--skip-processes", action="store_true", help="only the in-process pipeline")
    parser.add_argument("--skip-inprocess", action="store_true", help="only the process-per-node pipeline")
    parser.add_argument("--batching", action="store_true",
                        help="aggregate tokens/s for 1, 4, 8, 16 streams: --max-batch 16 against "
                             "--max-batch 1 and the monolithic single stream, side by side")
    parser.add_argument("--mesh-key", action="store_true",
                        help="compare process pipelines with and without a mesh key, side by side")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.blas_threads)  # before numpy loads; children inherit it

import trio  # noqa: E402

from meshd.node import NodeOptions  # noqa: E402
from meshd.pipeline.checkpoint import init_checkpoint  # noqa: E402
from meshd.pipeline.generate import generate  # noqa: E402
from meshd.pipeline.model import StageModel  # noqa: E402
from meshd.testing.inprocess import start_node, wait_converged  # noqa: E402

PROMPT = "Once upon a time, in a mesh far away,"
PROMPTS = [PROMPT, "The quick brown fox", "In a hole in the ground there lived a hobbit. Not a nasty, dirty,",
           "Hello", "Pipeline parallel inference splits the layers", "A long time ago"]


def collect(hops: list[dict], steps: dict[str, list[float]]) -> list[float]:
    """Adds one request's median per step to ``steps``; returns its transit medians."""
    for h in hops:
        steps.setdefault(f"{h['kind']} {h['name']}", []).append(h["median_ms"])
    return [h["median_ms"] for h in hops if h["kind"] == "transit"]


def monolithic(model_dir: str, model: StageModel, tokens: int) -> float:
    """Seconds per generated token, prompt included, as `meshd generate` runs it."""
    r = generate(model_dir, PROMPT, tokens, model=model)
    return r["timings"]["total_ms"] / 1000 / len(r["tokens"])


async def pipelined(model_dir: str, model: StageModel, stages: int, tokens: int, streams: int,
                    runs: int) -> dict:
    lines: list[str] = []
    async with trio.open_nursery() as nursery:
        opts = dict(profile="local", stages=stages, model=model_dir)
        orch_node = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
        nodes = [orch_node]
        for k in range(stages):
            stage = NodeOptions(stage=k, seeds=[orch_node.addr], **opts)
            nodes.append(await start_node(nursery, stage, lines))
        await wait_converged(nodes)
        orch = orch_node.app
        await orch.wait_ready(10)
        await orch.generate(PROMPT, 4)  # warm up: streams dialled, caches allocated
        mono, single, hops = [], [], []
        steps: dict[str, list[float]] = {}
        for _ in range(runs):
            # the reference in a thread, so this process's nodes keep gossiping meanwhile
            mono.append(await trio.to_thread.run_sync(monolithic, model_dir, model, tokens))
            t0 = time.perf_counter()
            result = await orch.generate(PROMPT, tokens)
            single.append((time.perf_counter() - t0) / len(result["tokens"]))
            hops += collect(result["timings"]["hops"], steps)

        done = []

        async def one(seed: int) -> None:
            done.append(len((await orch.generate(PROMPT, tokens, 0.8, 20, seed))["tokens"]))

        t0 = time.perf_counter()
        async with trio.open_nursery() as inner:
            for seed in range(streams):
                inner.start_soon(one, seed)
        concurrent_s = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return {
        "mono": mono,
        "single": single,
        "concurrent_tokens_per_s": sum(done) / concurrent_s,
        "hop_ms": statistics.median(hops),
        "steps": {name: statistics.median(v) for name, v in steps.items()},
    }


def pipelined_processes(model_dir: str, model: StageModel, stages: int, tokens: int, streams: int,
                        runs: int) -> dict:
    """The same, with each node a `meshd run` process, driven through POST /api/generate."""
    import concurrent.futures

    import httpx

    from meshd.testing.processes import start_mesh

    procs = start_mesh(stages, extra=["--model", model_dir])
    try:
        orch = procs[0]
        line = orch.wait_for(lambda s: s.startswith("meshd dashboard url="), 20, "dashboard URL")
        url = line.split("=", 1)[1]
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 30
            while client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 503:
                if time.monotonic() > deadline:
                    raise TimeoutError("the process pipeline did not become ready in 30 s")
                time.sleep(0.2)
            mono, single, hops = [], [], []
            steps: dict[str, list[float]] = {}
            for _ in range(runs):
                mono.append(monolithic(model_dir, model, tokens))
                t0 = time.perf_counter()
                r = client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": tokens}).json()
                single.append((time.perf_counter() - t0) / len(r["tokens"]))
                hops += collect(r["timings"]["hops"], steps)

            def one(seed: int) -> int:
                body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.8, "top_k": 20, "seed": seed}
                return len(client.post("/api/generate", json=body).json()["tokens"])

            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                n = sum(pool.map(one, range(streams)))
            concurrent_s = time.perf_counter() - t0
    finally:
        for p in procs:
            p.stop(timeout=5)
    return {"mono": mono, "single": single, "concurrent_tokens_per_s": n / concurrent_s,
            "hop_ms": statistics.median(hops), "steps": {k: statistics.median(v) for k, v in steps.items()}}


def keyed_vs_plain(model_dir: str, stages: int, tokens: int, runs: int) -> None:
    """Two process pipelines, with and without a mesh key; requests alternate between them."""

    from meshd.keyring import generate_file
    from meshd.testing.processes import start_mesh

    key_file = os.path.join(model_dir, "mesh.key")
    generate_file(key_file)
    meshes = {"no key": start_mesh(stages, extra=["--model", model_dir])}
    clients: dict = {}
    try:
        meshes["mesh key"] = start_mesh(stages, extra=["--model", model_dir, "--mesh-key-file", key_file])
        clients = {label: _ready_client(procs, label) for label, procs in meshes.items()}
        per_token: dict[str, list[float]] = {label: [] for label in meshes}
        tokens_seen: dict[str, list[int]] = {}
        for _ in range(runs):
            for label, client in clients.items():
                t0 = time.perf_counter()
                r = client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": tokens}).json()
                per_token[label].append((time.perf_counter() - t0) / len(r["tokens"]))
                tokens_seen.setdefault(label, r["tokens"])
    finally:
        _close(clients, meshes)
    ratios = sorted(k / p for k, p in zip(per_token["mesh key"], per_token["no key"], strict=True))
    print(f"small preset, {stages} stages, one `meshd run` process per node, prompt + {tokens} tokens, "
          f"{runs} requests to each pipeline, alternating")
    for label, values in per_token.items():
        ms = statistics.median(values) * 1000
        print(f"  {label:<9} {1000 / ms:7.1f} tokens/s  ({ms:.2f} ms/token, median)")
    print(f"  same tokens: {'yes' if tokens_seen['no key'] == tokens_seen['mesh key'] else 'NO'}")
    print(f"  latency ratio mesh key / no key: median {statistics.median(ratios):.3f} "
          f"(pairs: {', '.join(f'{r:.2f}' for r in ratios)}; target < 1.10)")


def _ready_client(procs, label: str):
    import httpx

    line = procs[0].wait_for(lambda s: s.startswith("meshd dashboard url="), 20, "dashboard URL")
    client = httpx.Client(base_url=line.split("=", 1)[1], timeout=300)
    deadline = time.monotonic() + 30
    while client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 4}).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {label} pipeline did not become ready in 30 s")
        time.sleep(0.2)
    return client


def _close(clients: dict, meshes: dict) -> None:
    for client in clients.values():
        client.close()
    for procs in meshes.values():
        for p in procs:
            p.stop(timeout=5)


SINGLE_PAIRS = 6  # single-stream pairs (monolithic, then pipelined) per pipeline started: a pair
# costs half a second, and on a 2-core VM one pair's ratio moves by 0.2 either way


def batching(model_dir: str, model: StageModel, stages: int, tokens: int, runs: int,
             widths: tuple[int, ...] = (1, 4, 8, 16)) -> None:
    """Two process pipelines of this tree, `--max-batch 16` and `--max-batch 1`, measured in
    turn within each run: aggregate tokens/s for each number of concurrent streams, and the
    single-stream latency ratio.

    One pipeline is up at a time: started, served one whole request, measured, stopped,
    then the other.  On a host with fewer cores than nodes, the idle processes of a
    second mesh (each gossiping ten times a second) take turns on the cores that the
    measured pipeline's stages wait for, which no deployment has.  Each single stream is
    paired with a monolithic run just before it, on the same machine state, SINGLE_PAIRS
    pairs per pipeline started, and the latency ratio is the median of all the pairs.  The
    pipeline measured first alternates from one run to the next."""
    import concurrent.futures

    from meshd.testing.processes import start_mesh

    labels = {"batched": "16", "max-batch 1": "1"}
    mono: list[float] = []
    rates: dict[tuple[str, int], list[float]] = {}
    pairs: dict[str, list[float]] = {label: [] for label in labels}
    # Per pass of W streams: the share of its time before the last stream's first token
    # (its prompt's prefill waits behind the others'): the pass's aggregate includes it.
    ramp: dict[tuple[str, int], list[float]] = {}
    for run in range(runs):
        cells = []
        # Which pipeline goes first alternates from run to run, so a drift of the VM's speed
        # over a run weighs on both alike.
        order = list(labels.items()) if run % 2 == 0 else list(labels.items())[::-1]
        for label, flag in order:
            meshes = {label: start_mesh(stages, extra=["--model", model_dir, "--max-batch", flag])}
            clients: dict = {}
            try:
                client = clients[label] = _ready_client(meshes[label], label)

                firsts: list[float] = []  # perf_counter of each first token of the pass

                def one(seed: int, client=client, firsts=firsts) -> int:
                    body = {"prompt": PROMPTS[seed % len(PROMPTS)], "max_tokens": tokens,
                            "temperature": 0.8 if seed % 2 else 0.0, "top_k": 20, "seed": seed}
                    t0 = time.perf_counter()
                    r = client.post("/api/generate", json=body)
                    r.raise_for_status()
                    firsts.append(t0 + (r.json()["timings"]["first_token_s"] or 0.0))
                    return len(r.json()["tokens"])

                one(0)  # a whole request first: a mesh that served one, as a running mesh has
                for width in widths:
                    if width == 1:  # SINGLE_PAIRS times, each just after a monolithic run
                        for _ in range(SINGLE_PAIRS):
                            mono.append(1 / monolithic(model_dir, model, tokens))
                            t0 = time.perf_counter()
                            n = one(0)
                            took = time.perf_counter() - t0
                            pairs[label].append(mono[-1] * took / n)
                            rates.setdefault((label, width), []).append(n / took)
                        continue
                    firsts.clear()
                    t0 = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(width) as pool:
                        n = sum(pool.map(one, range(run * width, (run + 1) * width)))
                    took = time.perf_counter() - t0
                    rates.setdefault((label, width), []).append(n / took)
                    ramp.setdefault((label, width), []).append((max(firsts) - t0) / took)
            finally:
                _close(clients, meshes)
            ratios = ", ".join(f"{r:.2f}" for r in pairs[label][-SINGLE_PAIRS:])
            cells.append(f"{label}: monolithic {mono[-1]:.1f}, ratios {ratios}, "
                         + ", ".join(f"x{w} {rates[(label, w)][-1]:.1f}" for w in widths))
        print(f"  run {run + 1}/{runs}: " + "; ".join(cells), flush=True)
    m = statistics.median(mono)
    print(f"small preset, {stages} stages, one `meshd run` process per node, prompt + {tokens} tokens, "
          f"{runs} runs, one pipeline up at a time; medians")
    print(f"  monolithic, 1 stream: {m:7.1f} tokens/s")
    for label in labels:
        cells = [f"{w:>2} streams {statistics.median(rates[(label, w)]):7.1f} tokens/s "
                 f"({statistics.median(rates[(label, w)]) / m:.2f}x)" for w in widths]
        print(f"  {label:<12} " + "; ".join(cells))
    ratio = {label: statistics.median(v) for label, v in pairs.items()}
    print("  single-stream latency ratio pipelined/monolithic (median of pairs): "
          + ", ".join(f"{label} {r:.3f} ({', '.join(f'{x:.2f}' for x in sorted(pairs[label]))})"
                      for label, r in ratio.items())
          + f"; batched - max-batch 1: {ratio['batched'] - ratio['max-batch 1']:+.3f}; targets <= 1.25, "
          "within 0.05")
    print("  share of a pass before its last stream's first token (prompts wait for each other): "
          + "; ".join(f"{label} " + ", ".join(f"x{w} {statistics.median(ramp[(label, w)]):.0%}"
                                              for w in widths if w > 1) for label in labels))
    print("  targets: 8 streams >= 2x and 16 streams >= 3x the monolithic single stream (batched)")
    from wake import one_way_us  # bench/wake.py, beside this file

    asleep = {reader: one_way_us(reader, 5000, 200) for reader in ("blocking", "trio")}
    print(f"  this host's wake (bench/wake.py), paid where a process sleeps: a trio reader asleep 5 ms "
          f"read a message {asleep['trio']:.0f} µs after its write ({asleep['blocking']:.0f} µs for a "
          "blocking recv)")


def report(label: str, stages: int, streams: int, pipe: dict) -> None:
    mono_s, pipe_s = statistics.median(pipe["mono"]), statistics.median(pipe["single"])
    ratios = sorted(p / m for p, m in zip(pipe["single"], pipe["mono"], strict=True))
    print(f"{label}:")
    rate = pipe["concurrent_tokens_per_s"]
    print(f"  monolithic:                     {1 / mono_s:7.1f} tokens/s  ({mono_s * 1000:.2f} ms/token)")
    print(f"  pipelined, {stages} stages, 1 stream: {1 / pipe_s:7.1f} tokens/s  "
          f"({pipe_s * 1000:.2f} ms/token)")
    print(f"  pipelined, {stages} stages, {streams} streams: {rate:7.1f} tokens/s in all")
    print(f"  median per-hop transit: {pipe['hop_ms']:.3f} ms")
    if "steps" in pipe:
        # Steps run in parallel (the two halves of the LM head), and in one interpreter a
        # transit also holds whatever else ran first, so the medians do not add up.
        print("  where a token's time goes (median ms per step; steps overlap):")
        for name, ms in pipe["steps"].items():
            print(f"    {name:<34} {ms:6.3f}")
    print(f"  single-stream latency ratio pipelined/monolithic: median {statistics.median(ratios):.2f} "
          f"(pairs: {', '.join(f'{r:.2f}' for r in ratios)}; target <= 1.25)")


def main() -> None:
    args = ARGS
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as tmp:
        init_checkpoint(tmp, "small", seed=0)
        model = StageModel.load(tmp)
        generate(tmp, PROMPT, 4, model=model)  # warm up
        if args.mesh_key:
            keyed_vs_plain(tmp, args.stages, args.tokens, args.runs)
            return
        if args.batching:
            batching(tmp, model, args.stages, args.tokens, args.runs)
            return
        pipe = None
        if not args.skip_inprocess:
            pipe = trio.run(pipelined, tmp, model, args.stages, args.tokens, args.streams, args.runs)
        procs = None
        if not args.skip_processes:
            procs = pipelined_processes(tmp, model, args.stages, args.tokens, args.streams, args.runs)
    print(f"small preset (dim 288, 6 layers, vocab 32000), prompt + {args.tokens} tokens, "
          f"{args.runs} runs alternating monolithic/pipelined, BLAS threads {args.blas_threads}")
    if pipe is not None:
        report("nodes in this process (one interpreter for all)", args.stages, args.streams, pipe)
    if procs is not None:
        report("one `meshd run` process per node, over HTTP", args.stages, args.streams, procs)


if __name__ == "__main__":
    main()
