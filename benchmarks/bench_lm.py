#!/usr/bin/env python
"""One training step of LinearAttentionTransformerLM against its matmul floor, with its peak memory;
variants of the model and of the step, upstream 0.19.1 and a busy core are flags (benchmarks/README.md).

Usage:  python benchmarks/bench_lm.py --threads 1 --lengths 4096 16384 [--variants base checkpoint=True]
"""

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

MODELS = {
    "bench": dict(num_tokens=256, dim=512, heads=8, dim_head=64, depth=2, causal=True, blindspot_size=1,
                  n_local_attn_heads=0),
    "upstream-readme": dict(num_tokens=20000, dim=512, heads=8, depth=1, causal=True, ff_dropout=0.1,
                            attn_layer_dropout=0.1, attn_dropout=0.1, emb_dim=128, dim_head=128, blindspot_size=64,
                            n_local_attn_heads=4, local_attn_window_size=128, reversible=True, ff_chunks=2,
                            ff_glu=True, attend_axially=False, shift_tokens=True),
}
STEP_SETTINGS = {"loss": "plain", "segments": 1, "compile": False}


def segment_ids_for(n, count, seed=1):
    """(1, n) ids of ``count`` documents cut at random positions (on or off the chunk grid)."""
    ids = torch.zeros(n, dtype=torch.long)
    ids[torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed))[: count - 1] + 1] = 1
    return ids.cumsum(0)[None]


def build_step(case, device):
    """The model of ``case`` and a function that runs one training step of it."""
    import linear_attention_transformer as lat

    wrapper_class = getattr(lat, "AutoregressiveWrapper", None)
    if wrapper_class is None:  # upstream keeps it in its own module
        from linear_attention_transformer.autoregressive_wrapper import AutoregressiveWrapper as wrapper_class
    settings = {**STEP_SETTINGS, **case["settings"]}
    model_kwargs = {k: v for k, v in case["settings"].items() if k not in STEP_SETTINGS}
    torch.manual_seed(0)
    model = lat.LinearAttentionTransformerLM(**{**MODELS[case["model"]], **model_kwargs, "max_seq_len": case["n"]})
    model = model.to(device).train()
    net = torch.compile(model) if settings["compile"] else model
    x = torch.randint(0, MODELS[case["model"]]["num_tokens"], (1, case["n"] + 1),
                      generator=torch.Generator().manual_seed(1)).to(device)
    documents = settings["segments"]
    extra = {} if documents == 1 else {"segment_ids": segment_ids_for(case["n"] + 1, documents).to(device)}
    wrapper = wrapper_class(net)

    def step():
        model.zero_grad(set_to_none=True)
        if settings["loss"] == "wrapper":
            loss = wrapper(x, return_loss=True, **extra)
        else:
            logits = net(x[:, :-1], **{k: v[:, :-1] for k, v in extra.items()})
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()

    return model, step


def main(argv=None):
    p = common.step_arguments(__doc__, lengths=[4096, 16384])
    p.add_argument("--model", choices=list(MODELS), default="bench")
    p.add_argument("--upstream-path", default=None, help="folder holding linear-attention-transformer 0.19.1")
    p.add_argument("--busy", action="store_true", help="keep one more process spinning during the runs")
    args = p.parse_args(argv)
    if args.worker is not None:
        return common.step_worker(args.worker, build_step)
    common.start(args, f"{args.model}: LinearAttentionTransformerLM("
                        f"{common.kwargs_text(MODELS[args.model])}), batch 1, fp32" + ", one busy process" * args.busy)
    impls = ["ours"] + ["upstream"] * bool(args.upstream_path)
    cases = [dict(model=args.model, impl=impl, settings=settings, n=n)
             for n in args.lengths for settings in args.variants for impl in impls]
    upstream = {**os.environ, "PYTHONPATH": os.path.abspath(args.upstream_path or ".")}  # its package, not ours
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        results = common.run_step_cases(__file__, args, cases, lambda c: upstream if c["impl"] == "upstream" else None)
    finally:
        if busy:
            busy.kill()
    return common.report_step_cases(args, cases, results)


if __name__ == "__main__":
    sys.exit(main())
