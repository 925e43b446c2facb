#!/usr/bin/env python
"""Cost of the gated attention layer (sigmoid gates, local convolution) against the ungated one.

One attention layer, forward + backward, batch 1, fp32:

    ungated     LinearSelfAttention(dim=512, heads=8, dim_head=64, causal=True)
    gated       ... use_gate=True                        (forget gate + output gate)
    gated(head) ... use_gate=True, gate_granularity='head'  (one decay per head)
    gated+conv  ... use_gate=True, use_local_conv=True   (and the depthwise convolution)

Every (config, n) runs in a fresh subprocess, so that its peak memory is its own; the
subprocesses run one after the other, all in the same run (absolute times drift on a
shared machine, so only same-run ratios mean anything). Printed: seconds per forward +
backward (median of the timed steps after the warmup), the time ratio to the ungated layer
at the same n (target <= 1.5x), the peak memory over the baseline, the ratio
peak(longest n) / peak(shortest n) per config (linear in n: the ratio of the lengths), and
the square matmul rate of the same run as the drift reference.

Usage:  python benchmarks/bench_gate.py [--device cpu] [--lengths 4096 16384] [--threads 1]
        python benchmarks/bench_gate.py --profile 4096 [--profile-config gated]
See benchmarks/README.md for what each figure means and the targets.
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
    default_device,
    default_matmul_size,
    emit_result,
    kwargs_text,
    load_average,
    print_header,
    run_in_subprocess,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

LAYER = dict(dim=512, heads=8, dim_head=64, causal=True)
CONFIGS = {
    "ungated": {},
    "gated": dict(use_gate=True),
    "gated(head)": dict(use_gate=True, gate_granularity="head"),
    "gated+conv": dict(use_gate=True, use_local_conv=True),
}
BASELINE = "ungated"
TIME_TARGET = 1.5  # gated time / ungated time, at every n
TIME_TARGETS = {"gated(head)": 1.15}  # a scalar decay per head: nearly free


# ------------------------------------------------------------------------------ worker


def build(config, n, device):
    """The layer (seeded), an input that requires grad (as inside a model: the gradient
    flows on to the layers below) and a fixed output gradient."""
    from linear_attention_transformer.attention import LinearSelfAttention

    torch.manual_seed(0)
    layer = LinearSelfAttention(**LAYER, **CONFIGS[config]).to(device).train()
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, n, LAYER["dim"], generator=g).to(device).requires_grad_()
    grad_out = torch.randn(1, n, LAYER["dim"], generator=g).to(device)
    return layer, x, grad_out


def fwd_bwd(layer, x, grad_out):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer(x).backward(grad_out)


def worker(args):
    """Time forward + backward of one config at one length; print one tagged JSON line."""
    set_threads(args.threads)
    device, n, config = args.device, args.worker_n, args.worker_config
    layer, x, grad_out = build(config, n, device)
    params = sum(p.numel() for p in layer.parameters())

    # the square matmul rate just before and just after the timed steps (drift reference)
    ref_before = square_matmul_rate(device, args.matmul_size)
    mem = PeakMemory(device)  # baseline: layer, input and output gradient built, nothing run yet
    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        fwd_bwd(layer, x, grad_out)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = mem.increase()
    ref_after = square_matmul_rate(device, args.matmul_size)
    emit_result(dict(
        config=config, n=n, times=times, peak=peak, mem_method=mem.method, params=params,
        threads=torch.get_num_threads(), ref_before=ref_before, ref_after=ref_after,
    ))


def profile(args):
    """One forward + backward of one config under torch.profiler, after the warmup steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    set_threads(args.threads)
    device, n, config = args.device, args.profile, args.profile_config
    print_header(device, args.threads, layer_line(config))
    layer, x, grad_out = build(config, n, device)
    for _ in range(max(args.warmup, 1)):
        fwd_bwd(layer, x, grad_out)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    t0 = time.perf_counter()
    with torch_profile(activities=activities, record_shapes=args.profile_shapes) as prof:
        fwd_bwd(layer, x, grad_out)
        synchronize(device)
    wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile: {config}, n={n}, one forward + backward, {wall:.2f} s under the profiler\n")
    averages = prof.key_averages(group_by_input_shape=args.profile_shapes)
    print(averages.table(sort_by=key, row_limit=args.profile_rows))


# ------------------------------------------------------------------------------ driver


def layer_line(config):
    return f"LinearSelfAttention({kwargs_text({**LAYER, **CONFIGS[config]})}), batch 1, fp32"


def run_worker(args, config, n, steps):
    argv = ["--device", args.device, "--worker-n", n, "--worker-config", config, "--steps", steps,
            "--warmup", args.warmup, "--matmul-size", args.matmul_size]
    if args.threads is not None:
        argv += ["--threads", args.threads]
    return run_in_subprocess(__file__, argv, f"{config}, n={n}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:1 ... (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="sequence lengths")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="configs to run (default: all; the ratios need 'ungated')")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per config and length (default: 5 up to n=8192, 2 above)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--matmul-size", type=int, default=None, help="square matmul size (default 2048 cpu, 8192 cuda)")
    p.add_argument("--profile", type=int, default=None, metavar="N",
                   help="instead of the benchmark: profile one forward + backward at length N")
    p.add_argument("--profile-config", default="gated", choices=list(CONFIGS))
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--profile-shapes", action="store_true", help="group the profile by input shapes")
    p.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.matmul_size = args.matmul_size or default_matmul_size(args.device)

    if args.worker_n is not None:
        return worker(args)
    if args.profile is not None:
        return profile(args)

    set_threads(args.threads)
    print_header(args.device, args.threads, [layer_line(c) for c in args.configs])
    t_start = time.perf_counter()
    size = args.matmul_size
    ref_start = square_matmul_rate(args.device, size)

    # one fresh subprocess per (n, config), the configs of one n one after the other
    results, errors = {}, []
    for n in args.lengths:
        steps = args.steps if args.steps is not None else (5 if n <= 8192 else 2)
        for config in args.configs:
            res, err = run_worker(args, config, n, steps)
            if err:
                errors.append(err)
            else:
                res["median"] = statistics.median(res["times"])
                results[config, n] = res
    ref_end = square_matmul_rate(args.device, size)

    print(f"matmul reference (drift): {square_matmul_desc(size)}, fp32, best of 5: "
          f"{ref_start / 1e9:.1f} GFLOP/s at the start, {ref_end / 1e9:.1f} GFLOP/s at the end of the run "
          f"(and in each subprocess before / after its timed steps, in the table)\n")
    for err in errors:
        print(err, "\n")
    if not results:
        return 1

    print("one attention layer, forward + backward (output gradient fixed, input requires grad), batch 1:")
    rows = []
    for (config, n), r in results.items():
        base = results.get((BASELINE, n))
        ratio = f"{r['median'] / base['median']:.2f}x" if base else "-"
        rows.append([
            config, n, r["params"], f"{len(r['times'])}+{args.warmup}", f"{r['median']:.3f}",
            f"{min(r['times']):.3f}", f"{max(r['times']):.3f}", ratio, f"{r['peak'] / GiB:.3f}",
            f"{r['ref_before'] / 1e9:.0f} / {r['ref_after'] / 1e9:.0f}",
        ])
    print(table(["config", "n", "params", "steps+warmup", "s median", "s min", "s max", f"/ {BASELINE}",
                 "peak +GiB", "matmul GFLOP/s before/after"], rows))
    first = next(iter(results.values()))
    print(f"(s: seconds per forward + backward; / {BASELINE}: median over the {BASELINE} layer's median at "
          f"the same n; peak memory: {first['mem_method']}, over the baseline taken after building the layer "
          f"and its input; threads in the subprocesses: {first['threads']})\n")

    verdicts = []
    print(f"time ratio to {BASELINE} (target <= {TIME_TARGET}x, gated(head) <= {TIME_TARGETS['gated(head)']}x):")
    for config in args.configs:
        if config == BASELINE:
            continue
        for n in args.lengths:
            r, base = results.get((config, n)), results.get((BASELINE, n))
            if r and base:
                ratio = r["median"] / base["median"]
                ok = ratio <= TIME_TARGETS.get(config, TIME_TARGET)
                verdicts.append(ok)
                print(f"  {config:>11}  n={n:<6} {r['median']:.3f} s / {base['median']:.3f} s = {ratio:.2f}x  "
                      f"{'ok' if ok else 'ABOVE TARGET'}")
    print()

    lo, hi = min(args.lengths), max(args.lengths)
    if hi > lo:
        linear = hi / lo
        print(f"peak memory ratio n={hi} / n={lo} (linear in n: {linear:.1f}x; "
              f"target <= {1.125 * linear:.1f}x, as for the LM):")
        for config in args.configs:
            a, b = results.get((config, lo)), results.get((config, hi))
            if a and b and a["peak"] > 0:
                ratio = b["peak"] / a["peak"]
                ok = ratio <= 1.125 * linear
                verdicts.append(ok)
                print(f"  {config:>10}  {b['peak'] / GiB:.3f} GiB / {a['peak'] / GiB:.3f} GiB = {ratio:.2f}x  "
                      f"{'ok' if ok else 'ABOVE TARGET'}")
        print()
    missed = verdicts.count(False)
    print(f"targets: {'all met' if not missed else f'{missed} of {len(verdicts)} missed'}")
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
