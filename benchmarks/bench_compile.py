#!/usr/bin/env python
"""A training step of the LM compiled with ``torch.compile`` against the same step in eager mode.

The step: logits of a batch, cross-entropy to the next token, backward, SGD update. Both
modes train their own copy of the same model on the same batches. Printed per config and
length: the first compiled step (compilation included) and how many graphs the backend
compiled during it, the compile time (that first step less the compiled median), seconds per
step (median of the timed steps after the warmup) in eager and compiled mode and their ratio
(the steady-state speed-up), the floor (6 x matmul parameters x tokens, the training FLOPs of
the projections, at the matmul rate) and the square matmul rate of the same run as the drift
reference.

With several ``--lengths`` each length gets its own compiled model (``torch.compile`` with
static shapes: the compile time per length shows whether it grows with n), or with
``--dynamic`` one model compiled with ``dynamic=True`` serves every length: graphs compiled at
a later length are recompiles. Eager and compiled steps alternate (``--steps`` pairs).

Usage:  python benchmarks/bench_compile.py [--configs plain gate+conv noncausal] [--threads 2]
        [--lengths 512 4096] [--dynamic] [--batch 4] [--steps 10] [--backend inductor]
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
    "noncausal": dict(causal=False),  # the LM's own default
    "local": dict(n_local_attn_heads=2, local_attn_window_size=64),
    "gate+conv": dict(use_gate=True, use_local_conv=True),
    "reversible": dict(reversible=True),
}


HEADERS = ["config", "n", "first compiled step s", "compile s", "graphs compiled", "eager ms/step",
           "compiled ms/step", "speed-up", "floor ms"]


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


def timed_once(step, tokens, device):
    synchronize(device)
    t0 = time.perf_counter()
    step(tokens)
    synchronize(device)
    return time.perf_counter() - t0


def counting_backend(name):
    """The backend ``name``, counting the graphs it is given (``calls[0]``)."""
    calls = [0]

    def backend(gm, example_inputs):
        calls[0] += 1
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    return backend, calls


def matmul_params(model):
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["plain"], choices=list(CONFIGS))
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lengths", "--length", type=int, nargs="+", default=[512])
    parser.add_argument("--dynamic", action="store_true",
                        help="one model compiled with dynamic=True for every length (default: one per length)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed eager / compiled pairs after 2 warmup pairs")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    set_threads(args.threads)
    device = args.device
    max_len = max(args.lengths)
    how = "dynamic=True, one model" if args.dynamic else "static shapes, one model per length"
    print_header(device, args.threads, [kwargs_text(MODEL) + f", max_seq_len={max_len}",
                                        f"batch {args.batch} x {' / '.join(map(str, args.lengths))} tokens, fp32, "
                                        f"backend {args.backend}, {how}"])
    rate = square_matmul_rate(device)
    print(f"matmul:  {rate / 1e9:.1f} GFLOP/s ({square_matmul_desc(default_matmul_size(device))})\n")

    g = torch.Generator().manual_seed(0)
    rows = []
    for name in args.configs:
        torch.manual_seed(0)
        base = LinearAttentionTransformerLM(max_seq_len=max_len, **{**MODEL, **CONFIGS[name]}).to(device)
        compiled = backend = calls = None
        for length in args.lengths:
            batches = [torch.randint(0, MODEL["num_tokens"], (args.batch, length + 1), generator=g).to(device)
                       for _ in range(args.steps + 2)]
            eager = copy.deepcopy(base)
            if compiled is None or not args.dynamic:
                torch._dynamo.reset()
                backend, calls = counting_backend(args.backend)
                compiled = torch.compile(copy.deepcopy(base), backend=backend, dynamic=True if args.dynamic else None)
            eager_step, compiled_step = step_fn(eager), step_fn(compiled)
            before = calls[0]
            first = timed_once(compiled_step, batches[0], device)
            graphs = calls[0] - before
            timed_once(eager_step, batches[0], device)
            eager_times, compiled_times = [], []
            for i, tokens in enumerate(batches[1:]):  # alternating, the first pair a warmup
                e, c = timed_once(eager_step, tokens, device), timed_once(compiled_step, tokens, device)
                if i:
                    eager_times.append(e)
                    compiled_times.append(c)
            e, c = statistics.median(eager_times), statistics.median(compiled_times)
            floor = 6 * matmul_params(eager) * args.batch * length / rate
            rows.append([name, length, f"{first:.1f}", f"{first - c:.1f}", graphs, f"{e * 1e3:.1f}",
                         f"{c * 1e3:.1f}", f"{e / c:.2f}x", f"{floor * 1e3:.1f}"])
            print(table(HEADERS, rows[-1:]), flush=True)
    print()
    print(table(HEADERS, rows))
    print(f"matmul at the end: {square_matmul_rate(device) / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
