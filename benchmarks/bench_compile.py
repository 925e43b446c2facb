#!/usr/bin/env python
"""A training step of the LM compiled with ``torch.compile`` against the same step in eager mode.

The step: logits of a batch, cross-entropy to the next token, backward, SGD update. Both
modes train their own copy of the same model on the same batches. Printed per config: the
first compiled step (compilation included), seconds per step (median of the timed steps after
the warmup) in eager and compiled mode and their ratio, the floor (6 x matmul parameters x
tokens, the training FLOPs of the projections, at the matmul rate) and the square matmul rate
of the same run as the drift reference.

Usage:  python benchmarks/bench_compile.py [--configs plain gate+conv] [--threads 2]
        [--length 512] [--batch 4] [--steps 10] [--backend inductor]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    default_device,
    default_matmul_size,
    kwargs_text,
    print_header,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

from linear_attention_transformer import LinearAttentionTransformerLM  # noqa: E402

MODEL = dict(num_tokens=256, dim=256, depth=4, heads=4, causal=True)
CONFIGS = {
    "plain": {},
    "local": dict(n_local_attn_heads=2, local_attn_window_size=64),
    "gate+conv": dict(use_gate=True, use_local_conv=True),
    "reversible": dict(reversible=True),
}


def step_fn(model, lr=1e-3):
    def step(tokens):
        loss = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
                p.grad = None
        return loss

    return step


def timed(step, batches, device):
    times = []
    for tokens in batches:
        synchronize(device)
        t0 = time.perf_counter()
        step(tokens)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def matmul_params(model):
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["plain"], choices=list(CONFIGS))
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after 2 warmup steps")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    set_threads(args.threads)
    device = args.device
    print_header(device, args.threads, [kwargs_text(MODEL) + f", max_seq_len={args.length}",
                                        f"batch {args.batch} x {args.length} tokens, fp32, backend {args.backend}"])
    rate = square_matmul_rate(device)
    print(f"matmul:  {rate / 1e9:.1f} GFLOP/s ({square_matmul_desc(default_matmul_size(device))})\n")

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, MODEL["num_tokens"], (args.batch, args.length + 1), generator=g).to(device)
               for _ in range(args.steps + 2)]
    rows = []
    for name in args.configs:
        torch.manual_seed(0)
        eager = LinearAttentionTransformerLM(max_seq_len=args.length, **MODEL, **CONFIGS[name]).to(device)
        compiled_model = copy.deepcopy(eager)
        compiled = torch.compile(compiled_model, backend=args.backend)
        eager_times = timed(step_fn(eager), batches, device)[2:]
        compiled_times = timed(step_fn(compiled), batches, device)
        first, compiled_times = compiled_times[0], compiled_times[2:]
        e, c = statistics.median(eager_times), statistics.median(compiled_times)
        floor = 6 * matmul_params(eager) * args.batch * args.length / rate
        rows.append([name, f"{first:.1f}", f"{e * 1e3:.1f}", f"{c * 1e3:.1f}", f"{e / c:.2f}x", f"{floor * 1e3:.1f}"])
    print(table(["config", "first compiled step s", "eager ms/step", "compiled ms/step", "speed-up", "floor ms"], rows))


if __name__ == "__main__":
    main()
