#!/usr/bin/env python
"""Quality past the training length: validation BPC at 1x, 4x and 16x ``max_seq_len``.

Each model is trained by ``examples/train_enwik8.py``'s ``train`` (its defaults: dim 128, depth 2,
4 heads of which 2 local with a window of 64, batch 8, Adam 1e-3) on sequences of ``--seq-len``
bytes (also its ``max_seq_len``), for ``--steps`` steps and each seed of ``--seeds``:

    recommended-rotary   use_gate=True, use_local_conv=True, feature_map='taylor', dim_qk=16; rotary
    recommended-none     the same with no positions (use_pos_emb=False)
    softmax-rotary       the reference: every head softmax attention over the whole context; rotary

It is then scored on held-out text (the validation split) in windows of 1x, 4x and 16x the
training length (``--factors``), every length over the same bytes (fewer, longer windows). The
linear models read each window in one stream through their cache (``stream_loss``, chunks of the
training length) with ``max_seq_len`` as trained. The softmax reference has no fixed-size cache:
its weights are loaded into a model whose window covers the length and it reads each window in
one full forward (the same function as trained up to the training length).

Printed per model and seed, and as the mean over seeds: BPC over the whole window at each
length, the BPC of the window's last quarter (positions the model never saw in training), the
BPC per block of ``--seq-len`` positions at the longest length, and the last block's bytes read
alone, as a window of the training length: the same bytes, without what came before them. The
reference is the 1x column and that last comparison: a model that keeps its quality past its
training length reads no worse at 16x, and its last block no worse than when read alone.

Usage:  python benchmarks/bench_length.py --threads 1 [--steps 2000] [--seeds 0 1] [--record length]
"""

import argparse
import math
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
from train_enwik8 import build_model, builtin_corpus, default_corpus_cache, fixed_batches, load_bytes  # noqa: E402
from train_enwik8 import bpc, options_from_pairs, split_data, train  # noqa: E402
from train_enwik8 import build_parser as train_parser  # noqa: E402

MODELS = {
    "recommended-rotary": dict(variant="recommended", pos_emb="rotary"),
    "recommended-none": dict(variant="recommended", pos_emb="none"),
    "softmax-rotary": dict(variant="softmax", pos_emb="rotary"),
}


def run_options(args, name, seed):
    """train_enwik8's options for one run: its defaults, ``--set``, the model and the seed; the
    checkpoint and log under ``--out``; no samples, no test split."""
    run = train_parser().parse_args(options_from_pairs(args.set))
    run.data, run.corpus_cache, run.steps, run.seed = args.data, args.corpus_cache, args.steps, seed
    run.seq_len, run.threads, run.eval_every = args.seq_len, args.threads or 0, args.eval_every
    for key, value in MODELS[name].items():
        setattr(run, key, value)
    run.save, run.log = (os.path.join(args.out, f"{name}_seed{seed}.{ext}") for ext in ("pt", "json"))
    run.plot, run.resume, run.generate, run.test_batches = None, None, 0, 0
    return run


def trained_model(run, reuse):
    """(the parameters ``run`` trained, the run's log): trained now, or with ``reuse`` read
    from the run's checkpoint when its log has the same options."""
    log = reusable_log(run) if reuse and os.path.isfile(run.save) else None
    if log is None:
        log = train(run, quiet=True)
    return torch.load(run.save, map_location="cpu", weights_only=False)["model"], log


def scoring_model(run, state, length):
    """The wrapper with the trained parameters ``state``, in eval mode, that scores windows of
    ``length`` tokens: the model as trained, or for the softmax reference one whose window (its
    ``max_seq_len``) covers ``length``; its parameters do not depend on it."""
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
    """BPC figures of one model: per length factor the whole window and its last quarter; at the
    longest, the curve over blocks of the training length, and its last block against the same
    bytes read as a window of the training length (the bytes before it cut away)."""
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="any file, read as bytes (default: the built-in corpus)")
    p.add_argument("--corpus-cache", default=None, help=f"where the built-in corpus is kept ({default_corpus_cache()})")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=2000, help="training steps per run (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="training length and max_seq_len (default: %(default)s)")
    p.add_argument("--factors", nargs="+", type=int, default=[1, 4, 16], help="scored lengths over --seq-len")
    p.add_argument("--eval-windows", type=int, default=12,
                   help="held-out windows at the longest length; a length k times shorter takes k times as many "
                        "(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=500, help="train_enwik8's validation interval (default: %(default)s)")
    p.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="train_enwik8.py options for every run, e.g. --set dim=64 batch_size=4")
    p.add_argument("--out", default="length_runs", help="folder for the checkpoints and training logs")
    p.add_argument("--reuse", action="store_true",
                   help="score a run's checkpoint in --out instead of training it when its log has the same options")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--record", default=None, metavar="NAME", help="write the figures to results/NAME.json")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.seq_len < 2 or args.steps < 1 or args.eval_windows < 1 or min(args.factors) < 1:
        raise SystemExit("--seq-len must be >= 2, --steps, --eval-windows and --factors >= 1")
    common.set_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    data = load_bytes(args.data or builtin_corpus(args.corpus_cache or default_corpus_cache()))
    valid = split_data(data)[1]
    common.print_header("cpu", args.threads, [
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
    print()
    print(common.table(["model", "seed", "steps", *(f"{f}x (last quarter)" if f > 1 else "1x" for f in args.factors)],
                       rows))
    longest = max(args.factors)
    print(f"\nBPC per block of {args.seq_len} positions at {longest}x (mean over seeds):")
    for name in args.models:
        mean = figures[f"{name} mean"]
        print(f"  {name}: " + " ".join(f"{v:.2f}" for v in mean[f"{longest}x per block"])
              + f"; the last block read alone: {mean[f'{longest}x last block read alone']:.3f}")
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all")
    if args.record:
        print(f"recorded: {common.record(args.record, 'cpu', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
