#!/usr/bin/env python
"""Context parallelism on the CPU: P gloo processes train one sequence (``context_parallel=group``),
against one process on the whole of it: time, peak memory, bytes sent (benchmarks/README.md).

Usage:  python benchmarks/bench_context_parallel.py [--world-sizes 2 4] [--lengths 16384 32768 65536] [--steps 1]
"""

import argparse
import concurrent.futures
import functools
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402  (the folder of this script, see common.py)
    GiB, arguments, emit_result, finish, kwargs_text, measure_step, run_in_subprocess, set_threads, start, table)

# the model under test: the mix only this library runs under context parallelism (global causal
# heads with a per-head gate beside one local softmax head, a convolution, token shift)
MODEL = dict(num_tokens=256, dim=256, heads=4, dim_head=64, depth=2, causal=True, n_local_attn_heads=1,
             local_attn_window_size=128, use_gate=True, use_local_conv=True, shift_tokens=True)


class CollectiveBytes:
    """Counts the bytes this process hands to ``torch.distributed``'s all_reduce and all_gather while it is
    entered: floating-point tensors (the layers' summaries and halos) and integer ones (shape checks) apart."""

    SENT_ARGUMENT = {"all_reduce": 0, "all_gather": 1}  # all_reduce(tensor), all_gather(list, tensor)

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.floats, self.integers, self.saved = dist, 0, 0, {}

    def _count(self, original, position, *args, **kwargs):
        tensor = args[position] if len(args) > position else kwargs["tensor"]
        size = tensor.numel() * tensor.element_size()
        self.floats += size if tensor.is_floating_point() else 0
        self.integers += 0 if tensor.is_floating_point() else size
        return original(*args, **kwargs)

    def __enter__(self):
        for name, position in self.SENT_ARGUMENT.items():
            self.saved[name] = getattr(self.dist, name)
            setattr(self.dist, name, functools.partial(self._count, self.saved[name], position))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def worker(args):
    """One process: the whole sequence (world 1) or rank ``rank`` of P; prints one result line."""
    import torch.distributed as dist

    from linear_attention_transformer import AutoregressiveWrapper, LinearAttentionTransformerLM

    set_threads(args.threads)
    rank, world, n = args.rank, args.world, args.n
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
        group = dist.group.WORLD
    torch.manual_seed(0)
    model = AutoregressiveWrapper(LinearAttentionTransformerLM(**MODEL, max_seq_len=n)).train()
    # the whole sequence is n inputs and the target after the last; this process's slice of it
    x = torch.randint(0, MODEL["num_tokens"], (1, n + 1), generator=torch.Generator().manual_seed(1))
    x = x[:, rank * (n // world) : (rank + 1) * (n // world) + 1].clone()
    kwargs, last = ({} if group is None else dict(context_parallel=group)), {}

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
                  float_bytes=sent.floats, integer_bytes=sent.integers)
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


def run_ranks(args, n, world):
    """P processes at once (P = 1: the whole sequence): (results in rank order, None) or (None, the first error)."""
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {})}
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(world) as pool:
        jobs = [dict(n=n, world=world, rank=rank, store=f"{folder}/store", steps=args.steps, threads=args.threads,
                     matmul_size=args.matmul_size) for rank in range(world)]
        runs = [pool.submit(run_in_subprocess, __file__, ["--worker", json.dumps(job)],
                            f"rank {job['rank']} of {world} at n={n}", env=env) for job in jobs]
        outcomes = [run.result() for run in runs]
    errors = [error for _, error in outcomes if error]
    return ([result for result, _ in outcomes], None) if not errors else (None, errors[0])


def main(argv=None):
    p = arguments(__doc__, device=False, matmul_size=True)
    p.set_defaults(threads=1, matmul_size=1024)  # in every process
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="P, processes per sequence")
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536], help="whole sequence lengths")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the counted first step (default 2)")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ of the workers in bytes (0: glibc's dynamic default)")
    p.add_argument("--worker", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(argparse.Namespace(**args.worker))
    for n in args.lengths:
        for world in args.world_sizes:
            if world < 2 or n % world or (n // world) % MODEL["local_attn_window_size"]:
                p.error(f"every P must be >= 2 and every n a multiple of P * local_attn_window_size "
                        f"({MODEL['local_attn_window_size']}): n={n}, P={world}")

    start(args, [f"AutoregressiveWrapper(LinearAttentionTransformerLM({kwargs_text(MODEL)}))",  # (the workers' threads)
                 "batch 1, fp32, gloo, one process per rank"])
    started = time.perf_counter()
    rows, errors = [], []
    for n in args.lengths:
        for world in (1, *args.world_sizes):  # one process on the whole sequence first
            ranks, error = run_ranks(args, n, world)
            if error:
                errors.append(error)
                if world == 1:
                    break
                continue
            rows.append((n, world, ranks, ranks[0] if world == 1 else rows[-1][3]))  # and one process's result
    for error in errors:
        print(error, "\n")

    print("training step (forward + backward of the wrapper's loss), per process:")
    lines, figures = [], {}
    for n, world, ranks, single in rows:
        step, peak = (max(r[key] for r in ranks) for key in ("median", "peak"))
        floor = max(r["flops"] / r["rate"] for r in ranks)
        per_layer = max(r["float_bytes"] for r in ranks) / MODEL["depth"]
        figures[f"n={n} P={world}"] = dict(peak_vs_one=peak / single["peak"], kib_per_layer=per_layer / 1024,
                                           floor_share=floor / step)
        lines.append([n, world, n // world, f"{step:.2f}", f"{single['median'] / step:.2f}", f"{floor:.2f}",
                      f"{100 * floor / step:.0f} %", " / ".join(f"{r['rate'] / 1e9:.0f}" for r in ranks),
                      f"{peak / GiB:.3f}", f"{peak / single['peak']:.3f}",
                      "-" if world == 1 else f"{per_layer / 1024:.1f}",
                      "-" if world == 1 else f"{max(r['integer_bytes'] for r in ranks)}",
                      f"{abs(ranks[0]['loss'] - single['loss']):.1e}"])
    print(table(["n", "P", "n/P", "s/step", "speedup", "floor s", "floor/time", "matmul GFLOP/s",
                 "peak +GiB", "peak / 1 proc", "KiB/layer", "int B/step", "|loss - 1 proc|"], lines))
    print(f"(s/step: the slowest rank's median; floor: its matmul FLOPs at its square matmul rate; peak: the "
          f"largest rank's {rows[0][3]['memory_method'] if rows else '-'}; KiB/layer: floats sent per step over the "
          f"depth; int B/step: the integer bookkeeping; {args.threads} thread(s) per process, {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s)")
    finish(args, figures)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
