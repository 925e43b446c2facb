#!/usr/bin/env python
"""The chunked causal kernel alone, forward and backward, against its matmul floor, in each of
its forms.

    causal_linear_attention(q, k, v, chunk_size=64, exp_features=..., form=...)

fp32, for each ``--shapes`` b,h,n,d, with exponential features (the default 'softmax' map;
logits ~ N(0, 0.25)) or elu features (``--map elu``): the step's matmul FLOPs, counted as they
run, at the mean of the square matmul rates before and after are its floor. Each of ``--forms``
(ops/causal/forms.py; 'device': the one the device takes) is timed against the first in alternating rounds (each in the other
order, so that a drifting machine hits all alike); the median of the rounds' ratios is the figure.

Usage:  python benchmarks/bench_kernel.py --threads 1 [--shapes 4,4,256,64 1,8,4096,64] [--map elu]
        python benchmarks/bench_kernel.py --threads 1 --forms device parallel compiled
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


def time_kernels(steps, device, rounds):
    """Best seconds of each step over ``rounds`` alternating rounds (each round in the other
    order), and the median over rounds of each step's time over the first one's."""
    best, ratios = {name: float("inf") for name in steps}, {name: [] for name in steps}
    for i in range(rounds):
        order = list(steps.items())[:: 1 if i % 2 == 0 else -1]
        times = {name: common.best_seconds(step, device, reps=3) for name, step in order}
        first = times[next(iter(steps))]
        for name, t in times.items():
            best[name] = min(best[name], t)
            ratios[name].append(t / first)
    return best, {name: statistics.median(r) for name, r in ratios.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=common.default_device())
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(4, 4, 256, 64), (1, 8, 4096, 64)])
    p.add_argument("--map", choices=["softmax", "elu"], default="softmax")
    p.add_argument("--forms", nargs="+", choices=["device", "sequential", "parallel", "compiled"], default=["device"],
                   help="forms of this kernel, each timed against the first")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--matmul-size", type=int, default=None)
    p.add_argument("--record", metavar="NAME", default=None, help="write the figures to results/NAME.json")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    from linear_attention_transformer.ops.causal.chunk import causal_linear_attention

    kernels = {f"form={form}": functools.partial(causal_linear_attention, form=None if form == "device" else form)
               for form in args.forms}
    common.print_header(args.device, args.threads, f"causal_linear_attention(chunk_size={CHUNK}, map={args.map}), "
                        "forward + backward, fp32")
    rate = common.square_matmul_rate(args.device, args.matmul_size)
    rows, figures = [], {}
    for shape in args.shapes:
        steps = {name: kernel_step(kernel, shape, args.map == "elu", args.device) for name, kernel in kernels.items()}
        best, ratio = time_kernels(steps, args.device, args.rounds)
        rows += [(shape, name, common.step_flops(steps[name]), best[name], ratio[name]) for name in steps]
    rate = (rate + common.square_matmul_rate(args.device, args.matmul_size)) / 2
    table = []
    for shape, name, flops, best, ratio in rows:
        shape_text, floor_share = ",".join(map(str, shape)), flops / rate / best
        figures[f"{name} {shape_text}"] = dict(ms=1e3 * best, floor_share=floor_share, vs_first=ratio)
        table.append([shape_text, name, f"{flops / 1e9:.2f}", f"{1e3 * best:.2f}", f"{floor_share:.0%}", f"{ratio:.3f}"])
    print(f"best of {args.rounds} alternating rounds; floor: FLOPs at {rate / 1e9:.1f} GFLOP/s (square matmul, fp32)")
    print(common.table(["b,h,n,d", "kernel", "GFLOP", "ms", "of floor", "vs first (median round)"], table))
    if args.record:
        print("recorded in", common.record(args.record, args.device, figures))
    print(f"({common.load_average()} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
