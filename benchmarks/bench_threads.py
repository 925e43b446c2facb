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
at the thread count the quiet ``auto`` run chose, measured in this process after the runs
(without the busy process, OpenMP's idle threads asleep as in the default command).

Target (issue 29): with one busy process, the default command's step within 1.5x of its
quiet step.

``--profile`` runs one profiled step per config instead, quiet and busy: the step's number of
ops, its matmuls' time, and the count and mean time of its small element-wise ops.

Usage:  python benchmarks/bench_threads.py [--configs auto 2+spin] [--steps 30] [--repeats 2] [--profile]
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

# this process measures the floor and the matmul rate with idle OpenMP threads asleep, as the
# default command runs; the runs get the environment as it was (the script sets its own)
# (imported after torch, by a test, it leaves the environment alone)
USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
if "torch" not in sys.modules:
    os.environ["OMP_WAIT_POLICY"] = USER_WAIT_POLICY or "PASSIVE"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_enwik8.py"
# torch (and its OpenMP runtime) loaded before the script runs: the runtime's default waiting
SPIN_LAUNCHER = ("import os, runpy, sys, torch; sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")


def parse_config(text):
    """'auto' | 'N', optionally '+spin' -> (threads or None, spin)."""
    base, plus, suffix = text.partition("+")
    if plus and suffix != "spin" or not (base == "auto" or base.isdigit() and int(base) > 0):
        raise SystemExit(f"--configs: {text!r} is not 'auto' or a thread count, optionally with '+spin'")
    return (None if base == "auto" else int(base)), suffix == "spin"


def launch(config, busy, script, options):
    """``python script *options`` as ``config`` runs it (with torch imported first for '+spin'),
    beside the busy process when ``busy``; the completed process."""
    threads, spin = parse_config(config)
    launcher = [sys.executable, "-c", SPIN_LAUNCHER] if spin else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if USER_WAIT_POLICY is not None:
        env["OMP_WAIT_POLICY"] = USER_WAIT_POLICY
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if competitor is not None:
            time.sleep(1.0)  # running before the script looks at the machine
        return subprocess.run([*launcher, str(script), *options], capture_output=True, text=True, env=env)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def run_once(config, busy, args, folder):
    """One run of the script under ``config``, with or without the busy process: its log."""
    threads, _ = parse_config(config)
    log = Path(folder) / "run.json"
    log.unlink(missing_ok=True)
    options = ["--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-batches", "1",
               "--test-batches", "0", "--generate", "0", "--timing-warmup", str(args.timing_warmup),
               "--max-minutes", str(args.max_minutes), "--log", str(log)]
    if threads:
        options += ["--threads", str(threads)]
    done = launch(config, busy, SCRIPT, options)
    if done.returncode != 0 or not log.is_file():
        raise SystemExit(f"{config} ({'busy' if busy else 'quiet'}) failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return json.loads(log.read_text())


SMALL_OPS = ("copy_", "mul", "add_", "fill_", "add", "sum", "cat")


def profile_worker(threads):
    """Worker of --profile: the default model's training step with ``threads`` (0: the script's
    own choice), 2 warm-up and 5 timed steps, then one under torch.profiler; emits the median
    step, the number of ops, the matmuls' time and the small ops' counts and mean times."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_enwik8
    from torch.profiler import profile

    torch.set_num_threads(train_enwik8.choose_threads(threads)[0])
    options = train_enwik8.build_parser().parse_args([])
    torch.manual_seed(0)
    model = train_enwik8.build_model(options)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    x = torch.randint(0, 256, (options.batch_size, options.seq_len + 1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x, return_loss=True).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
        optimizer.step()

    times = []
    for i in range(7):
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    with profile() as prof:
        step()
    ops = {e.key.removeprefix("aten::"): (e.count, e.self_cpu_time_total) for e in prof.key_averages()}
    matmul_us = sum(ops.get(name, (0, 0))[1] for name in ("mm", "addmm", "bmm", "baddbmm"))
    common.emit_result(dict(threads=torch.get_num_threads(), step=statistics.median(times),
                            ops=sum(count for count, _ in ops.values()), matmul_ms=matmul_us / 1000,
                            small={name: ops[name] for name in SMALL_OPS if name in ops}))


def profile_runs(args):
    """--profile: every config quiet and busy, one worker each; a table of what they emit."""
    rows = []
    for config in args.configs:
        threads, _ = parse_config(config)
        for busy in (False, True):
            print(f"{config:>8}, {'busy ' if busy else 'quiet'}: {common.load_average()}", flush=True)
            done = launch(config, busy, Path(__file__).resolve(), ["--profile-worker", str(threads or 0)])
            result = next((json.loads(line[len(common.RESULT_TAG):]) for line in done.stdout.splitlines()
                           if line.startswith(common.RESULT_TAG)), None)
            if result is None:
                raise SystemExit(f"profile of {config} failed:\n{(done.stdout + done.stderr)[-2000:]}")
            small = result["small"]
            rows.append([config, "busy" if busy else "quiet", result["threads"], f"{result['step'] * 1000:.0f}",
                         result["ops"], f"{result['matmul_ms']:.0f}",
                         *(f"{small[n][0]} x {small[n][1] / small[n][0]:.0f}" if n in small else "-" for n in SMALL_OPS)])
    print()
    print(common.table(["config", "machine", "threads", "ms/step", "ops", "matmul ms",
                        *(f"{n} (us)" for n in SMALL_OPS)], rows))
    print(f"load:    {common.load_average()} (at the end)")


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
    p.add_argument("--profile", action="store_true",
                   help="instead: one profiled step per config, quiet and busy (ops, matmul time, the small "
                        "ops' counts and mean microseconds)")
    p.add_argument("--profile-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile_worker is not None:
        return profile_worker(args.profile_worker)
    for config in args.configs:
        parse_config(config)
    if args.steps <= args.timing_warmup or args.repeats < 1:
        raise SystemExit("--steps must exceed --timing-warmup and --repeats be >= 1")

    common.print_header("cpu", None, [f"{SCRIPT.relative_to(ROOT)} with its default model and data, "
                                      f"{args.steps} steps per run (median after {args.timing_warmup})",
                                      f"OMP_WAIT_POLICY in this environment: {USER_WAIT_POLICY}, "
                                      f"OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS')}"])
    if args.profile:
        return profile_runs(args)
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
