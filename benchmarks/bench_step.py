#!/usr/bin/env python
"""One decoding step of two models, timed in alternating rounds in one process.

    LinearAttentionTransformerLM(num_tokens=256, dim=256, depth=2, heads=4, n_local_attn_heads=2,
                                 local_attn_window_size=64, causal=True, max_seq_len=2048, **shared)

``bench_generate.py``'s model without its blindspot (the delta rule has none), in eval mode,
fp32, one row. ``--base`` and ``--other`` are ``key=value,...`` added to the base model (default:
``update_rule=additive`` against ``update_rule=delta``), ``--set`` to both. After a 16-token
prompt and 50 warm-up steps each, every round times ``--steps`` one-token forwards of the
base model, then as many of the other, on their own caches. Printed: each round's per-token
times and their ratio; the median ratio is the figure (the machine's load moves both sides of
a round alike, so the ratio holds where absolute times drift). The floor is the base model's
step in the same round.

Usage:  python benchmarks/bench_step.py --threads 1 [--set use_gate=True] [--record step_delta]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

MODEL = dict(num_tokens=256, dim=256, depth=2, heads=4, n_local_attn_heads=2, local_attn_window_size=64, causal=True,
             max_seq_len=2048)


def build(settings):
    from linear_attention_transformer import LinearAttentionTransformerLM

    torch.manual_seed(0)
    return LinearAttentionTransformerLM(**MODEL, **settings).eval()


def time_steps(model, cache, steps):
    token = torch.tensor([[5]])
    start = time.perf_counter()
    for _ in range(steps):
        model(token, cache=cache, return_cache=True)
    return (time.perf_counter() - start) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=common.parse_settings, default={"update_rule": "additive"})
    p.add_argument("--other", type=common.parse_settings, default={"update_rule": "delta"})
    p.add_argument("--set", type=common.parse_settings, default={}, help="settings of both models, key=value,...")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=100, help="one-token forwards per model and round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--record", metavar="NAME", default=None, help="write the figures to results/NAME.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    common.print_header("cpu", args.threads, [f"base {args.base}, other {args.other}, both {args.set}"])
    models = [build({**args.set, **args.base}), build({**args.set, **args.other})]
    ratios, times = [], []
    with torch.no_grad():
        prompt = torch.randint(0, MODEL["num_tokens"], (1, 16), generator=torch.Generator().manual_seed(1))
        caches = [model(prompt, return_cache=True)[1] for model in models]
        for model, cache in zip(models, caches):
            time_steps(model, cache, 50)
        for round_ in range(args.rounds):
            base, other = (time_steps(model, cache, args.steps) for model, cache in zip(models, caches))
            ratios.append(other / base)
            times.append((base, other))
            print(f"round {round_}: base {base * 1e3:.3f} ms/token, other {other * 1e3:.3f}, ratio {ratios[-1]:.3f}")
    ratio = statistics.median(ratios)
    base_ms, other_ms = (statistics.median(t[i] for t in times) * 1e3 for i in (0, 1))
    print(f"median: base {base_ms:.3f} ms/token (the floor), other {other_ms:.3f}: {ratio:.3f}x")
    if args.record:
        figures = dict(base=args.base, other=args.other, shared=args.set, base_ms=round(base_ms, 3),
                       other_ms=round(other_ms, 3), ratio=round(ratio, 3), ratios=[round(r, 3) for r in ratios])
        print("recorded in", common.record(args.record, "cpu", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
