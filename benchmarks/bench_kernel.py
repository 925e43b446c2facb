#!/usr/bin/env python
"""The chunked causal kernel alone, against its matmul floor and, optionally, an earlier kernel.

    causal_linear_attention(q, k, v, chunk_size=64, exp_features=...)   (ops/causal/chunk.py)

forward + backward (q, k, v require grad; the output's sum is the loss), fp32, for each
``--shapes`` (b, h, n, d), with exponential features from logits (the default 'softmax' map:
``exp_features=True``, logits ~ N(0, 0.25): ordinary logits, nothing underflows) or with elu
features (``--map elu``).

``--against FILE`` loads another version of ``ops/causal/chunk.py`` (for instance
``git show REV:linear_attention_transformer/ops/causal/chunk.py > /tmp/kernel_rev.py``;
its relative imports resolve in the installed package) and times both in the same process, alternating
rounds (each round in the other order) so that a drifting machine hits both alike; the ratio
this / against of the best times, and the median over rounds of each round's own ratio (robust
on a shared, busy machine: use many rounds), are the figures to read.

The floor is the kernel's matmul FLOPs (``common.causal_kernel_flops``, x3 for forward +
backward) at the square matmul rate measured before and after.

``--form`` sets this kernel's ``CHUNK_FORM`` (the loop over chunks or the log-depth scan;
'auto' is what the device gets).

Usage:  python benchmarks/bench_kernel.py [--shapes 4,4,256,64 1,8,4096,64] [--map elu] [--form parallel]
        python benchmarks/bench_kernel.py --threads 1 --against /tmp/kernel_rev.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    causal_kernel_flops,
    default_device,
    default_matmul_size,
    load_average,
    print_header,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

CHUNK = 64


def load_kernel(path):
    """The module in ``path`` (a file like ops/causal/chunk.py)."""
    # named inside the package, so that its relative imports (.scan, ..common) resolve there
    spec = importlib.util.spec_from_file_location("linear_attention_transformer.ops.causal._kernel_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "causal_linear_attention", None)):
        raise SystemExit(f"--against {path}: no causal_linear_attention in it")
    return module


def inputs(shape, elu, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (0.5 * torch.randn(*shape, generator=g) for _ in range(3))
    if elu:  # the features themselves (elu + 1), as the layer hands them over
        q, k = (torch.nn.functional.elu(t) + 1 for t in (q, k))
    return [t.to(device) for t in (q, k, v)]


def step_seconds(kernel, tensors, elu, device, reps):
    """Best seconds of forward + backward over ``reps`` calls."""
    best = float("inf")
    for _ in range(reps):
        q, k, v = (t.detach().requires_grad_() for t in tensors)
        synchronize(device)
        t0 = time.perf_counter()
        kernel(q, k, v, chunk_size=CHUNK, exp_features=not elu).sum().backward()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device())
    p.add_argument("--shapes", nargs="+", default=["4,4,256,64", "1,8,4096,64"], help="b,h,n,d each")
    p.add_argument("--map", choices=["softmax", "elu"], default="softmax")
    p.add_argument("--against", default=None, help="another ops/causal/chunk.py to time beside this one")
    p.add_argument("--form", choices=["auto", "sequential", "parallel"], default="auto",
                   help="this kernel's CHUNK_FORM (auto: the device's own; default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per round (default: by size)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--matmul-size", type=int, default=None)
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    except ValueError:
        p.error("--shapes: each must be b,h,n,d integers")
    if any(len(s) != 4 or min(s) < 1 for s in shapes):
        p.error("--shapes: each must be four positive integers b,h,n,d")
    size = args.matmul_size or default_matmul_size(args.device)
    set_threads(args.threads)
    this = importlib.import_module("linear_attention_transformer.ops.causal.chunk")
    importlib.import_module("linear_attention_transformer.ops.causal.forms").CHUNK_FORM = args.form
    kernels = {"this": this.causal_linear_attention}
    if args.against:
        kernels["against"] = load_kernel(args.against).causal_linear_attention
    print_header(args.device, args.threads, [
        f"causal_linear_attention(q, k, v, chunk_size={CHUNK}, exp_features={args.map == 'softmax'}), "
        f"forward + backward, fp32; this kernel's form: {args.form}" + (f"; against {args.against}" if args.against else "")])
    t_start = time.perf_counter()
    rate_before = square_matmul_rate(args.device, size)
    elu = args.map == "elu"
    rows = []
    for shape in shapes:
        b, h, n, d = shape
        tensors = inputs(shape, elu, args.device)
        reps = args.reps or max(2, min(20, int(2 ** 22 // (b * h * n * d) * 5)))
        for kernel in kernels.values():  # warm
            step_seconds(kernel, tensors, elu, args.device, 1)
        best = {name: float("inf") for name in kernels}
        ratios = []  # this / against within each round: neighbours in time share the machine's state
        for i in range(args.rounds):
            order = list(kernels.items()) if i % 2 == 0 else list(kernels.items())[::-1]
            times = {}
            for name, kernel in order:
                times[name] = step_seconds(kernel, tensors, elu, args.device, reps)
                best[name] = min(best[name], times[name])
            if args.against:
                ratios.append(times["this"] / times["against"])
        flops = 3 * b * causal_kernel_flops(h, n, d, d, CHUNK)
        rows.append((shape, flops, best, sorted(ratios)))
    rate_after = square_matmul_rate(args.device, size)
    rate = (rate_before + rate_after) / 2

    headers = ["b, h, n, d", "GFLOP", "floor ms", "this ms", "floor / this"]
    if args.against:
        headers += ["against ms", "this / against", "median round ratio"]
    out = []
    for shape, flops, best, ratios in rows:
        floor = flops / rate
        row = [", ".join(map(str, shape)), f"{flops / 1e9:.2f}", f"{1e3 * floor:.2f}", f"{1e3 * best['this']:.2f}",
               f"{100 * floor / best['this']:.0f} %"]
        if args.against:
            median = ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1:][:2]) / 2
            row += [f"{1e3 * best['against']:.2f}", f"{best['this'] / best['against']:.3f}", f"{median:.3f}"]
        out.append(row)
    print(f"best of {args.rounds} alternating rounds; matmul reference {square_matmul_desc(size)}, fp32: "
          f"{rate_before / 1e9:.1f} GFLOP/s before, {rate_after / 1e9:.1f} after")
    print(table(headers, out))
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
