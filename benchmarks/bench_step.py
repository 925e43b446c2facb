#!/usr/bin/env python
"""One decoding step of two models (``--base`` and ``--other``, ``--set`` added to both), timed in
alternating rounds in one process; the rounds' median ratio is the figure (benchmarks/README.md).

Usage:  python benchmarks/bench_step.py --threads 1 [--set use_gate=True] [--record step_delta]
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)
import bench_generate  # noqa: E402

MODEL = {k: v for k, v in bench_generate.MODEL.items() if k != "blindspot_size"}


def build(settings):
    return bench_generate.build_wrapper("cpu", {**MODEL, **settings}).net


def time_steps(model, cache, steps):
    token = torch.tensor([[5]])
    start = time.perf_counter()
    for _ in range(steps):
        model(token, cache=cache, return_cache=True)
    return (time.perf_counter() - start) / steps


def main(argv=None):
    p = common.arguments(__doc__, device=False)
    p.add_argument("--base", type=common.parse_settings, default={"update_rule": "additive"})
    p.add_argument("--other", type=common.parse_settings, default={"update_rule": "delta"})
    p.add_argument("--set", type=common.parse_settings, default={}, help="settings of both models, key=value,...")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=100, help="one-token forwards per model and round")
    args = p.parse_args(argv)
    common.start(args, [f"base {args.base}, other {args.other}, both {args.set}"])
    models = {"base": build({**args.set, **args.base}), "other": build({**args.set, **args.other})}
    with torch.no_grad():
        prompt = torch.randint(0, MODEL["num_tokens"], (1, 16), generator=torch.Generator().manual_seed(1))
        caches = {name: model(prompt, return_cache=True)[1] for name, model in models.items()}
        for name, model in models.items():
            time_steps(model, caches[name], 50)
        times = common.in_turn({name: lambda name=name: time_steps(models[name], caches[name], args.steps)
                                for name in models}, args.rounds)
    ratios = [other / base for base, other in zip(times["base"], times["other"])]
    for round_, (base, other, ratio) in enumerate(zip(times["base"], times["other"], ratios)):
        print(f"round {round_}: base {base * 1e3:.3f} ms/token, other {other * 1e3:.3f}, ratio {ratio:.3f}")
    ratio = statistics.median(ratios)
    base_ms, other_ms = (statistics.median(times[name]) * 1e3 for name in ("base", "other"))
    print(f"median: base {base_ms:.3f} ms/token (the floor), other {other_ms:.3f}: {ratio:.3f}x")
    figures = dict(base=args.base, other=args.other, shared=args.set, base_ms=round(base_ms, 3),
                   other_ms=round(other_ms, 3), ratio=round(ratio, 3), ratios=[round(r, 3) for r in ratios])
    return common.finish(args, figures)


if __name__ == "__main__":
    sys.exit(main())
