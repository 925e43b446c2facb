#!/usr/bin/env python
"""Quality past the training length: validation BPC at 1x, 4x and 16x ``max_seq_len`` of each of
``MODELS``, trained by ``examples/train_enwik8.py``'s ``train`` (benchmarks/README.md).

Usage:  python benchmarks/bench_length.py --threads 1 [--steps 2000] [--seeds 0 1] [--record length]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402  (the folder of this script, see common.py)
from compare_variants import reusable_log  # noqa: E402
from train_enwik8 import (bpc, build_model, build_parser as train_parser, builtin_corpus,  # noqa: E402
                          default_corpus_cache, fixed_batches, load_bytes, options_from_pairs, split_data, train)

MODELS = {"recommended-rotary": dict(variant="recommended", pos_emb="rotary"),
          "recommended-none": dict(variant="recommended", pos_emb="none"),
          "softmax-rotary": dict(variant="softmax", pos_emb="rotary")}


def run_options(args, name, seed):
    """train_enwik8's options for one run: its defaults, ``--set``, the model and the seed, saved under ``--out``."""
    run = train_parser().parse_args(options_from_pairs(args.set))
    run.data, run.corpus_cache, run.steps, run.seed = args.data, args.corpus_cache, args.steps, seed
    run.seq_len, run.threads, run.eval_every = args.seq_len, args.threads or 0, args.eval_every
    for key, value in MODELS[name].items():
        setattr(run, key, value)
    run.save, run.log = (os.path.join(args.out, f"{name}_seed{seed}.{ext}") for ext in ("pt", "json"))
    run.plot, run.resume, run.generate, run.test_batches = None, None, 0, 0
    return run


def trained_model(run, reuse):
    """(the parameters ``run`` trained, the run's log): trained now, or read back (``--reuse``)."""
    log = reusable_log(run) if reuse and os.path.isfile(run.save) else None
    if log is None:
        log = train(run, quiet=True)
    return torch.load(run.save, map_location="cpu", weights_only=False)["model"], log


def scoring_model(run, state, length):
    """The wrapper with ``state``, in eval mode, that scores windows of ``length`` (benchmarks/README.md)."""
    scoring = argparse.Namespace(**vars(run))
    if run.variant == "softmax":
        scoring.seq_len = length
    model = build_model(scoring)
    model.load_state_dict(state)
    return model.eval()


def window_losses(model, windows, chunk_len, streamed):
    """(rows, length) next-byte losses (nats) of the (rows, length + 1) ``windows``: streamed
    through the cache, or one full forward per row."""
    if streamed:
        return model.stream_loss(windows, chunk_len=chunk_len, reduction="none")
    with torch.no_grad():
        return torch.cat([F.cross_entropy(model.net(row[None, :-1]).transpose(1, 2), row[None, 1:], reduction="none")
                          for row in windows])


def score(run, state, valid, args):
    """BPC of one model at each length factor, the figures benchmarks/README.md lists."""
    figures, longest, streamed = {}, max(args.factors), run.variant != "softmax"

    def losses_of(windows, length):
        model = scoring_model(run, state, length)
        return torch.cat([window_losses(model, part, args.seq_len, streamed) for part in windows.split(4)])

    for factor in args.factors:
        length = factor * args.seq_len
        count = args.eval_windows * longest // factor  # every length over the same bytes
        windows = torch.cat(fixed_batches(valid, 1, count, length))
        losses = losses_of(windows, length)
        figures[f"{factor}x"] = bpc(losses.mean().item())
        figures[f"{factor}x last quarter"] = bpc(losses[:, -length // 4:].mean().item())
        if factor == longest:
            figures[f"{factor}x per block"] = [bpc(v) for v in losses.view(count, factor, -1).mean(dim=(0, 2)).tolist()]
            figures[f"{factor}x last block"] = figures[f"{factor}x per block"][-1]
            alone = losses_of(windows[:, -args.seq_len - 1:], args.seq_len)
            figures[f"{factor}x last block read alone"] = bpc(alone.mean().item())
    return figures


def mean_figures(per_seed):
    """The mean over seeds of every figure (curves entry by entry)."""
    first = per_seed[0]
    return {key: [statistics.fmean(v) for v in zip(*(f[key] for f in per_seed))] if isinstance(first[key], list)
            else statistics.fmean(f[key] for f in per_seed) for key in first}


def cells(figures, factors):
    """Table cells: the whole window, and for longer ones its last quarter in parentheses."""
    return [f"{figures[f'{f}x']:.3f}" + (f" ({figures[f'{f}x last quarter']:.3f})" if f > 1 else "") for f in factors]


def build_parser():
    p = common.arguments(__doc__, device=False)
    p.add_argument("--data", default=None, help="any file, read as bytes (default: the built-in corpus)")
    p.add_argument("--corpus-cache", default=None, help=f"where the built-in corpus is kept ({default_corpus_cache()})")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=2000, help="training steps per run (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="training length and max_seq_len (default: %(default)s)")
    p.add_argument("--factors", nargs="+", type=int, default=[1, 4, 16], help="scored lengths over --seq-len")
    p.add_argument("--eval-windows", type=int, default=12,
                   help="held-out windows at the longest length, k times as many at a length k times shorter")
    p.add_argument("--eval-every", type=int, default=500, help="train_enwik8's validation interval (default: %(default)s)")
    p.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="train_enwik8.py options for every run, e.g. --set dim=64 batch_size=4")
    p.add_argument("--out", default="length_runs", help="folder for the checkpoints and training logs")
    p.add_argument("--reuse", action="store_true",
                   help="score a run's checkpoint in --out instead of training it when its log has the same options")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.seq_len < 2 or args.steps < 1 or args.eval_windows < 1 or min(args.factors) < 1:
        raise SystemExit("--seq-len must be >= 2, --steps, --eval-windows and --factors >= 1")
    os.makedirs(args.out, exist_ok=True)
    data = load_bytes(args.data or builtin_corpus(args.corpus_cache or default_corpus_cache()))
    valid = split_data(data)[1]
    common.start(args, [
        f"train_enwik8.py defaults {' '.join(args.set)}; max_seq_len {args.seq_len}, {args.steps} steps, "
        f"seeds {args.seeds}", f"held-out: {valid.numel():,} bytes, {args.eval_windows} windows of "
        f"{max(args.factors) * args.seq_len} bytes (as many bytes at every length)"])

    figures, started = {}, time.perf_counter()
    for seed in args.seeds:  # every model of one seed, then the next: a slow drift of the machine hits all
        for name in args.models:
            run = run_options(args, name, seed)
            state, log = trained_model(run, args.reuse)
            result = score(run, state, valid, args)
            result.update(steps=log["steps_done"], train_s_per_step=log["median_step_s"],
                          train_valid_bpc=log["final_val_bpc"], trained=log["date"])
            figures[f"{name} seed {seed}"] = result
            print(f"{name} seed {seed}: {result['steps']} steps, {result['train_s_per_step']:.3f} s/step, "
                  + ", ".join(f"{f}x {c}" for f, c in zip(args.factors, cells(result, args.factors))), flush=True)
    rows = []
    for name in args.models:
        per_seed = [figures[f"{name} seed {seed}"] for seed in args.seeds]
        rows += [[name, seed, r["steps"], *cells(r, args.factors)] for seed, r in zip(args.seeds, per_seed)]
        mean = figures[f"{name} mean"] = mean_figures([{k: v for k, v in r.items() if k != "trained"}
                                                       for r in per_seed])
        rows.append([name, "mean", round(mean["steps"]), *cells(mean, args.factors)])
    headers = ["model", "seed", "steps", *(f"{f}x (last quarter)" if f > 1 else "1x" for f in args.factors)]
    print("\n" + common.table(headers, rows))
    longest = max(args.factors)
    print(f"\nBPC per block of {args.seq_len} positions at {longest}x (mean over seeds):")
    for name in args.models:
        mean = figures[f"{name} mean"]
        print(f"  {name}: " + " ".join(f"{v:.2f}" for v in mean[f"{longest}x per block"])
              + f"; the last block read alone: {mean[f'{longest}x last block read alone']:.3f}")
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all")
    return common.finish(args, figures)


if __name__ == "__main__":
    sys.exit(main())
