"""Runs a two-process DDP training (gloo, CPU) many times and counts the runs whose workers
both exit, each within a time limit. Not part of CI's run (minutes, not seconds):

    python .ci/ddp_exit.py --runs 20 --load 2        # the ending docs/scale.md recommends
    python .ci/ddp_exit.py --runs 20 --load 2 --end naive

Each worker trains a small LM for three SGD steps, then ends the way --end says:
'recommended' meets the other rank at a barrier, drops the DDP module and collects garbage
before destroying the group; 'naive' destroys the group with the DDP module still alive.
--load starts that many busy processes under `nice` for the duration, as a loaded machine.
Exit status 0 when every run ended, 1 otherwise.
"""

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(rank, store, end):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT))
    from linear_attention_transformer import LinearAttentionTransformerLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(LinearAttentionTransformerLM(
        num_tokens=64, dim=32, depth=2, heads=4, max_seq_len=64, causal=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 64), generator=generator)
        model(tokens).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if end == "recommended":
        dist.barrier()
        del model, optimizer
        gc.collect()
    dist.destroy_process_group()


def one_run(end, timeout):
    """Seconds the pair took, or None when a worker was still running after ``timeout`` or failed."""
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "store"
        start = time.perf_counter()
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(store), end])
                   for rank in range(2)]
        deadline = start + timeout
        codes = []
        for process in workers:
            try:
                codes.append(process.wait(timeout=max(deadline - time.perf_counter(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
        return time.perf_counter() - start if codes == [0, 0] else None, codes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--end", choices=("recommended", "naive"), default="recommended")
    parser.add_argument("--load", type=int, default=2, help="busy processes under nice while the runs go")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.worker[2])
        return 0
    load = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    ended = 0
    try:
        for run in range(1, args.runs + 1):
            seconds, codes = one_run(args.end, args.timeout)
            ended += seconds is not None
            state = f"ended in {seconds:.1f} s" if seconds is not None else f"did not end (exit codes {codes})"
            print(f"run {run}: {state}", flush=True)
    finally:
        for process in load:
            process.kill()
    print(f"{ended} of {args.runs} runs ended (--end {args.end}, --load {args.load})")
    return 0 if ended == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
