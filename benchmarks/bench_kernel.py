#!/usr/bin/env python
"""The chunked causal kernel alone, forward and backward, fp32, in each of ``--forms``, against its
matmul floor and the first form in alternating rounds (benchmarks/README.md).

Usage:  python benchmarks/bench_kernel.py --threads 1 [--shapes 1,8,4096,64] [--forms device parallel] [--map elu]
"""

import argparse
import functools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

CHUNK = 64


def kernel_step(kernel, shape, elu, device):
    """One forward and backward of ``kernel`` on fixed inputs of ``shape``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(*shape, generator=g) for _ in range(3))
    if elu:  # the features themselves, as the layer hands them over
        q, k = F.elu(q) + 1, F.elu(k) + 1
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    return lambda: kernel(q, k, v, chunk_size=CHUNK, exp_features=not elu).sum().backward()


def parse_shape(text):
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"a shape is four positive integers b,h,n,d, got {text!r}")
    return shape


def main(argv=None):
    p = common.arguments(__doc__, matmul_size=True)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(4, 4, 256, 64), (1, 8, 4096, 64)])
    p.add_argument("--map", choices=["softmax", "elu"], default="softmax")
    p.add_argument("--forms", nargs="+", choices=["device", "sequential", "parallel", "compiled"], default=["device"],
                   help="forms of this kernel, each timed against the first")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    args = p.parse_args(argv)
    from linear_attention_transformer.ops.causal.chunk import causal_linear_attention

    kernels = {f"form={form}": functools.partial(causal_linear_attention, form=None if form == "device" else form)
               for form in args.forms}
    common.start(args, f"causal_linear_attention(chunk_size={CHUNK}, map={args.map}), forward + backward, fp32")
    rate = common.square_matmul_rate(args.device, args.matmul_size)
    cases = []
    for shape in args.shapes:
        steps = {name: kernel_step(kernel, shape, args.map == "elu", args.device) for name, kernel in kernels.items()}
        times = common.in_turn({name: functools.partial(common.best_seconds, step, args.device, 3)
                                for name, step in steps.items()}, args.rounds, alternate=True)
        first = next(iter(times.values()))
        cases += [(",".join(map(str, shape)), name, common.step_flops(steps[name]), min(t),
                   statistics.median(a / b for a, b in zip(t, first))) for name, t in times.items()]
    rate = (rate + common.square_matmul_rate(args.device, args.matmul_size)) / 2
    rows, figures = [], {}
    for shape, name, flops, best, ratio in cases:
        figures[f"{name} {shape}"] = dict(ms=1e3 * best, floor_share=flops / rate / best, vs_first=ratio)
        rows.append([shape, name, f"{flops / 1e9:.2f}", f"{1e3 * best:.2f}", f"{flops / rate / best:.0%}",
                     f"{ratio:.3f}"])
    print(f"best of {args.rounds} alternating rounds; floor: FLOPs at {rate / 1e9:.1f} GFLOP/s (square matmul, fp32)")
    print(common.table(["b,h,n,d", "kernel", "GFLOP", "ms", "of floor", "vs first (median round)"], rows))
    return common.finish(args, figures)


if __name__ == "__main__":
    sys.exit(main())
