#!/usr/bin/env python3
"""The floor under `bench/pipeline.py`'s single-stream latency ratio on this host: the
small preset's decode split over three processes as meshd splits it, with none of
meshd's own work between them.

Three processes, one per stage, each holding what that stage holds (its layers, the
embedding at stage 0, the LM head's two shares at stage 0 and the last stage), pass each
greedy token around on plain blocking loopback TCP sockets: stage 0 embeds the token and
runs its layers, stage 1 its layers, stage 2 its layers and the final norm, then stage 0
and stage 2 each take their share of the head at once and stage 0 picks the token, the
critical path of a meshd token.  No framing, sealing, encoding, event loop or
bookkeeping: a token costs the processes' compute and the three wake-ups of a process
asleep in ``recv``.  Against the monolithic decode (the whole model in one process, one
token after another), in turn, ``--pairs`` times; prints each one's median ms per token
and the median of the per-pair ratios.  A round of 64 tokens lasts a fifth of a second,
and on a shared VM the monolithic run's speed moved by half between such rounds: hence
200 tokens and 15 pairs by default.

    .venv/bin/python bench/ring.py [--tokens 200] [--pairs 15]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per stage, as in bench/pipeline.py

import multiprocessing  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from meshd.pipeline.checkpoint import init_checkpoint  # noqa: E402
from meshd.pipeline.config import LlamaConfig  # noqa: E402
from meshd.pipeline.model import StageModel, head_cut  # noqa: E402
from meshd.pipeline.stage import stage_share  # noqa: E402

STAGES = 3
FIRST_TOKEN = 1
WAIT_S = 120.0  # a process that died (or hangs) ends the bench with an error, not a hang
_PICK = struct.Struct("<if")  # a head share's best token and its logit


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("the ring closed")
        buf += chunk
    return bytes(buf)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _accept(listener: socket.socket) -> socket.socket:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _best(logits: np.ndarray, offset: int) -> tuple[int, float]:
    i = int(np.argmax(logits))
    return offset + i, float(logits[i])


def _stage(k: int, model_dir: str, listener: socket.socket, next_port: int, rounds: int, tokens: int,
           ready: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    config = LlamaConfig.load(model_dir)
    layers, embed, head = stage_share(config, k, STAGES)
    model = StageModel.load(model_dir, layers, embed=embed, head=head, config=config)
    cut = head_cut(config.vocab_size)
    dims = config.hidden_size
    ready.wait(WAIT_S)
    nxt = _connect(next_port)  # stage k -> k+1, and the last stage -> stage 0
    prev = _accept(listener)
    per_round: list[float] = []
    made: list[int] = []
    for _ in range(rounds):
        cache = model.new_cache(tokens + 1)
        token, t0, made = FIRST_TOKEN, time.perf_counter(), []
        for pos in range(tokens):
            if k == 0:
                nxt.sendall(model.forward(model.embed([token]), cache, pos).astype(np.float32).tobytes())
                normed = np.frombuffer(_recv_exactly(prev, 4 * dims), dtype=np.float32).reshape(1, dims)
                mine = _best(model.head_logits(normed, slice(0, cut))[0], 0)
                theirs = _PICK.unpack(_recv_exactly(prev, _PICK.size))
                token = mine[0] if mine[1] >= theirs[1] else theirs[0]
                made.append(token)
            else:
                hidden = np.frombuffer(_recv_exactly(prev, 4 * dims), dtype=np.float32).reshape(1, dims)
                hidden = model.forward(hidden, cache, pos)
                if k < STAGES - 1:
                    nxt.sendall(hidden.astype(np.float32).tobytes())
                    continue
                normed = model.final_norm(hidden)
                nxt.sendall(normed.astype(np.float32).tobytes())
                theirs = model.head_logits(normed, slice(cut, config.vocab_size))[0]
                nxt.sendall(_PICK.pack(*_best(theirs, cut)))
        per_round.append((time.perf_counter() - t0) / tokens)
        ready.wait(WAIT_S)  # the monolithic run goes between rounds, alone
        ready.wait(WAIT_S)
    if k == 0:
        out.put((per_round, made))


def _monolithic(model: StageModel, tokens: int, made: list[int] | None = None) -> float:
    cache = model.new_cache(tokens + 1)
    token, t0 = FIRST_TOKEN, time.perf_counter()
    for pos in range(tokens):
        token = int(np.argmax(model.logits(model.forward(model.embed([token]), cache, pos))[0]))
        if made is not None:
            made.append(token)
    return (time.perf_counter() - t0) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200,
                        help="greedy tokens a round (the small preset holds 256)")
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    with tempfile.TemporaryDirectory() as model_dir:
        config = init_checkpoint(model_dir, "small")
        if not 1 <= args.tokens < config.max_position_embeddings:
            parser.error(f"--tokens must be from 1 to {config.max_position_embeddings - 1} "
                         "(the small preset's context, less the first token)")
        whole = StageModel.load(model_dir)
        _monolithic(whole, args.tokens)  # warm
        listeners = []
        for _ in range(STAGES):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
            listeners.append(sock)
        ports = [sock.getsockname()[1] for sock in listeners]
        ready = multiprocessing.Barrier(STAGES + 1)
        out: multiprocessing.Queue = multiprocessing.Queue()
        rounds = args.pairs + 1  # the first warms the stages
        procs = [multiprocessing.Process(target=_stage, args=(k, model_dir, listeners[k],
                                                               ports[(k + 1) % STAGES], rounds, args.tokens,
                                                               ready, out))
                 for k in range(STAGES)]
        for p in procs:
            p.start()
        try:
            ready.wait(WAIT_S)  # loaded
            mono = []
            for _ in range(rounds):
                ready.wait(WAIT_S)  # the ring's round is done
                mono.append(_monolithic(whole, args.tokens))
                ready.wait(WAIT_S)
            ring, ring_tokens = out.get(timeout=WAIT_S)
        except (threading.BrokenBarrierError, queue.Empty):
            raise SystemExit(f"bench/ring.py: a stage process died or hung (waited {WAIT_S:g} s)") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    mono_tokens: list[int] = []
    _monolithic(whole, args.tokens, mono_tokens)
    ring, mono = ring[1:], mono[1:]
    ratios = sorted(r / m for r, m in zip(ring, mono, strict=True))
    print(f"small preset, {STAGES} stages, {args.tokens} greedy tokens, {args.pairs} pairs (ring round, "
          f"then monolithic), BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"  monolithic, one process:            {statistics.median(mono) * 1000:.3f} ms/token")
    print(f"  three processes, nothing but the model between them: "
          f"{statistics.median(ring) * 1000:.3f} ms/token")
    print(f"  ratio (median of pairs): {statistics.median(ratios):.3f} "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  the ring's tokens equal the monolithic run's: {'yes' if ring_tokens == mono_tokens else 'NO'}")


if __name__ == "__main__":
    main()
