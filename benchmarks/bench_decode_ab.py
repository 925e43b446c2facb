#!/usr/bin/env python
"""Eager greedy decoding of this checkout against another checkout of the library, in alternating rounds.

Each round times each model under each checkout (the order turning every other round) in a
process of its own: ``AutoregressiveWrapper(model).generate(prompt, n, temperature=0)`` for
``--tokens`` tokens and for one after a 16-token prompt, best of 3, gives the milliseconds per
token (t_n - t_1) / (n - 1), the prefill left out; beside it the warm weights' floor
(``common.weight_floors``). Models (fp32, eval, one row, seed 0): ``generate``, bench_generate.py's;
``d512``: dim 512, depth 6, 4 local + 4 global heads; ``d512_recommended``: with the recommended heads.

Usage:  git worktree add /tmp/other <commit>
        python benchmarks/bench_decode_ab.py --threads 1 --other /tmp/other [--rounds 3] [--tokens 256]
"""

import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate  # noqa: E402
import common  # noqa: E402

D512 = dict(num_tokens=256, dim=512, depth=6, heads=8, n_local_attn_heads=4, local_attn_window_size=64, causal=True,
            max_seq_len=2048)
MODELS = {"generate": bench_generate.MODEL, "d512": D512,
          "d512_recommended": dict(D512, use_gate=True, use_local_conv=True, feature_map="taylor", dim_qk=16)}


def worker(job):
    torch.set_num_threads(job["threads"])
    wrapper = bench_generate.build_wrapper("cpu", MODELS[job["model"]])
    prompt = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        many, one = (common.best_seconds(lambda n=n: wrapper.generate(prompt, n, temperature=0), "cpu", 3, min_time=0)
                     for n in (job["tokens"], 1))
    floor = common.weight_floors(wrapper.net, "cpu")[0]
    common.emit_result({"ms": 1e3 * (many - one) / (job["tokens"] - 1), "floor_ms": 1e3 * floor})


def main(argv=None):
    p = common.arguments(__doc__, device=False)
    p.add_argument("--other", help="a checkout of the library to compare with (required)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--worker", type=json.loads, default=None)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    if args.other is None:
        p.error("--other is required")
    checkouts = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "other": args.other}
    figures = {"other": subprocess.run(["git", "-C", args.other, "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()}
    for model in args.models:
        def side(label, model=model):
            job = dict(model=model, tokens=args.tokens, threads=args.threads or 1)
            got, error = common.run_in_subprocess(__file__, ["--worker", json.dumps(job)], f"{model} {label}",
                                                  dict(os.environ, PYTHONPATH=os.path.abspath(checkouts[label])))
            if error:
                raise SystemExit(error)
            print(f"{model} {label}: {got['ms']:.3f} ms/token (floor {got['floor_ms']:.3f} ms)", flush=True)
            return got["ms"]

        times = common.in_turn({label: lambda label=label: side(label) for label in checkouts}, args.rounds, True)
        this, other = min(times["this"]), min(times["other"])
        figures[model] = {"this_ms": this, "other_ms": other, "ratio": this / other, "rounds": times}
        print(f"{model}: this {this:.3f} ms/token, other {other:.3f}, ratio {this / other:.2f} (best of "
              f"{args.rounds} rounds)")
    return common.finish(args, figures)


if __name__ == "__main__":
    sys.exit(main())
