"""The improvements' experiment: Baseline, Conv_Only, Full_Improved and the recommended configuration trained side by
side, with a plot and a table.

    python examples/compare_variants.py                               # built-in corpus, small models
    python examples/compare_variants.py --data /path/to/enwik8 --steps 20000 --seeds 0 1 2 \
        --set dim=512 depth=6 seq_len=1024 --out runs/enwik8

Every variant is trained by ``train_enwik8.py``'s ``train`` with the same seed (the same
initial random state and the same batches, in the same order), the same number of steps and the
same fixed validation windows; only the attention changes. ``--max-minutes`` gives every run the
same wall time as well (each stops at the step where it runs out). Each variant is repeated for
every seed in ``--seeds``.

Variants (``--variants``):

    baseline              standard linear attention
    conv_only             use_local_conv=True
    full_improved         use_gate=True, use_local_conv=True
    gate_only             use_gate=True (an ablation)
    softmax               the reference: every head softmax attention over the whole context
    recommended           use_gate=True, use_local_conv=True, feature_map='taylor', dim_qk=16
    taylor_conv           recommended without the gate
    delta                 use_gate=True, use_local_conv=True, update_rule='delta'
    delta_plain           delta without the gate
    delta_qk128           delta with queries and keys of 128 (dim_qk=128)
    conv_v, conv_kv       conv_only with the convolution on v only / on k and v only (a design
                          probe: the others bypassed by hooks, see train_enwik8.restrict_conv)
    gate_feature          full_improved with gate_granularity='feature'  } only where the installed
    gate_head             full_improved with gate_granularity='head'     } package has the option

Writes to ``--out``: ``loss_comparison.png`` (validation BPC against steps, one line per variant:
the mean over seeds, the band between the lowest and highest seed), ``results.md`` (a table:
final validation BPC mean ± sample standard deviation over seeds, per seed, parameters, seconds
per step) and every run's JSON log. With ``--reuse``, a run whose log in ``--out`` was written
with the same options is read from it instead of trained again: an interrupted comparison
continues where it stopped, and variants or seeds can be added to a finished one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from train_enwik8 import build_parser as train_parser
from train_enwik8 import HelpFormatter, default_corpus_cache, gate_granularity_supported, options_from_pairs, train

# name -> options of train_enwik8.py that make the variant
VARIANTS = {
    "baseline": {"variant": "baseline"},
    "conv_only": {"variant": "conv_only"},
    "full_improved": {"variant": "full_improved"},
    "gate_only": {"variant": "gate_only"},
    "softmax": {"variant": "softmax"},
    "recommended": {"variant": "recommended"},
    "taylor_conv": {"variant": "taylor_conv"},
    "delta": {"variant": "delta"},
    "delta_plain": {"variant": "delta_plain"},
    "delta_qk128": {"variant": "delta_qk128"},
    "conv_v": {"variant": "conv_only", "conv_on": "v"},
    "conv_kv": {"variant": "conv_only", "conv_on": "kv"},
    "gate_feature": {"variant": "full_improved", "gate_granularity": "feature"},
    "gate_head": {"variant": "full_improved", "gate_granularity": "head"},
}
NEEDS_GRANULARITY = {"gate_feature", "gate_head"}
DEFAULT_VARIANTS = ["baseline", "conv_only", "full_improved", "recommended"]  # the experiment's three and ours


def run_options(base, name, seed):
    """A copy of the shared options ``base`` for variant ``name`` and ``seed``."""
    args = argparse.Namespace(**vars(base))
    args.seed = seed
    for key, value in VARIANTS[name].items():
        setattr(args, key, value)
    return args


def reusable_log(run):
    """The log at ``run.log`` when it was written by a finished run with exactly the options of
    ``run`` (the log's own path aside), else None. Only the options are compared: after
    upgrading the library, or where a default changed (e.g. ``gate_granularity='default'``),
    run again without ``--reuse``."""
    path = Path(run.log)
    try:
        log = json.loads(path.read_text())
    except (OSError, ValueError):  # no log, or one cut short: train the run
        return None
    if not isinstance(log, dict) or log.get("steps_done") is None:
        return None
    recorded = {k: v for k, v in log.get("config", {}).items() if k != "log"}
    wanted = json.loads(json.dumps({k: v for k, v in vars(run).items() if k != "log"}))  # as the log stores them
    return log if recorded == wanted else None


def summarize(results, names, seeds):
    """One row per variant: final validation BPC per seed, mean, sample std, parameters, s/step."""
    rows = []
    for name in names:
        runs = [results[(name, s)] for s in seeds]
        bpcs = [r["final_val_bpc"] for r in runs]
        rows.append({
            "variant": name,
            "bpc_per_seed": bpcs,
            "bpc_mean": statistics.fmean(bpcs),
            "bpc_std": statistics.stdev(bpcs) if len(bpcs) > 1 else 0.0,
            "params": runs[0]["n_params"],
            # the median step of each run (robust to load spikes on a shared machine), mean over seeds
            "s_per_step": statistics.fmean(r["median_step_s"] for r in runs),
            "steps": [r["steps_done"] for r in runs],
        })
    return rows


def format_table(rows, seeds):
    """The rows of ``summarize`` as a Markdown table."""
    seed_cols = "".join(f" seed {s} |" for s in seeds)
    lines = [f"| variant | valid BPC (mean ± std over {len(seeds)} seed{'s' * (len(seeds) > 1)}) |{seed_cols}"
             " steps | parameters | s/step |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for r in rows:
        per_seed = "".join(f" {b:.4f} |" for b in r["bpc_per_seed"])
        steps = "/".join(str(s) for s in sorted(set(r["steps"])))
        lines.append(f"| {r['variant']} | {r['bpc_mean']:.4f} ± {r['bpc_std']:.4f} |{per_seed} {steps} | "
                     f"{r['params']:,} | {r['s_per_step']:.3f} |")
    return "\n".join(lines)


def plot_comparison(results, names, seeds, path, title):
    """Validation BPC against steps: per variant the mean over seeds, shaded between the lowest
    and the highest seed (at the steps every seed reached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in names:
        curves = [{h["step"]: h["val_bpc"] for h in results[(name, s)]["history"]} for s in seeds]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = [[c[step] for c in curves] for step in steps]
        (line,) = ax.plot(steps, [statistics.fmean(v) for v in values], marker=".", label=name)
        if len(seeds) > 1:
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bpc (bits per character, i.e. byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def shared_options(args):
    """train_enwik8.py's options with its defaults, this script's data and budget, and the
    ``--set`` overrides; no per-run logging, samples or checkpoints."""
    base = train_parser().parse_args(options_from_pairs(args.set))
    for key in ("data", "corpus_cache", "steps", "max_minutes"):
        setattr(base, key, getattr(args, key))
    base.log = base.plot = base.save = base.resume = None
    base.generate = 0
    base.test_batches = 0
    return base


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--data", default=None, help="enwik8 or any file, read as bytes (default: the built-in corpus)")
    p.add_argument("--corpus-cache", default=None,
                   help=f"where the built-in corpus is kept (default: {default_corpus_cache()})")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=DEFAULT_VARIANTS,
                   help="the variants to train (the experiment's three, the recommended configuration, ablations, design probes "
                        "and the softmax reference; see the docstring)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="every variant is run once per seed")
    p.add_argument("--steps", type=int, default=600, help="steps per run")
    p.add_argument("--max-minutes", type=float, default=0.0, help="also stop every run after this much training time")
    p.add_argument("--out", default="compare_runs", help="folder for the plot, the table and the logs")
    p.add_argument("--reuse", action="store_true",
                   help="take a run from its log in --out instead of training it, when the log's options equal "
                        "the run's (to finish an interrupted comparison, or add variants or seeds to one)")
    p.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="train_enwik8.py options for every run, e.g. --set dim=256 eval_every=50")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    names, seeds = list(dict.fromkeys(args.variants)), list(dict.fromkeys(args.seeds))
    if NEEDS_GRANULARITY.intersection(names) and not gate_granularity_supported():
        raise SystemExit(f"{sorted(NEEDS_GRANULARITY.intersection(names))}: the installed "
                         "linear_attention_transformer has no gate_granularity option")
    base = shared_options(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    started = datetime.now(timezone.utc)
    print(f"{started:%Y-%m-%d %H:%M} UTC: {len(names)} variants x {len(seeds)} seed(s), {args.steps} steps"
          + (f" or {args.max_minutes} min" if args.max_minutes else "")
          + f"; dim {base.dim}, depth {base.depth}, heads {base.heads} ({base.n_local_attn_heads} local, window "
          f"{base.local_attn_window_size}), seq_len {base.seq_len}, batch {base.batch_size}", flush=True)
    results, reused_runs = {}, 0
    for seed in seeds:  # all variants of one seed, then the next: a slow drift of the machine hits all
        for name in names:
            run = run_options(base, name, seed)
            run.log = str(out / f"{name}_seed{seed}.json")
            log = reusable_log(run) if args.reuse else None
            reused = log is not None
            reused_runs += reused
            if not reused:
                log = train(run, quiet=True)
            results[(name, seed)] = log
            print(f"{name:<14} seed {seed}: valid {log['final_val_bpc']:.4f} bpc after {log['steps_done']} steps, "
                  f"{log['median_step_s']:.3f} s/step (median), load {log['machine']['load_average_at_end'][0]:.1f}"
                  + (f" (reused {run.log}, {log['date']})" if reused else ""), flush=True)

    rows = summarize(results, names, seeds)
    table = format_table(rows, seeds)
    minutes = (datetime.now(timezone.utc) - started).total_seconds() / 60
    data = results[(names[0], seeds[0])]["data"]
    plot_comparison(results, names, seeds, out / "loss_comparison.png",
                    f"{Path(data).name}, dim {base.dim}, depth {base.depth}, seq {base.seq_len}, seeds {seeds}")
    caption = (f"Final validation BPC on {Path(data).name} ({base.eval_batches * base.batch_size} fixed windows of "
               f"{base.seq_len} bytes), {started:%Y-%m-%d}, {minutes:.1f} min in all"
               + (f" ({reused_runs} of {len(results)} runs read from their logs, each with its own date)." if reused_runs
                  else "."))
    (out / "results.md").write_text(caption + "\n\n" + table + "\n")
    (out / "results.json").write_text(json.dumps(
        {"date": started.isoformat(timespec="seconds"), "seeds": seeds, "options": vars(base), "rows": rows}, indent=2))
    print()
    print(caption)
    print(table)
    print(f"plot, table and logs in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
