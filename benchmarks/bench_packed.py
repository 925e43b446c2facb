#!/usr/bin/env python
"""What packed sequences cost: one LM training step (forward + backward) at n tokens holding
~8 documents told apart by ``segment_ids``, against the same step without ``segment_ids``
(one document), beside the square fp32 matmul rate and the floor (the step's analytic
matmul FLOPs, ``bench_lm.model_flops``, at that rate), all measured in the same worker.

Two models: the benchmark LM of ``bench_lm.py`` (every head global: the chunked kernel with
segment resets), and the same with the README model's local heads and a blindspot (there the layer
moves every segment to start at a multiple of the blindspot block: the printed 'slots' is
the longest row of that layout against n). The two variants alternate step by step, so load
drift hits both alike; each figure is the best of ``--steps``.

Usage:  python benchmarks/bench_packed.py [--device cpu] [--length 4096] [--segments 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)
from bench_lm import MODEL, model_config, model_flops  # noqa: E402

CONFIGS = {
    "global heads": {},
    "local heads + blindspot": dict(n_local_attn_heads=4, local_attn_window_size=128, blindspot_size=64),
}


def segment_ids_for(n, count, seed=1):
    """(1, n) ids of ``count`` segments with boundaries at random positions (anywhere,
    on or off the chunk grid)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(n - 1, generator=g)[: count - 1].sort().values + 1
    ids = torch.zeros(n, dtype=torch.long)
    ids[cuts] = 1
    return ids.cumsum(0)[None]


def step(model, x, y, segment_ids):
    model.zero_grad(set_to_none=True)
    logits = model(x, segment_ids=segment_ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()


def worker(args):
    from linear_attention_transformer import LinearAttentionTransformerLM
    from linear_attention_transformer.ops.segments import aligned_layout

    common.set_threads(args.threads)
    device, n = args.device, args.length
    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(**dict(MODEL, max_seq_len=n, **CONFIGS[args.worker])).to(device).train()
    g = torch.Generator(device="cpu").manual_seed(1)
    x, y = (torch.randint(0, MODEL["num_tokens"], (1, n), generator=g).to(device) for _ in range(2))
    ids = segment_ids_for(n, args.segments).to(device)
    blindspot = model.transformer.layers.blocks[0][0].fn.blindspot_size
    slots = aligned_layout(ids, blindspot)[1] if blindspot > 1 else n
    size = args.matmul_size or common.default_matmul_size(device)
    rate = common.square_matmul_rate(device, size)
    times = {"without": [], "with": []}
    for i in range(1 + args.steps):  # one untimed warm-up round
        for name, segment_ids in (("without", None), ("with", ids)):
            common.synchronize(device)
            t0 = time.perf_counter()
            step(model, x, y, segment_ids)
            common.synchronize(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    rate = max(rate, common.square_matmul_rate(device, size))
    common.emit_result(dict(without=min(times["without"]), packed=min(times["with"]), rate=rate, slots=slots,
                     flops=model_flops(n, model_config(model))[0]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=common.default_device())
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--matmul-size", type=int, default=None)
    p.add_argument("--worker", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(args)

    common.print_header(args.device, args.threads, [
        f"LinearAttentionTransformerLM({common.kwargs_text(MODEL)}) + each config's options,",
        f"n={args.length}, batch 1, fp32, {args.segments} segments of random lengths, best of {args.steps} steps",
    ])
    rows = []
    # the worker measures with the same settings as asked here
    passed = {"--device": args.device, "--length": args.length, "--segments": args.segments, "--steps": args.steps,
              "--threads": args.threads, "--matmul-size": args.matmul_size}
    shared = [str(part) for option, value in passed.items() if value is not None for part in (option, value)]
    for name in CONFIGS:
        argv = shared + ["--worker", name]
        res, err = common.run_in_subprocess(__file__, argv, name)
        if err:
            print(err)
            continue
        floor = res["flops"] / res["rate"]
        rows.append([name, common.kwargs_text(CONFIGS[name]) or "-", f"{res['without']:.3f}", f"{res['packed']:.3f}",
                     f"{res['packed'] / res['without']:.2f}", f"{floor:.3f}", f"{res['rate'] / 1e9:.1f}",
                     f"{res['slots']}/{args.length}"])
    print(common.table(["model", "options", "s/step without", "s/step packed", "packed/without", "floor s",
                        "matmul GFLOP/s", "slots"], rows))


if __name__ == "__main__":
    main()
