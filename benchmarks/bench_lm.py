#!/usr/bin/env python
"""Training-step benchmark of LinearAttentionTransformerLM, with a matmul reference.

One run measures, on the same machine and at the same time (the machine may be shared, so
absolute times drift from run to run and only same-run ratios are meaningful):

1. the fp32 matmul rate of the device: a square matmul, a model-shaped linear layer and the
   batched small (64 x 64) matmuls that the chunked attention kernel is made of;
2. forward + backward of the language model at each sequence length, every length in a
   fresh subprocess so that its peak memory is its own: seconds per step, tokens/s, the
   model's FLOP/s (counted analytically, see ``model_flops``) as a fraction of the square
   matmul rate, and the peak memory over the baseline taken after building the model.

Usage:  python benchmarks/bench_lm.py [--device cpu] [--lengths 4096 16384 65536] [--steps 5]
        python benchmarks/bench_lm.py --profile 4096     # torch.profiler table instead
See benchmarks/README.md for what each figure means and the targets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    GiB,
    PeakMemory,
    best_seconds,
    causal_kernel_flops,
    default_device,
    default_matmul_size,
    emit_result,
    kwargs_text,
    load_average,
    print_header as print_common_header,
    random_matrices,
    run_in_subprocess,
    set_threads,
    square_matmul_desc,
    square_matmul_rate,
    synchronize,
    table,
)

# the model under test: all heads global (exact causal linear attention), default feature map
MODEL = dict(num_tokens=256, dim=512, heads=8, dim_head=64, depth=2, causal=True,
             blindspot_size=1, n_local_attn_heads=0)


# --------------------------------------------------------------------- matmul reference


def matmul_rates(device, size, n_linear, dim=512, hidden=2048, chunk=64, heads=8, dim_head=64, reps=5):
    """fp32 FLOP/s of three matmul shapes, best of ``reps``. Returns {name: (desc, FLOP/s)}."""
    out = {"square": (square_matmul_desc(size), square_matmul_rate(device, size, reps))}

    # the shape of the feed-forward's first layer at the benchmark's first length
    x, w = random_matrices(device, (n_linear, dim), (hidden, dim))
    t = best_seconds(lambda: F.linear(x, w), device, reps)
    out["linear"] = (f"linear ({n_linear} x {dim}) @ ({dim} x {hidden})", 2 * n_linear * dim * hidden / t)
    del x, w

    # the attention kernel's small matmuls: (heads, C, d) x (heads, d, C) blocks, batched
    # over the n / C chunks of the first length (the intra-chunk q k^T shape)
    chunks = max(1, n_linear // chunk)
    q, k = random_matrices(device, (chunks, heads, chunk, dim_head), (chunks, heads, dim_head, chunk))
    t = best_seconds(lambda: q @ k, device, reps)
    out["batched"] = (
        f"batched ({chunks} x {heads} x {chunk} x {dim_head}) @ (.. x {dim_head} x {chunk})",
        2 * chunks * heads * chunk * dim_head * chunk / t,
    )
    return out


# -------------------------------------------------------------------------- FLOP count


def model_config(model):
    """The shapes the FLOP count needs, read from the built model (not assumed)."""
    from linear_attention_transformer.attention import Attention
    from linear_attention_transformer.feedforward import FeedForward

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    ffs = [m for m in model.modules() if isinstance(m, FeedForward)]
    a, ff = attns[0], ffs[0]
    return dict(
        dim=a.dim, heads=a.heads, dim_head=a.dim_head, kv_heads=a.kv_heads,
        depth=len(attns), chunk=a.chunk_size,
        ff_in=ff.proj_in.out_features, ff_hidden=ff.proj_out.in_features,
        vocab=model.to_logits.out_features,
    )


def model_flops(n, cfg):
    """Analytic FLOPs of one training step on one sequence of n tokens (batch 1).

    A multiply-add counts 2. Only matmuls are counted (norms, softmax/exp feature maps,
    GELU, masks, the chunk scan's additions are not), so the resulting FLOP/s is directly
    comparable with the matmul rate. Per layer, with D = dim, h = heads, d = e = dim_head,
    hd = h * d, F = feed-forward hidden width (4 D, no GLU by default), C = chunk size:

      projections   q: 2 n D hd    kv: 2 n D (2 hd)    out: 2 n hd D
      feed-forward  2 n D F_in + 2 n F D               (F_in = F, or 2 F with GLU)
      attention     per head, the chunked causal kernel (v carries an extra ones column,
                    the normaliser, hence e + 1):
                      intra-chunk q k^T        2 n C d
                      intra-chunk weights @ v  2 n C (e + 1)
                      inter-chunk q @ state    2 n d (e + 1)
                      chunk states k^T v       2 n d (e + 1)
                    The kernel forms the full C x C block of each chunk and masks its
                    upper triangle, so the full block is counted (half of it is wasted
                    work that the kernel really does). n is padded to a multiple of C.
    plus once: the logits projection 2 n D vocab.
    Training step = forward + backward = 3 x forward (backward = 2 x forward: gradients
    with respect to both the inputs and the weights of every matmul).
    Returns (total, {part: forward FLOPs}).
    """
    D, h, d = cfg["dim"], cfg["heads"], cfg["dim_head"]
    e, hd, C = d, cfg["heads"] * cfg["dim_head"], cfg["chunk"]
    kv_hd = 2 * cfg["kv_heads"] * d
    proj = 2 * n * D * hd + 2 * n * D * kv_hd + 2 * n * hd * D
    ff = 2 * n * D * cfg["ff_in"] + 2 * n * cfg["ff_hidden"] * D
    attn = causal_kernel_flops(h, n, d, e, C)
    L = cfg["depth"]
    parts = {
        "projections": L * proj,
        "feed-forward": L * ff,
        "attention": L * attn,
        "logits": 2 * n * D * cfg["vocab"],
    }
    return 3 * sum(parts.values()), parts


def dense_flops_from_modules(model, n):
    """Cross-check of the dense part of ``model_flops``: 2 n in out over every nn.Linear
    (each is applied once per token in this model)."""
    return sum(2 * n * m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


# ------------------------------------------------------------------------------ worker


def build_model(n, device, chunk_size):
    from linear_attention_transformer import LinearAttentionTransformerLM

    kwargs = dict(MODEL, max_seq_len=n)
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(**kwargs).to(device).train()


def train_step(model, x, y):
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    return loss


def worker(args):
    """Time forward + backward at one length; print one JSON line tagged RESULT_TAG."""
    set_threads(args.threads)
    device, n = args.device, args.worker_n
    model = build_model(n, device, args.chunk_size)
    cfg = model_config(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, MODEL["num_tokens"], (1, n), generator=g).to(device)
    y = torch.randint(0, MODEL["num_tokens"], (1, n), generator=g).to(device)

    # the square matmul rate just before and just after the timed steps: the reference the
    # model's rate is compared with, taken as close in time as possible (shared machine)
    size = args.matmul_size or default_matmul_size(device)
    square = lambda: square_matmul_rate(device, size)  # noqa: E731
    ref_before = square()

    mem = PeakMemory(device)  # baseline: model and inputs built, nothing run yet
    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(model, x, y)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = mem.increase()
    ref_after = square()

    flops, parts = model_flops(n, cfg)
    dense = parts["projections"] + parts["feed-forward"] + parts["logits"]
    result = dict(
        n=n, times=times, flops=flops, parts=parts, cfg=cfg, peak=peak, mem_method=mem.method,
        dense_check=dense_flops_from_modules(model, n) == dense, loss=float(loss),
        threads=torch.get_num_threads(), ref_before=ref_before, ref_after=ref_after,
    )
    emit_result(result)


def profile(args):
    """One forward + backward under torch.profiler, after a warmup step; top ops by self time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    set_threads(args.threads)
    device, n = args.device, args.profile
    model = build_model(n, device, args.chunk_size)
    x = torch.randint(0, MODEL["num_tokens"], (1, n), device=device)
    y = torch.randint(0, MODEL["num_tokens"], (1, n), device=device)
    print_header(args)
    for _ in range(args.warmup):
        train_step(model, x, y)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    t0 = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        train_step(model, x, y)
        synchronize(device)
    wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile: n={n}, one forward + backward, {wall:.2f} s under the profiler\n")
    print(prof.key_averages().table(sort_by=key, row_limit=args.profile_rows))


# ------------------------------------------------------------------------------ driver


def print_header(args):
    chunk = "model default" if args.chunk_size is None else args.chunk_size
    print_common_header(args.device, args.threads,
                        f"LinearAttentionTransformerLM({kwargs_text(MODEL)}, chunk_size={chunk}), batch 1, fp32")


def run_worker(args, n, steps):
    argv = ["--device", args.device, "--worker-n", n, "--steps", steps, "--warmup", args.warmup,
            "--matmul-size", args.matmul_size]
    if args.threads is not None:
        argv += ["--threads", args.threads]
    if args.chunk_size is not None:
        argv += ["--chunk-size", args.chunk_size]
    return run_in_subprocess(__file__, argv, f"n={n}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:1 ... (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536], help="sequence lengths")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per length (default: 5 up to n=8192, 3 above)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing (default: 1)")
    p.add_argument("--chunk-size", type=int, default=None, help="chunk_size passed to the model")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--matmul-size", type=int, default=None, help="square matmul size (default 2048 cpu, 8192 cuda)")
    p.add_argument("--profile", type=int, default=None, metavar="N",
                   help="instead of the benchmark: profile one forward + backward at length N")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker_n is not None:
        return worker(args)
    if args.profile is not None:
        return profile(args)

    set_threads(args.threads)
    print_header(args)
    size = args.matmul_size = args.matmul_size or default_matmul_size(args.device)
    ref_cfg = dict(dim=MODEL["dim"], hidden=4 * MODEL["dim"], chunk=args.chunk_size or 64,
                   heads=MODEL["heads"], dim_head=MODEL["dim_head"])
    t_start = time.perf_counter()

    # 1. matmul reference, before the model runs (and again after: the machine is shared)
    before = matmul_rates(args.device, size, min(args.lengths), **ref_cfg)

    # 2. the model, one fresh subprocess per length
    results, errors = [], []
    for n in args.lengths:
        steps = args.steps if args.steps is not None else (5 if n <= 8192 else 3)
        res, err = run_worker(args, n, steps)
        if err:
            errors.append(err)
        else:
            results.append(res)

    after = matmul_rates(args.device, size, min(args.lengths), **ref_cfg)

    print("matmul reference, fp32, best of 5, measured before and after all the model runs:")
    rows = [[desc, f"{before[k][1] / 1e9:.1f}", f"{after[k][1] / 1e9:.1f}"] for k, (desc, _) in before.items()]
    print(table(["shape", "GFLOP/s before", "GFLOP/s after"], rows))
    ref_square = max(before["square"][1], after["square"][1])
    ref_batched = max(before["batched"][1], after["batched"][1])
    print(f"(the kernel's batched 64 x 64 matmuls run at {100 * ref_batched / ref_square:.0f}% "
          f"of the square rate)\n")

    for err in errors:
        print(err, "\n")
    if not results:
        return 1

    # the model's rate is compared with the square matmul rate measured in the same worker
    # just before and just after its timed steps (the better of the two)
    for r in results:
        r["median"] = statistics.median(r["times"])
        r["rate"] = r["flops"] / r["median"]
        r["ref"] = max(r["ref_before"], r["ref_after"])

    print("forward + backward (cross-entropy on random targets), batch 1:")
    rows = []
    for r in results:
        rows.append([
            r["n"], f"{len(r['times'])}+{args.warmup}", f"{r['median']:.2f}", f"{min(r['times']):.2f}",
            f"{r['n'] / r['median']:.0f}", f"{r['flops'] / 1e9:.0f}", f"{r['rate'] / 1e9:.1f}",
            f"{r['ref_before'] / 1e9:.0f} / {r['ref_after'] / 1e9:.0f}",
            f"{100 * r['rate'] / r['ref']:.0f}%", f"{r['peak'] / GiB:.2f}",
        ])
    print(table(["n", "steps+warmup", "s/step median", "s/step min", "tok/s", "GFLOP/step",
                 "model GFLOP/s", "matmul GFLOP/s before/after", "% of matmul", "peak +GiB"], rows))
    print(f"(% of matmul: model GFLOP/s over the better of the square matmul rates measured in the same "
          f"subprocess just before and after the timed steps; peak memory: {results[0]['mem_method']}; "
          f"threads in the subprocesses: {results[0]['threads']})\n")

    print("FLOPs per training step (3 x forward; matmuls only, full C x C blocks, see model_flops):")
    rows = []
    for r in results:
        parts = r["parts"]
        total_fwd = sum(parts.values())
        rows.append([r["n"]] + [f"{3 * v / 1e9:.1f} ({100 * v / total_fwd:.0f}%)" for v in parts.values()])
    print(table(["n"] + [f"{k} GFLOP" for k in results[0]["parts"]], rows))
    cfg = results[0]["cfg"]
    print(f"(model shapes read from the model: {', '.join(f'{k}={v}' for k, v in cfg.items())}; "
          f"linear-layer count cross-check: {'ok' if all(r['dense_check'] for r in results) else 'MISMATCH'})")
    print()

    if len(results) > 1:
        lo, hi = min(results, key=lambda r: r["n"]), max(results, key=lambda r: r["n"])
        if lo["peak"] > 0:
            ratio, linear = hi["peak"] / lo["peak"], hi["n"] / lo["n"]
            verdict = "ok" if ratio <= 1.125 * linear else "ABOVE TARGET"
            print(f"peak memory ratio n={hi['n']} / n={lo['n']}: {ratio:.2f}x "
                  f"(linear in n would be {linear:.1f}x; target <= {1.125 * linear:.1f}x: {verdict})")
    for r in results:
        print(f"n={r['n']}: {r['median']:.2f} s/step, {r['n'] / r['median']:.0f} tok/s, "
              f"model {r['rate'] / 1e9:.1f} GFLOP/s = {100 * r['rate'] / r['ref']:.0f}% of matmul "
              f"({r['ref'] / 1e9:.1f} GFLOP/s), peak +{r['peak'] / GiB:.2f} GiB")
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
