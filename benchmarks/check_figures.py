#!/usr/bin/env python
"""Checks that each figure README.md and docs/ quote from a benchmark is the one its latest run
recorded in ``benchmarks/results/NAME.json``, with the run's date beside it ("Recorded runs" in
benchmarks/README.md). After a new run, update the quoting documents: this script says which.
"""

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

SAME_WORK = "loss=wrapper,ff_glu=False,ff_dropout=0.0 n=8192"
LOCAL = "ours n_local_attn_heads=4,local_attn_window_size=128,blindspot_size=64"
RECOMMENDED = "use_gate=True,use_local_conv=True,feature_map=taylor,dim_qk=16"

# (document, result name, the figure's key path in its figures (or a pair of paths: their
# quotient), the quoted text with the figure as {})
QUOTES = [
    ("docs/pretrained.md", "linearize", ["perplexity", "linearized, after training"], "/ **{:.2f}** ("),
    ("docs/pretrained.md", "linearize", ["ratio"], "({:.2f}x the original)"),
    ("docs/pretrained.md", "linearize", ["perplexity", "original"], "full attention (`from_llama`) | {:.2f} |"),
    ("docs/pretrained.md", "linearize", ["curve", 0, "perplexity"], "after 5 minutes of attention transfer | {:.2f} |"),
    ("docs/pretrained.md", "linearize_mixed", ["mixed_additive", "perplexity", "linearized, after training"],
     "(`--mixed 3 --gates --conv`) | 4,226 | 39.80 | {:.2f} |"),
    ("docs/pretrained.md", "linearize_mixed", ["mixed_delta", "perplexity", "linearized, after training"],
     "--gates`) | 3,535,360 | 92,398 | {:,.0f} |"),
    ("README.md", "lm_upstream", [f"speed vs upstream, {SAME_WORK}"], "**{:.1f}x upstream's speed"),
    ("README.md", "lm_upstream", [f"peak vs upstream, {SAME_WORK}"], "{:.2f}x its peak memory**"),
    ("README.md", "generate", ["speedup"], "**{:.0f}x faster**"),
    ("benchmarks/README.md", "lm", ["ours base n=16384", "floor_share"], "| {:.0%} | `lm`"),
    ("benchmarks/README.md", "lm", ["peak n=16384 / n=4096, base"], "| {:.2f}x | `lm`"),
    ("README.md", "lm_checkpoint", ["peak vs first variant, depth=4,checkpoint=True n=4096"],
     "extra memory to {:.2f}x"),
    ("docs/packed.md", "lm_packed", ["time vs first variant, segments=8 n=4096"], "global heads {:.2f}x"),
    ("docs/packed.md", "lm_packed", ([f"{LOCAL},segments=8 n=4096", "median"], [f"{LOCAL} n=4096", "median"]),
     "blindspot {:.2f}x"),
    ("docs/kernels.md", "kernel", ["form=parallel 1,8,4096,64", "vs_first"], "exact chunks take {:.1f}x"),
    ("docs/kernels.md", "kernel", ["form=parallel 1,8,16384,64", "vs_first"], "/ {:.1f}x its time"),
    ("README.md", "recall", ["32:4 softmax+conv seed 0", "steps_to_pass"], "| softmax + short convolution | {:,} /"),
    ("README.md", "recall", ["32:4 softmax-mlp seed 0", "steps_to_pass"], "| plain softmax, no MLP (Zoology's) | {:,} /"),
    ("docs/layers.md", "lm_recommended", [f"time vs first variant, {RECOMMENDED} n=4096"], "takes {:.2f}x the time"),
    ("docs/layers.md", "lm_recommended", [f"peak vs first variant, {RECOMMENDED} n=4096"], "{:.2f}x the extra memory"),
    ("docs/layers.md", "generate_recommended", ["ms_per_token"], "takes {:.2f} ms per token"),
    ("docs/layers.md", "generate_gated", ["ms_per_token"], "against {:.2f} (1."),
    ("docs/layers.md", "recall", ["64:4 softmax+conv seed 0", "steps_to_pass"],
     "| 64, 4 | **softmax + short convolution** | `softmax+conv` | {:,} /"),
    ("benchmarks/README.md", "generate_past", ["past", "past_over_within"], "| {:.2f}x | `generate_past`"),
    ("benchmarks/README.md", "export", ["bench_generate's", "runtime_over_library"], "| {:.2f}x | `export`"),
    ("benchmarks/README.md", "step_delta", ["ratio"], "| {:.2f}x | `step_delta`"),
    ("benchmarks/README.md", "vllm", ["vllm_over_library"], "| {:.2f}x | `vllm`"),
    ("benchmarks/README.md", "step_delta_gated", ["ratio"], "| {:.2f}x | `step_delta_gated`"),
    ("benchmarks/README.md", "decode_vs_fbcdff8", ["generate", "ratio"], "| {:.2f}x; "),
    ("benchmarks/README.md", "decode_vs_1366b1f", ["generate", "ratio"], "| {:.2f}x; "),
    ("benchmarks/README.md", "layer_delta", ["time vs first variant, update_rule=delta n=16384"],
     "| {:.2f}x | `layer_delta`"),
    ("docs/layers.md", "generate_past", ["past", "past_over_within"], "a token at the end costs {:.2f}x one"),
    ("docs/layers.md", "generate_past_recommended", ["past", "past_over_within"], "the end costs {:.2f}x ("),
    ("docs/layers.md", "length", ["recommended-rotary mean", "1x"], "| recommended heads, rotary | {:.3f} |"),
    ("docs/layers.md", "length", ["recommended-rotary mean", "16x"], "reads at {:.3f} bits per byte"),
    ("docs/layers.md", "length", ["softmax-rotary mean", "16x"], "4.493 at 4× and {:.3f} at 16×"),
    ("benchmarks/README.md", "length", ["recommended-rotary seed 0", "16x last quarter"],
     "| recommended heads, rotary | 0 | 2.189 | 2.173 (2.129) | 2.166 ({:.3f}) |"),
]


def recorded(name, results=RESULTS):
    with open(os.path.join(results, f"{name}.json")) as f:
        return json.load(f)


def figure(entry, keys):
    """The figure at a key path, or the quotient of the figures at a pair of key paths."""
    if isinstance(keys, tuple):
        return figure(entry, keys[0]) / figure(entry, keys[1])
    value = entry["figures"]
    for key in keys:
        value = value[key]
    return value


def problems(quotes=QUOTES, root=ROOT, results=RESULTS):
    """One line per quote that its document does not hold as recorded (or without the run's date)."""
    found = []
    for document, name, keys, text in quotes:
        try:
            entry = recorded(name, results)
            quoted = text.format(figure(entry, keys))
        except (OSError, KeyError) as error:
            found.append(f"{document}: no recorded figure {name}{keys} ({error!r})")
            continue
        with open(os.path.join(root, document)) as f:
            content = f.read()
        if quoted not in content:
            found.append(f"{document}: should quote {quoted!r} ({name}, {entry['date']}: {entry['command']})")
        elif entry["date"][:10] not in content:
            found.append(f"{document}: quotes {quoted!r} without its run's date {entry['date'][:10]}")
    table, rows = os.path.join(root, "benchmarks", "README.md"), []  # each row of its tables dated as its record
    if os.path.exists(table):
        with open(table) as f:
            rows = re.findall(r"\| `(\w+)` \| (\d{4}-\d\d-\d\d \d\d:\d\d UTC) \|", f.read())
    found += [f"benchmarks/README.md: a row of {name} dated {date}, its latest run {recorded(name, results)['date']}"
              for name, date in rows if recorded(name, results)["date"] != date]
    return found


def main():
    found = problems()
    for line in found:
        print(line)
    print(f"{len(found)} to update" if found else f"all {len(QUOTES)} quotes and the tables of latest figures match")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
