#!/usr/bin/env python
"""One attention layer, ``LinearSelfAttention(**LAYER, **variant)`` or the softmax reference, forward
and backward, against its matmul floor and the first variant, with its peak memory (benchmarks/README.md).

Usage:  python benchmarks/bench_layer.py --threads 1 --lengths 4096 --variants base use_gate=True layer=softmax
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

LAYER = dict(dim=512, heads=8, dim_head=64, causal=True)


def build_step(case, device):
    """The layer of ``case`` and a function that runs its forward and backward."""
    from linear_attention_transformer import LinearSelfAttention

    settings = dict(case["settings"])
    softmax = settings.pop("layer", "linear") == "softmax"
    torch.manual_seed(0)
    layer = common.SoftmaxSelfAttention(**LAYER) if softmax else LinearSelfAttention(**LAYER, **settings)
    layer = layer.to(device).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, case["n"], LAYER["dim"], generator=g).to(device).requires_grad_()
    grad_out = torch.randn(1, case["n"], LAYER["dim"], generator=g).to(device)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad_out)

    return layer, step


def main(argv=None):
    args = common.step_arguments(__doc__, lengths=[4096, 16384]).parse_args(argv)
    if args.worker is not None:
        return common.step_worker(args.worker, build_step)
    common.start(args, f"LinearSelfAttention({common.kwargs_text(LAYER)}), batch 1, fp32")
    cases = [dict(impl="ours", settings=settings, n=n) for n in args.lengths for settings in args.variants]
    return common.report_step_cases(args, cases, common.run_step_cases(__file__, args, cases))


if __name__ == "__main__":
    sys.exit(main())
