#!/usr/bin/env python
"""Upstream linear-attention-transformer's README LM, one training step, against its floor and upstream.

The model is the one of that README (``SEED_LM`` below: 20000 tokens, dim 512, emb_dim 128,
8 heads of 128 of which 4 local (window 128), blindspot 64, reversible, GLU feed-forward in 2
chunks, token shift, all dropouts 0.1, depth 1), in training mode, fp32, batch 1, n = 8192. Two
steps are measured, each in a fresh subprocess so that its peak memory is its own:

- ``plain``: ``F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))`` and backward: the
  (n, V) logits exist;
- ``wrapper``: ``AutoregressiveWrapper(model)(x)`` (x one token longer) and backward: the loss
  is taken chunk by chunk from the model's output features (``linear_cross_entropy``).

For each: seconds per step (median), tokens/s, the matmul floor and the fraction of it reached,
and the peak memory over a baseline taken after building the model. With ``--upstream-python``
(an interpreter that imports ``linear-attention-transformer==0.19.1``, e.g. a scratch venv) the
same two steps run on upstream's model and wrapper, built with the same arguments, and the
ratios are printed. Upstream does less work with these arguments: its main layers build
``FeedForward(dim)`` and so ignore ``ff_glu`` and ``ff_dropout`` (0.19.1,
linear_attention_transformer.py line 388; only axial and context layers receive them). So a
third row, ``ours, upstream's work``, times our model built as upstream runs it
(``UPSTREAM_RUNS``: no GLU, no feed-forward dropout): equal work, the fair speed comparison.

The floor: the step's matmul FLOPs at the square fp32 matmul rate measured in the same subprocess
just before and after the timed steps (the better of the two). The FLOPs are those of the
step's own matmuls, recorded as they run (``common.matmul_replay``), so each implementation is
read against its own work; for ours they are also counted by hand (``training_flops``) and the
two counts are printed side by side. "matmuls alone" is those matmuls replayed at their own
shapes with nothing between them.

Usage:  python benchmarks/bench_seed_lm.py [--steps 3] [--threads 2]
        python benchmarks/bench_seed_lm.py --upstream-python /tmp/upstream/bin/python
        python benchmarks/bench_seed_lm.py --profile plain     # torch.profiler table instead
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEED_LM = dict(
    num_tokens=20000, dim=512, heads=8, depth=1, max_seq_len=8192, causal=True, ff_dropout=0.1,
    attn_layer_dropout=0.1, attn_dropout=0.1, emb_dim=128, dim_head=128, blindspot_size=64,
    n_local_attn_heads=4, local_attn_window_size=128, reversible=True, ff_chunks=2, ff_glu=True,
    attend_axially=False, shift_tokens=True,
)
CASES = ("plain", "wrapper")
# what upstream 0.19.1 runs for SEED_LM: its main layers' FeedForward(dim) drops both options
UPSTREAM_RUNS = dict(ff_glu=False, ff_dropout=0.0)
IMPL_LABELS = {"ours": "ours", "ours_upstream_work": "ours, upstream's work", "upstream": "upstream"}
FLOOR_TARGET = 0.8  # fraction of the matmul floor
SPEED_TARGET = 1.2  # upstream seconds / ours
MEMORY_TARGET = 0.6  # our wrapper peak / upstream's


# -------------------------------------------------------------------------- FLOP count


def attention_core_flops(attn):
    """Forward matmul FLOPs per token of one attention layer's heads (projections excluded).

    With d = dim_head, a multiply-add counted 2:
      local head (window w, looking L windows back and F ahead): each query meets the
        (L + 1 + F) w keys of the windows around its own (the full block is formed, then
        masked): q kᵀ 2 (L + 1 + F) w d  +  weights @ v 2 (L + 1 + F) w d;
      global head, blindspot B > 1 (chunks are the B-blocks, no intra-chunk term; v carries a
        ones column, the normaliser, hence d + 1): chunk states kᵀv 2 d (d + 1) + q @ state
        2 d (d + 1);
      global head, B = 1 (chunks of C): the above plus the intra-chunk q kᵀ 2 C d and
        weights @ v 2 C (d + 1).
    """
    d, window = attn.dim_head, attn.local_window
    span = (window.look_backward + 1 + window.look_forward) * window.size
    local = attn.n_local * (2 * span * d + 2 * span * d)
    per_global = 4 * d * (d + 1)
    if attn.blindspot_size == 1:
        per_global += 2 * attn.chunk_size * d + 2 * attn.chunk_size * (d + 1)
    return local + (attn.heads - attn.n_local) * per_global


def training_flops(model, n):
    """Matmul FLOPs of one training step (forward + backward) of ``model`` on n tokens, batch 1.

    Forward: every nn.Linear once per token (2 in out each; the feed-forward's chunks split the
    sequence, so each of its layers still meets every token once), plus the attention heads
    (``attention_core_flops``). Backward: twice the forward (gradients for inputs and weights).
    Reversible layers recompute their forward in backward: the transformer's part once more.
    Element-wise work (norms, softmax, GELU, dropout, masks, the scan's additions) is not
    counted, so the FLOP/s is directly comparable with the matmul rate. The chunked loss does
    the same three logits matmuls (forward, d features, d weight) as the plain one.
    Returns (total, {part: forward FLOPs}).
    """
    from linear_attention_transformer.attention import Attention
    from linear_attention_transformer.reversible import ReversibleSequence

    def dense(module):
        return sum(2 * n * m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))

    body_dense = dense(model.transformer)
    heads = sum(n * attention_core_flops(m) for m in model.transformer.modules() if isinstance(m, Attention))
    parts = {
        "embedding/output projections": dense(model) - body_dense - 2 * n * model.to_logits.in_features * model.to_logits.out_features,
        "logits": 2 * n * model.to_logits.in_features * model.to_logits.out_features,
        "layer linears": body_dense,
        "attention heads": heads,
    }
    total = 3 * sum(parts.values())
    if isinstance(model.transformer.layers, ReversibleSequence):
        parts["reversible recompute"] = body_dense + heads
        total += parts["reversible recompute"]
    return total, parts


# ------------------------------------------------------------------------------ worker


def build(impl, device):
    """(model, wrapper, package file) of that README's LM: ours, ours as upstream runs it, or upstream's."""
    import linear_attention_transformer as lat

    if impl == "upstream":
        from linear_attention_transformer.autoregressive_wrapper import AutoregressiveWrapper
    else:
        from linear_attention_transformer import AutoregressiveWrapper
    torch.manual_seed(0)
    kwargs = {**SEED_LM, **UPSTREAM_RUNS} if impl == "ours_upstream_work" else SEED_LM
    model = lat.LinearAttentionTransformerLM(**kwargs).to(device).train()
    return model, AutoregressiveWrapper(model), lat.__file__


def make_step(case, model, wrapper, x):
    """One training step: zero grads, loss, backward; returns the loss."""
    def step():
        model.zero_grad(set_to_none=True)
        if case == "plain":
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        else:
            loss = wrapper(x, return_loss=True)
        loss.backward()
        return loss
    return step


def worker(args):
    set_threads(args.threads)
    device, n, upstream = args.device, args.n, args.impl == "upstream"
    model, wrapper, where = build(args.impl, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, SEED_LM["num_tokens"], (1, n + 1), generator=g).to(device)
    step = make_step(args.worker, model, wrapper, x)
    size = args.matmul_size or default_matmul_size(device)
    ref_before = square_matmul_rate(device, size)
    mem = PeakMemory(device)  # baseline: model and inputs built, nothing run yet
    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = mem.increase()
    ref_after = square_matmul_rate(device, size)
    replay, replay_flops, replay_calls = matmul_replay(step, device)
    result = dict(times=times, peak=peak, mem_method=mem.method, loss=float(loss), where=where,
                  threads=torch.get_num_threads(), ref=max(ref_before, ref_after),
                  ref_before=ref_before, ref_after=ref_after,
                  replay=replay, replay_flops=replay_flops, replay_calls=replay_calls)
    if not upstream:
        result["flops"], result["parts"] = training_flops(model, n)
    emit_result(result)


def profile(args):
    """One step of ``args.profile`` under torch.profiler after a warmup step."""
    from torch.profiler import profile as torch_profile

    set_threads(args.threads)
    model, wrapper, _ = build("ours", args.device)
    x = torch.randint(0, SEED_LM["num_tokens"], (1, args.n + 1), device=args.device)
    step = make_step(args.profile, model, wrapper, x)
    step()
    with torch_profile(record_shapes=True) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_shapes_column_width=60))


# ------------------------------------------------------------------------------ driver


def run_case(args, case, impl):
    argv = ["--worker", case, "--impl", impl, "--device", args.device, "--n", args.n, "--steps", args.steps,
            "--warmup", args.warmup, "--matmul-size", args.matmul_size]
    if args.threads is not None:
        argv += ["--threads", args.threads]
    env = dict(os.environ)
    if impl != "upstream":  # this repository's package, whatever is installed
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        python = None
    else:  # upstream's interpreter sees only its own packages
        env.pop("PYTHONPATH", None)
        python = args.upstream_python
    return run_in_subprocess(__file__, argv, f"{impl} {case}", python=python, env=env)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu, cuda, ... (default: %(default)s)")
    p.add_argument("--n", type=int, default=8192, help="sequence length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--matmul-size", type=int, default=None, help="square matmul size (default 2048 cpu, 8192 cuda)")
    p.add_argument("--upstream-python", default=None,
                   help="python that imports linear-attention-transformer 0.19.1: time upstream too")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--profile", choices=CASES, default=None, help="profile one step of this case instead")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--worker", choices=CASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=list(IMPL_LABELS), default="ours", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.matmul_size = args.matmul_size or default_matmul_size(args.device)
    if not 1 <= args.n <= SEED_LM["max_seq_len"]:
        p.error(f"--n must be <= max_seq_len={SEED_LM['max_seq_len']}")
    if args.worker is not None:
        return worker(args)
    if args.profile is not None:
        return profile(args)

    set_threads(args.threads)
    print_header(args.device, args.threads, [
        f"LinearAttentionTransformerLM({kwargs_text(SEED_LM)})",
        f"training mode, fp32, batch 1, n = {args.n}; plain: cross_entropy(model(x)); "
        f"wrapper: AutoregressiveWrapper(model)(x)",
    ])
    t_start = time.perf_counter()
    impls = ["ours"] + (["ours_upstream_work", "upstream"] if args.upstream_python else [])
    results, errors = {}, []
    for case in args.cases:
        for impl in impls:
            res, err = run_case(args, case, impl)
            if err:
                errors.append(err)
            else:
                results[case, impl] = res
    for err in errors:
        print(err, "\n")
    if not results:
        return 1

    rows = []
    for (case, impl), r in results.items():
        r["median"] = statistics.median(r["times"])
        floor_s = r["replay_flops"] / r["ref"]
        rows.append([
            IMPL_LABELS[impl], case, f"{len(r['times'])}+{args.warmup}", f"{r['median']:.2f}", f"{args.n / r['median']:.0f}",
            f"{r['ref_before'] / 1e9:.0f} / {r['ref_after'] / 1e9:.0f}",
            f"{floor_s:.2f}", f"{100 * floor_s / r['median']:.0f}%",
            f"{r['replay']:.2f}", f"{100 * r['replay'] / r['median']:.0f}%",
            f"{r['peak'] / GiB:.2f}",
        ])
    print("forward + backward, batch 1:")
    print(table(["impl", "case", "steps+warmup", "s/step", "tok/s", "matmul GFLOP/s before/after",
                 "floor s", "% of floor", "matmuls alone s", "% of that", "peak +GiB"], rows))
    first = next(iter(results.values()))
    print(f"(floor: the step's own matmul FLOPs at the better {square_matmul_desc(args.matmul_size)} fp32 "
          f"rate of the same subprocess; peak: {first['mem_method']}; threads {first['threads']})")
    print("(matmuls alone: every mm / addmm / bmm / baddbmm of one step, forward and backward, replayed on "
          "fresh operands of its own shapes and strides, best of 3 each, summed: the step with nothing "
          "but its matmuls, each at the rate its shape gets)")
    for (case, impl), r in results.items():
        print(f"  {IMPL_LABELS[impl]} {case}: {r['replay_calls']} matmul calls, {r['replay_flops'] / 1e9:.1f} GFLOP "
              f"({r['replay_flops'] / r['replay'] / 1e9:.0f} GFLOP/s replayed alone)")
    ours = [r for (c, i), r in results.items() if i == "ours"]
    if ours:
        parts = ours[0]["parts"]
        print(f"our FLOPs per step counted by hand: {ours[0]['flops'] / 1e9:.1f} G = 3 x forward "
              + "(" + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in parts.items() if k != "reversible recompute") + ")"
              + (f" + reversible recompute {parts['reversible recompute'] / 1e9:.1f} G" if "reversible recompute" in parts else ""))
    for impl in impls:
        where = [r["where"] for (c, i), r in results.items() if i == impl]
        if where:
            print(f"{IMPL_LABELS[impl]} package: {where[0]}")
    print()

    for case in args.cases:
        o, u = results.get((case, "ours")), results.get((case, "upstream"))
        same_work = results.get((case, "ours_upstream_work"))
        if o is not None:
            frac = o["replay_flops"] / o["ref"] / o["median"]
            print(f"{case}: {o['median']:.2f} s/step, {args.n / o['median']:.0f} tok/s, {100 * frac:.0f}% of the "
                  f"matmul floor (target >= {100 * FLOOR_TARGET:.0f}%: {'ok' if frac >= FLOOR_TARGET else 'BELOW TARGET'}), "
                  f"peak +{o['peak'] / GiB:.2f} GiB")
        if o is not None and u is not None:
            speed, mem = u["median"] / o["median"], o["peak"] / u["peak"]
            line = f"  vs upstream: {speed:.2f}x its speed (target >= {SPEED_TARGET}x: " \
                   f"{'ok' if speed >= SPEED_TARGET else 'BELOW TARGET'}), peak memory {mem:.2f}x upstream's"
            if case == "wrapper":
                line += f" (target <= {MEMORY_TARGET}x: {'ok' if mem <= MEMORY_TARGET else 'ABOVE TARGET'})"
            if u["replay_flops"] != o["replay_flops"]:  # upstream ignores ff_glu and ff_dropout (docstring)
                line += (f"; upstream does other work: its step is {u['replay_flops'] / 1e9:.0f} GFLOP, "
                         f"ours {o['replay_flops'] / 1e9:.0f}")
            print(line)
        if same_work is not None and u is not None:
            print(f"  equal work (ours built as upstream runs it, {kwargs_text(UPSTREAM_RUNS)}): "
                  f"{u['median'] / same_work['median']:.2f}x upstream's speed, "
                  f"{same_work['median']:.2f} s vs {u['median']:.2f} s")
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s; {load_average()} at the end)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
