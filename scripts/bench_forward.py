#!/usr/bin/env python3
"""Same-process A/B of the worker's forward pass: packed against dense projections, or the C++
CPU attention op against the torch reference's gather + SDPA.

Two runners hold copies of one random-weight model (by default the shape scripts/bench_vs_vllm.py
serves: hidden 512, 8 layers, 8 heads, 4 KV heads, FFN 1536, vocab 2048, fp32, blocks of 32),
each with its own paged KV cache. ``--ab packing`` (default): one with its projections packed
(worker/cpu_linear.py), one dense. ``--ab attention``: both packed, one attending through the C++
op (kernels/paged_attention_cpu.py), one through the torch reference (kernel backend switched per
call). They run the same batches, alternating every iteration, so a neighbour's load falls on
both; the figures are the thread's CPU time per forward pass (medians), and the greedy tokens of
the two must agree. Batches: a decode step of R sequences at context C, a chunk of 64 new tokens
over a cached context C beside R - 1 decodes, R - 1 cached prompts each recomputing its last block
beside one decode (a wave of clients sending their next prompts), and prefills of 64 and 512 tokens.

    .venv/bin/python scripts/bench_forward.py                 # one thread, R=8, C=320
    .venv/bin/python scripts/bench_forward.py --ab attention
    .venv/bin/python scripts/bench_forward.py --rows 32 --context 1024 --iters 40
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from kvpool.kernels import set_backend
from kvpool.kernels.cpu_build import load as load_cpu_op
from kvpool.worker.config import ModelConfig
from kvpool.worker.cpu_linear import pack_linears, packing_available
from kvpool.worker.model import build_model
from kvpool.worker.runner import allocate_runner
from kvpool.worker.step_plan import Batch, BatchSeq


def batches(rows: int, context: int, block: int, vocab: int) -> dict[str, Batch]:
    """Decode of ``rows`` sequences at ``context`` (distinct blocks each), a chunk beside decodes,
    a wave of cached prompts' last blocks, and two prefills."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-(context + 1) // block)

    def table(i: int, n: int) -> list[int]:
        return list(range(1 + i * n, 1 + (i + 1) * n))

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    decode = Batch(seqs=[BatchSeq(ids(1), context, table(i, per_seq), True) for i in range(rows)])
    out = {f"decode {rows}x{context}": decode}
    chunk = BatchSeq(ids(64), context, table(0, -(-(context + 64) // block)), True)
    out[f"64 over {context} + {rows - 1} dec"] = Batch(seqs=[chunk, *decode.seqs[1:]])
    # a wave of cached prompts: each recomputes its last block beside one decode
    tails = [BatchSeq(ids(block), context - block, table(i, per_seq), True) for i in range(1, rows)]
    out[f"{rows - 1}x{block} over {context - block} + 1 dec"] = Batch(seqs=[decode.seqs[0], *tails])
    for n in (64, 512):
        out[f"prefill {n}"] = Batch(seqs=[BatchSeq(ids(n), 0, table(0, -(-n // block)), True)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="decode sequences")
    ap.add_argument("--context", type=int, default=320, help="tokens each decode sequence attends to")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--ab", choices=("packing", "attention"), default="packing")
    args = ap.parse_args()
    if not packing_available():
        raise SystemExit("this torch build has no oneDNN packed linear ops")
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                      num_kv_heads=4, max_position=2048, eos_token_id=1, name="bench")
    dense = build_model(cfg, torch.float32, "cpu", seed=0)
    packed = copy.deepcopy(dense)
    pack_linears(packed)
    per_seq = -(-(args.context + 64) // args.block_size)
    num_blocks = 1 + max(args.rows * per_seq, 512 // args.block_size)
    if args.ab == "attention":
        if not load_cpu_op():
            raise SystemExit("the C++ CPU kernels did not build (see kvpool/kernels/cpu_build.py)")
        pack_linears(dense)  # both packed: only the attention path differs
        a, b, backends = "torch", "cpu", {"torch": "torch", "cpu": "cpu"}
    else:
        a, b, backends = "dense", "packed", {"dense": "auto", "packed": "auto"}
    runners = {a: allocate_runner(dense, num_blocks, args.block_size),
               b: allocate_runner(packed, num_blocks, args.block_size)}
    print(f"forward pass, thread CPU ms (median of {args.iters}), {args.threads} thread(s)")
    print(f"{'batch':<24} {a:>9} {b:>9} {f'{a}/{b}':>13}")
    for name, batch in batches(args.rows, args.context, args.block_size, cfg.vocab_size).items():
        times: dict[str, list[float]] = {k: [] for k in runners}
        for i in range(args.iters + 2):
            order = list(runners) if i % 2 else list(reversed(runners))
            tokens = {}
            for key in order:
                set_backend(backends[key])
                t = time.thread_time()
                logits = runners[key].execute(batch)
                if i >= 2:  # the first two warm up
                    times[key].append(time.thread_time() - t)
                tokens[key] = logits.argmax(-1).tolist()
            if tokens[a] != tokens[b]:
                raise SystemExit(f"{name}: greedy tokens differ between {a} and {b}")
        d, p = (statistics.median(times[k]) * 1e3 for k in (a, b))
        print(f"{name:<24} {d:9.2f} {p:9.2f} {d / p:12.2f}x")


if __name__ == "__main__":
    main()
