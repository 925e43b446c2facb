#!/usr/bin/env python
"""The default training command on a busy machine: ``python examples/train_enwik8.py``'s step
time on a quiet machine and with one other process keeping one core busy, side by side.

Every run is the script itself in a fresh process (its own choice of threads and OpenMP
waiting, as a user gets them), with the default model and data and only shorter reporting
(``--steps``, no evaluation until the last step, no samples, no test); its log's median step
is the figure. A config is ``auto`` (no ``--threads``: the default command) or a thread
count ``N`` (``--threads N``), either with ``+spin``: torch is imported before the script
sets ``OMP_WAIT_POLICY=PASSIVE``, so OpenMP waits as its runtime does by default (it spins),
which is the default command before 2026-11-25 when the count is torch's own. The busy
process is ``python -c "while True: pass"``, started a second before the run and killed
after it. Quiet and busy runs alternate, ``--repeats`` times, so that the load of other work
(printed before every run) drifts over both alike; each figure is the median over repeats.

Beside them, as every benchmark here prints: the square fp32 matmul rate and the floor, the
default step's matmuls replayed alone at their own shapes (``common.matmul_replay``), both
at the thread count the quiet ``auto`` run chose, measured in this process between runs.

Target (issue 29): with one busy process, the default command's step within 1.5x of its
quiet step.

Usage:  python benchmarks/bench_threads.py [--configs auto 2+spin] [--steps 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_enwik8.py"
# torch (and its OpenMP runtime) loaded before the script runs: the runtime's default waiting
SPIN_LAUNCHER = ("import os, runpy, sys, torch; sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")


def parse_config(text):
    """'auto' | 'N', optionally '+spin' -> (threads or None, spin)."""
    base, _, suffix = text.partition("+")
    if suffix not in ("", "spin") or not (base == "auto" or base.isdigit() and int(base) > 0):
        raise SystemExit(f"--configs: {text!r} is not 'auto' or a thread count, optionally with '+spin'")
    return (None if base == "auto" else int(base)), suffix == "spin"


def run_once(config, busy, args, folder):
    """One run of the script under ``config``, with or without the busy process: its log."""
    threads, spin = parse_config(config)
    log = Path(folder) / "run.json"
    log.unlink(missing_ok=True)
    options = ["--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-batches", "1",
               "--test-batches", "0", "--generate", "0", "--timing-warmup", str(args.timing_warmup),
               "--max-minutes", str(args.max_minutes), "--log", str(log)]
    if threads:
        options += ["--threads", str(threads)]
    launcher = [sys.executable, "-c", SPIN_LAUNCHER] if spin else [sys.executable]
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if competitor is not None:
            time.sleep(1.0)  # running before the script looks at the machine
        done = subprocess.run([*launcher, str(SCRIPT), *options], capture_output=True, text=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if done.returncode != 0 or not log.is_file():
        raise SystemExit(f"{config} ({'busy' if busy else 'quiet'}) failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return json.loads(log.read_text())


def floor_and_rate(threads):
    """(seconds of the default step's matmuls replayed alone, their FLOPs, calls, square
    matmul FLOP/s) at ``threads`` threads, in this process."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_enwik8

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        options = train_enwik8.build_parser().parse_args([])
        torch.manual_seed(0)
        model = train_enwik8.build_model(options)
        x = torch.randint(0, 256, (options.batch_size, options.seq_len + 1))
        seconds, flops, calls = common.matmul_replay(lambda: model(x, return_loss=True).backward(), "cpu")
        return seconds, flops, calls, common.square_matmul_rate("cpu")
    finally:
        torch.set_num_threads(previous)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["auto", f"{torch.get_num_threads()}+spin"],
                   help="'auto' (the default command) or N (--threads N), each optionally '+spin' (torch's "
                        "OpenMP waits as its runtime does by default); the second default is the default "
                        "command before 2026-11-25")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--timing-warmup", type=int, default=5, help="first steps of each run left out of its median")
    p.add_argument("--max-minutes", type=float, default=1.0, help="stop a run after this much training")
    p.add_argument("--repeats", type=int, default=2, help="quiet and busy runs of every config, alternating")
    args = p.parse_args(argv)
    for config in args.configs:
        parse_config(config)
    if args.steps <= args.timing_warmup or args.repeats < 1:
        raise SystemExit("--steps must exceed --timing-warmup and --repeats be >= 1")

    common.print_header("cpu", None, [f"{SCRIPT.relative_to(ROOT)} with its default model and data, "
                                      f"{args.steps} steps per run (median after {args.timing_warmup})",
                                      f"OMP_WAIT_POLICY in this environment: {os.environ.get('OMP_WAIT_POLICY')}, "
                                      f"OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS')}"])
    results = {(c, b): [] for c in args.configs for b in (False, True)}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.repeats):
            for config in args.configs:
                for busy in (False, True):
                    print(f"repeat {r + 1}, {config:>8}, {'busy ' if busy else 'quiet'}: {common.load_average()}",
                          flush=True)
                    log = run_once(config, busy, args, folder)
                    results[config, busy].append(log)
                    print(f"    {log['median_step_s'] * 1000:7.0f} ms/step, {log['machine']['threads']} threads "
                          f"({log['machine'].get('threads_reason', '?')})", flush=True)
    quiet_auto = results.get(("auto", False)) or results[args.configs[0], False]
    floor_threads = quiet_auto[0]["machine"]["threads"]
    seconds, flops, calls, rate = floor_and_rate(floor_threads)

    def median_ms(logs):
        return 1000 * statistics.median(log["median_step_s"] for log in logs)

    def thread_counts(logs):
        return "/".join(str(log["machine"]["threads"]) for log in logs)

    rows = []
    for config in args.configs:
        quiet, busy = median_ms(results[config, False]), median_ms(results[config, True])
        rows.append([config, thread_counts(results[config, False]), f"{quiet:.0f}", f"{quiet / seconds / 1000:.1f}",
                     thread_counts(results[config, True]), f"{busy:.0f}", f"{busy / seconds / 1000:.1f}",
                     f"{busy / quiet:.2f}x"])
    print()
    print(common.table(["config", "threads", "quiet ms/step", "/ floor", "threads", "busy ms/step", "/ floor",
                        "busy / quiet"], rows))
    print()
    print(f"floor:   the default step's {calls} matmuls ({flops / 1e9:.2f} GFLOP) replayed alone at "
          f"{floor_threads} threads: {seconds * 1000:.1f} ms")
    print(f"matmul:  {common.square_matmul_desc(common.default_matmul_size('cpu'))} at {floor_threads} threads: "
          f"{rate / 1e9:.1f} GFLOP/s")
    print(f"load:    {common.load_average()} (at the end)")
    print("target:  busy / quiet <= 1.5x for 'auto' (the default command)")


if __name__ == "__main__":
    main()
