#!/usr/bin/env python
"""Context parallelism on the CPU: P gloo processes train one sequence of n tokens, against
one process on the whole sequence.

For each n, one fresh process runs the whole sequence, then P fresh processes (meeting through
a file store) each run their slice (``context_parallel=group``), all with the same thread count,
each timing training steps of ``AutoregressiveWrapper``'s loss (batch 1). Per process:

* peak memory over the baseline taken after building the model (``common.PeakMemory``); a
  rank's target is about 1/P of the one process's peak plus a constant (gradients, halos). The
  workers run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (``--mmap-threshold``), so that freed
  buffers leave the heap and the peak follows the live tensors, not the order of allocations;
* the bytes handed to the collectives in one step, forward and backward: the layers' floats
  (per layer, independent of n) and the integer bookkeeping (shape check, target counts);
* the step's matmul FLOPs (``common.MatmulFlops``) at the square matmul rate of the same
  process: the floor.

The P ranks' step time is the slowest rank's median. With more processes than cores the ranks
share cores: the time then measures the oversubscribed machine; memory and bytes do not.

Usage:  python benchmarks/bench_context_parallel.py [--world-sizes 2 4] [--lengths 16384 32768 65536]
        python benchmarks/bench_context_parallel.py --world-sizes 2 --lengths 4096 --steps 1   # quick
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    GiB,
    emit_result,
    kwargs_text,
    measure_step,
    print_header,
    record,
    run_in_subprocess,
    set_threads,
    table,
)

# the model under test: the mix only this library runs under context parallelism (global causal
# heads with a per-head gate beside one local softmax head, a convolution, token shift)
MODEL = dict(num_tokens=256, dim=256, heads=4, dim_head=64, depth=2, causal=True, n_local_attn_heads=1,
             local_attn_window_size=128, use_gate=True, use_local_conv=True, shift_tokens=True)


class CollectiveBytes:
    """Counts the bytes this process hands to ``torch.distributed``'s all_reduce and all_gather
    (the collectives the library calls; the autograd-aware ones call them too) while it is
    entered: floating-point tensors (the layers' summaries and halos) and integer ones (shape
    checks, counts) apart."""

    SENT_ARGUMENT = {"all_reduce": 0, "all_gather": 1}  # all_reduce(tensor), all_gather(list, tensor)

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.floats, self.integers, self.calls, self.saved = dist, 0, 0, 0, {}

    def _counted(self, original, position):
        def collective(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs["tensor"]
            size = tensor.numel() * tensor.element_size()
            self.floats += size if tensor.is_floating_point() else 0
            self.integers += 0 if tensor.is_floating_point() else size
            self.calls += 1
            return original(*args, **kwargs)
        return collective

    def __enter__(self):
        for name, position in self.SENT_ARGUMENT.items():
            self.saved[name] = getattr(self.dist, name)
            setattr(self.dist, name, self._counted(self.saved[name], position))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


# ------------------------------------------------------------------------------ worker


def build(n, device="cpu"):
    from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

    torch.manual_seed(0)
    return AutoregressiveWrapper(LinearAttentionTransformerLM(**MODEL, max_seq_len=n)).to(device).train()


def tokens_of(n):
    """The whole sequence: n inputs and the target after the last (n + 1 tokens), batch 1."""
    return torch.randint(0, MODEL["num_tokens"], (1, n + 1), generator=torch.Generator().manual_seed(1))


def worker(args):
    """One process: the whole sequence (world 1) or rank ``rank`` of P; prints one result line."""
    import torch.distributed as dist

    set_threads(args.threads)
    rank, world, n = args.rank, args.world, args.worker_n
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
        group = dist.group.WORLD
    n_local = n // world
    model = build(n)
    x = tokens_of(n)[:, rank * n_local : (rank + 1) * n_local + 1].clone()
    kwargs = {} if group is None else dict(context_parallel=group)

    last = {}

    def step():
        if group is not None:
            dist.barrier()  # every rank starts the step together: the slowest rank sets the time
        model.zero_grad(set_to_none=True)
        loss = model(x, **kwargs)
        loss.backward()
        last["loss"] = loss.detach()

    with CollectiveBytes() as sent:
        step()  # untimed: the bytes of one step
    result = dict(measure_step(step, "cpu", args.steps, 0, args.matmul_size), rank=rank, world=world, n=n,
                  float_bytes=sent.floats, integer_bytes=sent.integers, collectives=sent.calls)
    loss = last["loss"].clone()
    if group is not None:  # the whole loss, for the check against one process
        dist.all_reduce(loss, group=group)
    result["loss"] = float(loss)
    emit_result(result)
    del model, loss, last
    if group is not None:
        dist.barrier()  # no rank shuts its connections while another still reads (tests/test_distributed.py)
        gc.collect()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # never finalize the interpreter with gloo's threads alive (tests/test_distributed.py)


# ------------------------------------------------------------------------------ driver


def worker_env(args):
    """The workers' environment: this one, with glibc's mmap threshold fixed (see the docstring)."""
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    return env


def worker_argv(args, n, world, rank=0, store=""):
    return ["--worker-n", n, "--world", world, "--rank", rank, "--store", store, "--steps", args.steps,
            "--threads", args.threads, "--matmul-size", args.matmul_size]


def run_ranks(args, n, world):
    """P processes at once; their results in rank order, or (None, the first error text)."""
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(world) as pool:
        runs = [pool.submit(run_in_subprocess, __file__, worker_argv(args, n, world, rank, f"{folder}/store"),
                            f"rank {rank} of {world} at n={n}", env=worker_env(args)) for rank in range(world)]
        outcomes = [run.result() for run in runs]
    errors = [error for _, error in outcomes if error]
    return ([result for result, _ in outcomes], None) if not errors else (None, errors[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="P, processes per sequence")
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536], help="whole sequence lengths")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the counted first step (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every process (default 1)")
    p.add_argument("--matmul-size", type=int, default=1024, help="side of the square reference matmul")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ of the workers in bytes (0: glibc's dynamic default)")
    p.add_argument("--record", metavar="NAME", default=None, help="write the figures to results/NAME.json")
    p.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_n is not None:
        return worker(args)
    for n in args.lengths:
        for world in args.world_sizes:
            if world < 2 or n % world or (n // world) % MODEL["local_attn_window_size"]:
                p.error(f"every P must be >= 2 and every n a multiple of P * local_attn_window_size "
                        f"({MODEL['local_attn_window_size']}): n={n}, P={world}")

    set_threads(args.threads)  # the header reports the workers' thread count
    print_header("cpu", args.threads, [f"AutoregressiveWrapper(LinearAttentionTransformerLM({kwargs_text(MODEL)}))",
                                       "batch 1, fp32, gloo, one process per rank"])
    started = time.perf_counter()
    rows, errors = [], []
    for n in args.lengths:
        single, error = run_in_subprocess(__file__, worker_argv(args, n, 1), f"one process at n={n}",
                                          env=worker_env(args))
        if error:
            errors.append(error)
            continue
        rows.append((n, 1, [single], single))
        for world in args.world_sizes:
            ranks, error = run_ranks(args, n, world)
            if error:
                errors.append(error)
            else:
                rows.append((n, world, ranks, single))
    for error in errors:
        print(error, "\n")

    print("training step (forward + backward of the wrapper's loss), per process:")
    lines, figures = [], {}
    for n, world, ranks, single in rows:
        step = max(r["median"] for r in ranks)
        floor = max(r["flops"] / r["rate"] for r in ranks)
        peak = max(r["peak"] for r in ranks)
        per_layer = max(r["float_bytes"] for r in ranks) / MODEL["depth"]
        figures[f"n={n} P={world}"] = dict(peak_vs_one=peak / single["peak"], kib_per_layer=per_layer / 1024,
                                           floor_share=floor / step)
        lines.append([
            n, world, n // world, f"{step:.2f}", f"{single['median'] / step:.2f}",
            f"{floor:.2f}", f"{100 * floor / step:.0f} %",
            " / ".join(f"{r['rate'] / 1e9:.0f}" for r in ranks),
            f"{peak / GiB:.3f}", f"{peak / single['peak']:.3f}",
            "-" if world == 1 else f"{per_layer / 1024:.1f}",
            "-" if world == 1 else f"{max(r['integer_bytes'] for r in ranks)}",
            f"{abs(ranks[0]['loss'] - single['loss']):.1e}",
        ])
    print(table(["n", "P", "n/P", "s/step", "speedup", "floor s", "floor/time", "matmul GFLOP/s",
                 "peak +GiB", "peak / 1 proc", "KiB/layer", "int B/step", "|loss - 1 proc|"], lines))
    method = rows[0][3]["memory_method"] if rows else "-"
    print(f"(s/step: the slowest rank's median; floor: its matmul FLOPs at its square matmul rate; peak: the "
          f"largest rank's {rows[0][3]['memory_method'] if rows else '-'}; KiB/layer: floats sent per step "
          f"over the depth; "
          f"int B/step: the integer bookkeeping; {args.threads} thread(s) per process, {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s)")
    if args.record:
        print("recorded in", record(args.record, "cpu", figures))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
