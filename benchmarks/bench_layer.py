#!/usr/bin/env python
"""One causal linear attention layer against its matmul floor.

    LinearSelfAttention(dim=512, heads=8, dim_head=64, causal=True, feature_map=...)

forward + backward, batch 1, fp32, for the 'elu' map and the default 'softmax' map (exponential
features, computed stably from logits). The layer is four projections (q, k, v, out) around the
chunked causal kernel, so its floor is its matmul FLOPs at the machine's matmul rate:

    floor = FLOPs / (square matmul rate measured in the same subprocess, before and after)

and the figure to read is floor / time, the fraction of the limit reached (100 % = the layer
runs as fast as its matmuls could if all ran at the square rate).

The pseudo-map 'projections' runs the same layer's four projections with no attention between
them (out = to_out(q + k + v)): its floor / time is what these tall, thin matmuls reach on
their own, the ceiling for the layer in practice; the summary prints each map's figure as a
fraction of it. FLOPs, a multiply-add counting 2, D = dim, hd =
heads * dim_head, C = chunk, e = d = dim_head, n padded to a multiple of C:

    projections     q, k, v, out: 4 * 2 n D hd
    kernel, a head  intra-chunk q k^T 2 n C d, weights @ v 2 n C (e + 1), q @ state
                    2 n d (e + 1), chunk states k^T v 2 n d (e + 1)   (see bench_lm.py)
    training step   3 x forward (backward: gradients of inputs and of weights)

Every (map, n) runs in a fresh subprocess, one after the other, so that its peak memory is its
own. On a shared machine absolute times drift; the fraction of the floor is taken against the
matmul rate of the same subprocess.

Besides, every matmul of one step is replayed alone on fresh operands of its own shapes and
strides (``common.matmul_replay``): "matmuls alone" is their summed time, the step with nothing
between its matmuls, and "alone / time" the share of the step spent in them (a ratio inside one
subprocess, steadier than floor / time when the matmul rate drifts).

Usage:  python benchmarks/bench_layer.py [--lengths 4096 16384 65536] [--maps elu softmax]
        python benchmarks/bench_layer.py --threads 2 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    GiB,
    PeakMemory,
    causal_kernel_flops,
    default_device,
    default_matmul_size,
    emit_result,
    kwargs_text,
    load_average,
    matmul_replay,
    print_header,
    run_in_subprocess,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

LAYER = dict(dim=512, heads=8, dim_head=64, causal=True)
TARGET = 0.85  # floor / time
PROJECTIONS = "projections"  # the pseudo-map: the projections alone


def projection_flops(n, dim, heads, dim_head):
    """Matmul FLOPs of one forward + backward of the four projections on n tokens."""
    return 3 * 4 * 2 * n * dim * heads * dim_head


def layer_flops(n, dim, heads, dim_head, chunk):
    """Matmul FLOPs of one forward + backward of the layer on n tokens (see the module doc)."""
    return projection_flops(n, dim, heads, dim_head) + 3 * causal_kernel_flops(heads, n, dim_head, dim_head, chunk)


class ProjectionsOnly(torch.nn.Module):
    """The layer's q, k, v and out projections with no attention between them."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        q = self.layer.to_q(x)
        k, v = self.layer.to_kv(x).chunk(2, dim=-1)
        return self.layer.to_out(q + k + v)


def build(feature_map, n, device):
    from linear_attention_transformer import LinearSelfAttention

    torch.manual_seed(0)
    if feature_map == PROJECTIONS:
        layer = ProjectionsOnly(LinearSelfAttention(**LAYER).to(device).train())
    else:
        layer = LinearSelfAttention(**LAYER, feature_map=feature_map).to(device).train()
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, n, LAYER["dim"], generator=g).to(device).requires_grad_()
    grad_out = torch.randn(1, n, LAYER["dim"], generator=g).to(device)
    return layer, x, grad_out


def worker(args):
    set_threads(args.threads)
    device, n, feature_map = args.device, args.worker_n, args.worker_map
    layer, x, grad_out = build(feature_map, n, device)
    ref_before = square_matmul_rate(device, args.matmul_size)
    mem = PeakMemory(device)
    times = []
    for i in range(args.warmup + args.steps):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        synchronize(device)
        t0 = time.perf_counter()
        layer(x).backward(grad_out)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = mem.increase()
    ref_after = square_matmul_rate(device, args.matmul_size)
    replay, replay_flops, _ = matmul_replay(lambda: layer(x).backward(grad_out), device)
    shape = (n, LAYER["dim"], LAYER["heads"], LAYER["dim_head"])
    flops = projection_flops(*shape) if feature_map == PROJECTIONS else layer_flops(*shape, layer.chunk_size)
    emit_result(dict(map=feature_map, n=n, times=times, flops=flops, peak=peak, mem_method=mem.method,
                     threads=torch.get_num_threads(), ref_before=ref_before, ref_after=ref_after,
                     replay=replay, replay_flops=replay_flops))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu, cuda, ... (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--maps", nargs="+", default=[PROJECTIONS, "elu", "softmax"],
                   choices=[PROJECTIONS, "elu", "relu", "softmax"])
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 5 up to n=16384, 2 above)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--matmul-size", type=int, default=None)
    p.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-map", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.matmul_size = args.matmul_size or default_matmul_size(args.device)
    if args.worker_n is not None:
        return worker(args)

    set_threads(args.threads)
    print_header(args.device, args.threads,
                 [f"LinearSelfAttention({kwargs_text(LAYER)}, feature_map={m!r}), batch 1, fp32" for m in args.maps])
    t_start = time.perf_counter()
    rows, errors, verdicts, fractions = [], [], [], {}
    for n in args.lengths:
        steps = args.steps if args.steps is not None else (5 if n <= 16384 else 2)
        for feature_map in args.maps:
            argv = ["--device", args.device, "--worker-n", n, "--worker-map", feature_map, "--steps", steps,
                    "--warmup", args.warmup, "--matmul-size", args.matmul_size]
            if args.threads is not None:
                argv += ["--threads", args.threads]
            r, err = run_in_subprocess(__file__, argv, f"{feature_map}, n={n}")
            if err:
                errors.append(err)
                continue
            t = statistics.median(r["times"])
            rate = (r["ref_before"] + r["ref_after"]) / 2
            floor = r["flops"] / rate
            fractions[feature_map, n] = floor / t
            if feature_map != PROJECTIONS:
                verdicts.append(floor / t >= TARGET)
            rows.append([feature_map, n, f"{len(r['times'])}+{args.warmup}", f"{t:.3f}", f"{r['flops'] / 1e9:.1f}",
                         f"{r['ref_before'] / 1e9:.0f} / {r['ref_after'] / 1e9:.0f}", f"{floor:.3f}",
                         f"{100 * floor / t:.0f} %", f"{r['replay']:.3f}", f"{100 * r['replay'] / t:.0f} %",
                         f"{r['replay_flops'] / 1e9:.1f}", f"{r['peak'] / GiB:.3f}"])
    for err in errors:
        print(err, "\n")
    if rows:
        print(f"one layer, forward + backward (input requires grad, fixed output gradient), batch 1; "
              f"matmul reference: {square_matmul_desc(args.matmul_size)}, fp32, best of 5:")
        print(table(["map", "n", "steps+warmup", "s median", "GFLOP", "matmul GFLOP/s before/after",
                     "floor s", "floor / time", "matmuls alone s", "alone / time", "their GFLOP",
                     "peak +GiB"], rows))
        print(f"(floor: the layer's matmul FLOPs at the mean of the two matmul rates of its subprocess; "
              f"target floor / time >= {100 * TARGET:.0f} %)")
        print("(matmuls alone: every mm / addmm / bmm / baddbmm of one step replayed on fresh operands of its "
              "own shapes and strides, best of 3 each, summed; their GFLOP as run, masked halves of the "
              "kernel's blocks and padding included)")
        ceiling = [f"{m} n={n}: {100 * f / fractions[PROJECTIONS, n]:.0f} %" for (m, n), f in fractions.items()
                   if m != PROJECTIONS and (PROJECTIONS, n) in fractions]
        if ceiling:
            print("each map's floor / time as a fraction of the projections' own: " + ", ".join(ceiling))
        print(f"targets: {verdicts.count(True)} of {len(verdicts)} met")
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
