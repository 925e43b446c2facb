#!/usr/bin/env python
"""What gradient checkpointing costs and saves: one LM training step (forward + backward) with
``checkpoint=False``, ``checkpoint=True`` and ``reversible=True``, each in a fresh subprocess so
that its peak memory is its own, beside the square fp32 matmul rate measured in the same
worker and the floor (the step's analytic matmul FLOPs, ``bench_lm.model_flops``, at that rate).

Usage:  python benchmarks/bench_checkpoint.py [--device cpu] [--length 4096] [--depth 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lm import MODEL, model_config, model_flops, train_step  # noqa: E402
from common import (  # noqa: E402
    GiB,
    PeakMemory,
    default_device,
    default_matmul_size,
    emit_result,
    kwargs_text,
    print_header,
    run_in_subprocess,
    set_threads,
    square_matmul_rate,
    synchronize,
    table,
)

VARIANTS = {"plain": {}, "checkpoint=True": dict(checkpoint=True), "reversible=True": dict(reversible=True)}


def worker(args):
    from linear_attention_transformer import LinearAttentionTransformerLM

    set_threads(args.threads)
    device, n = args.device, args.length
    torch.manual_seed(0)
    kwargs = dict(MODEL, depth=args.depth, max_seq_len=n, **VARIANTS[args.worker])
    model = LinearAttentionTransformerLM(**kwargs).to(device).train()
    g = torch.Generator(device="cpu").manual_seed(1)
    x, y = (torch.randint(0, MODEL["num_tokens"], (1, n), generator=g).to(device) for _ in range(2))
    size = args.matmul_size or default_matmul_size(device)
    rate = square_matmul_rate(device, size)
    mem = PeakMemory(device)
    times = []
    for i in range(1 + args.steps):  # one untimed warm-up step
        synchronize(device)
        t0 = time.perf_counter()
        train_step(model, x, y)
        synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    peak = mem.increase()
    rate = max(rate, square_matmul_rate(device, size))
    emit_result(dict(best=min(times), peak=peak, method=mem.method, rate=rate,
                     flops=model_flops(n, model_config(model))[0]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device())
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--matmul-size", type=int, default=None)
    p.add_argument("--worker", choices=list(VARIANTS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(args)

    print_header(args.device, args.threads, f"LinearAttentionTransformerLM({kwargs_text(dict(MODEL, depth=args.depth))}), "
                 f"n={args.length}, batch 1, fp32, best of {args.steps} steps")
    rows = []
    for name in VARIANTS:
        argv = ["--device", args.device, "--length", args.length, "--depth", args.depth, "--steps", args.steps,
                "--worker", name]
        if args.threads is not None:
            argv += ["--threads", args.threads]
        if args.matmul_size is not None:
            argv += ["--matmul-size", args.matmul_size]
        res, err = run_in_subprocess(__file__, argv, name)
        if err:
            print(err)
            continue
        floor = res["flops"] / res["rate"]
        rows.append([name, f"{res['best']:.3f}", f"{floor:.3f}", f"{res['best'] / floor:.1f}",
                     f"{res['rate'] / 1e9:.1f}", f"{res['peak'] / GiB:.3f}"])
    print(table(["variant", "s/step", "floor s", "x floor", "matmul GFLOP/s", "peak GiB over baseline"], rows))
    print(f"peak memory: {res['method'] if rows else '-'}")


if __name__ == "__main__":
    main()
