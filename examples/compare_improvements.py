"""Compare baseline, conv_only and full_improved, and two design choices of gate and convolution, on one budget.

    python examples/compare_improvements.py --seeds 0 1 --out /tmp/compare        # the built-in corpus
    python examples/compare_improvements.py --data /path/to/enwik8 --seeds 0 1 --out /tmp/compare

Every run uses the same data, the same seed(s) (initialisation and batch order), the same model
size and the same number of steps; only the variant changes. The runs:

    baseline              standard linear attention
    conv_only             use_local_conv=True
    full_improved         use_gate=True, use_local_conv=True (gate_temperature=16, the default)
    full_improved+silu    full_improved with SiLU after the local convolution, as GLA does
                          (flash-linear-attention); hooks installed by train_enwik8.py, the
                          package is not modified
    full_improved,tau=4   full_improved with gate_temperature=4 (a_t = sigmoid(.) ** (1/4):
                          gates that can forget faster)

``conv_only+silu`` and ``gate_only`` (use_gate=True without the convolution, an ablation that
separates the two improvements), ``forget_gate_only`` and ``output_gate_only`` (gate_only with
one of its two gates removed after construction) are also available through ``--variants``.

With ``--steps 0`` (the default) the step count is chosen from ``--budget-minutes``: a few
steps of the slowest variant are timed first, and the count is set so that all runs fit, then
clamped to [--min-steps, --max-steps]. The final table gives, per run, the validation BPC
(mean over a fixed set of validation windows, identical for all runs) at the last step, its mean
over seeds, the difference to the baseline of the same seed(s), and the mean time per training
step (the median step of each run, averaged over seeds). On a shared CPU the times are noisy;
compare them within one table only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

# train_enwik8 first: it sets OpenMP's waiting, which only acts before torch is imported
from train_enwik8 import build_parser as train_parser
from train_enwik8 import (HelpFormatter, build_model, builtin_corpus, default_corpus_cache, load_bytes, sample_batch,
                          split_data, train)

import torch  # noqa: E402

# name -> (library variant, options overridden on top of the shared settings)
RUNS = {
    "baseline": ("baseline", {}),
    "conv_only": ("conv_only", {}),
    "full_improved": ("full_improved", {}),
    "full_improved+silu": ("full_improved", {"conv_activation": "silu"}),
    "full_improved,tau=4": ("full_improved", {"gate_temperature": 4.0}),
    "conv_only+silu": ("conv_only", {"conv_activation": "silu"}),
    "gate_only": ("gate_only", {}),
    "forget_gate_only": ("gate_only", {"gate_parts": "forget"}),
    "output_gate_only": ("gate_only", {"gate_parts": "output"}),
}
DEFAULT_RUNS = ["baseline", "conv_only", "full_improved", "full_improved+silu", "full_improved,tau=4"]


def run_args(base, name, seed, steps):
    """A copy of the shared training options ``base`` for run ``name`` with ``seed``."""
    variant, overrides = RUNS[name]
    args = argparse.Namespace(**vars(base))
    args.variant, args.seed, args.steps = variant, seed, steps
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def time_steps(base, name, n_steps=8):
    """Seconds per training step of run ``name`` (median of ``n_steps`` after 2 untimed ones)."""
    args = run_args(base, name, seed=0, steps=n_steps)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    split = split_data(load_bytes(args.data))[0]
    rng = torch.Generator().manual_seed(0)
    times = []
    for _ in range(n_steps + 2):
        batch = sample_batch(split, args.batch_size, args.seq_len, rng)
        t0 = time.perf_counter()
        loss = model(batch, return_loss=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def choose_steps(base, names, seeds, budget_minutes, min_steps, max_steps):
    """Steps per run so that len(names) * len(seeds) runs fit in ``budget_minutes``, from the
    time of the slowest run plus 15% for evaluation; clamped to [min_steps, max_steps]."""
    slowest = max(names, key=lambda n: (RUNS[n][0] == "full_improved", "silu" in n))
    per_step = time_steps(base, slowest)
    n_runs = len(names) * len(seeds)
    steps = int(budget_minutes * 60 / (n_runs * per_step * 1.15))
    chosen = max(min_steps, min(max_steps, steps // 10 * 10))
    print(f"timing: {slowest} takes {per_step * 1000:.0f} ms/step; {n_runs} runs in "
          f"{budget_minutes} min -> {steps} steps each, using {chosen}")
    return chosen


def summarize(results, names, seeds):
    """Rows of the final table: one per run name, averaged over seeds, with the difference to
    the baseline computed seed by seed (paired) when the baseline was run."""
    rows = []
    for name in names:
        runs = [results[(name, s)] for s in seeds]
        bpcs = [r["final_val_bpc"] for r in runs]
        row = {
            "run": name,
            "bpc_per_seed": bpcs,
            "bpc_mean": statistics.fmean(bpcs),
            # median step of each run (robust to load spikes of a shared machine), mean over seeds
            "ms_per_step": 1000 * statistics.fmean(r["median_step_s"] for r in runs),
            "params": runs[0]["n_params"],
        }
        if "baseline" in names:
            deltas = [results[(name, s)]["final_val_bpc"] - results[("baseline", s)]["final_val_bpc"] for s in seeds]
            row["delta_vs_baseline"] = statistics.fmean(deltas)
            row["delta_per_seed"] = deltas
        rows.append(row)
    return rows


def format_table(rows, seeds):
    """A Markdown table of ``rows`` (see ``summarize``)."""
    seed_cols = " | ".join(f"BPC seed {s}" for s in seeds)
    header = f"| run | {seed_cols} | mean BPC | Δ vs baseline | ms/step (median) | params |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        per_seed = " | ".join(f"{b:.4f}" for b in r["bpc_per_seed"])
        delta = f"{r['delta_vs_baseline']:+.4f}" if "delta_vs_baseline" in r else "-"
        lines.append(f"| {r['run']} | {per_seed} | {r['bpc_mean']:.4f} | {delta} | "
                     f"{r['ms_per_step']:.0f} | {r['params']:,} |")
    return "\n".join(lines)


def build_parser():
    """Options of this script; model and optimiser options default to train_enwik8.py's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--data", default=None, help="enwik8 or any file, read as bytes (default: the built-in corpus)")
    p.add_argument("--corpus-cache", default=None,
                   help=f"where the built-in corpus is kept (default: {default_corpus_cache()})")
    p.add_argument("--variants", nargs="+", choices=sorted(RUNS), default=DEFAULT_RUNS, help="runs to compare")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="every run is repeated for each seed")
    p.add_argument("--steps", type=int, default=0, help="steps per run (0: chosen from --budget-minutes)")
    p.add_argument("--budget-minutes", type=float, default=18.0, help="target wall time of all runs")
    p.add_argument("--min-steps", type=int, default=150, help="fewest steps per run that --budget-minutes may choose")
    p.add_argument("--max-steps", type=int, default=400, help="most steps per run that --budget-minutes may choose")
    p.add_argument("--out", default=None, help="folder for the JSON logs and results.md (without it: only printed)")
    p.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="training options passed on to train_enwik8.py, e.g. --set dim=256 eval_batches=32")
    return p


def shared_options(args):
    """train_enwik8.py's options with its defaults, ``--data`` and the ``--set`` overrides."""
    parser = train_parser()
    extra = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects OPTION=VALUE, got {item!r}")
        extra.append(f"--{key.replace('_', '-')}")
        if value.lower() not in ("true", ""):  # bare flags (store_true) take no value
            extra.append(value)
    data = args.data or str(builtin_corpus(args.corpus_cache or default_corpus_cache()))
    base = parser.parse_args(["--data", data, *extra])
    base.log, base.generate = None, 0
    return base


def main(argv=None):
    args = build_parser().parse_args(argv)
    base = shared_options(args)
    names, seeds = list(dict.fromkeys(args.variants)), list(dict.fromkeys(args.seeds))
    steps = args.steps or choose_steps(base, names, seeds, args.budget_minutes, args.min_steps, args.max_steps)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    started = datetime.now(timezone.utc)
    print(f"{started:%Y-%m-%d %H:%M} UTC: {len(names)} runs x {len(seeds)} seed(s), {steps} steps each, "
          f"dim {base.dim}, depth {base.depth}, heads {base.heads} ({base.n_local_attn_heads} local, "
          f"window {base.local_attn_window_size}), seq_len {base.seq_len}, batch {base.batch_size}, lr {base.lr}")
    results = {}
    for seed in seeds:  # all variants of one seed, then the next: slow drifts of the machine hit all
        for name in names:
            run = run_args(base, name, seed, steps)
            if out:
                run.log = str(out / f"{name.replace(',', '_').replace('=', '')}_seed{seed}.json")
            log = train(run, quiet=True)
            results[(name, seed)] = log
            curve = "  ".join(f"{h['step']}:{h['val_bpc']:.3f}" for h in log["history"])
            print(f"{name:<20} seed {seed}: valid {log['final_val_bpc']:.4f} bpc, "
                  f"{log['median_step_s'] * 1000:.0f} ms/step (median), {log['total_time_s']:.0f} s, "
                  f"load {log['machine']['load_average_at_end'][0]:.1f}  [{curve}]", flush=True)

    rows = summarize(results, names, seeds)
    table = format_table(rows, seeds)
    minutes = (datetime.now(timezone.utc) - started).total_seconds() / 60
    print()
    print(f"final validation BPC after {steps} steps ({base.eval_batches * base.batch_size} fixed windows of "
          f"{base.seq_len} bytes), {minutes:.1f} min in all")
    print(table)
    if out:
        (out / "results.md").write_text(table + "\n")
        (out / "results.json").write_text(json.dumps(
            {"date": started.isoformat(timespec="seconds"), "steps": steps, "seeds": seeds,
             "options": vars(base), "rows": rows}, indent=2))
        print(f"logs in {out}")


if __name__ == "__main__":
    main()
