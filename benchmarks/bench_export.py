#!/usr/bin/env python
"""The exported decoding step in ONNX Runtime against the library's eager step, per token, for
``bench_generate.py``'s model and ``LARGE``, beside the weights' warm floor (benchmarks/README.md).

Usage:  python benchmarks/bench_export.py --threads 1 [--tokens 64] [--rounds 5] [--record export]
"""

import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the folder of this script, see common.py)
from bench_generate import MODEL, build_wrapper  # noqa: E402

LARGE = dict(num_tokens=256, dim=512, depth=6, heads=8, n_local_attn_heads=4, local_attn_window_size=64, causal=True,
             max_seq_len=2048)
NUMPY = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(double)": np.float64, "tensor(bool)": np.bool_}


def per_token(model, graph, tokens):
    """(library seconds, runtime seconds, largest logit difference) for one round of ``tokens``."""
    cache = model.empty_cache(1)
    names = [i.name for i in graph.get_inputs()]
    state = [np.zeros(i.shape, dtype=NUMPY[i.type]) for i in graph.get_inputs()[1:]]
    worst = library = runtime = 0.0
    for token in tokens:
        ids = torch.tensor([[token]])
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits, cache = model(ids, cache=cache, return_cache=True)
        t1 = time.perf_counter()
        out = graph.run(None, dict(zip(names, [ids.numpy(), *state])))
        library, runtime, state = library + t1 - t0, runtime + time.perf_counter() - t1, out[1:]
        worst = max(worst, float(np.abs(out[0] - logits[:, -1].numpy()).max()))
    return library / len(tokens), runtime / len(tokens), worst


def main(argv=None):
    p = common.arguments(__doc__, device=False)  # (--threads: torch's and the runtime's)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import onnxruntime

    from linear_attention_transformer.export import export_onnx

    common.start(args)
    rows, figures = [], {}
    for name, options in (("bench_generate's", MODEL), ("dim 512, depth 6", LARGE)):
        model = build_wrapper("cpu", options).net
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "step.onnx")
            export_onnx(model, path, batch_size=1)
            settings = onnxruntime.SessionOptions()
            if args.threads is not None:
                settings.intra_op_num_threads = settings.inter_op_num_threads = args.threads
            graph = onnxruntime.InferenceSession(path, settings, providers=["CPUExecutionProvider"])
        tokens = torch.randint(0, options["num_tokens"], (args.tokens,), generator=torch.Generator().manual_seed(1))
        per_token(model, graph, tokens[:8].tolist())  # warm both
        rounds = [per_token(model, graph, tokens.tolist()) for _ in range(args.rounds)]
        library, runtime = min(r[0] for r in rounds), min(r[1] for r in rounds)
        warm, _ = common.weight_floors(model, "cpu")
        figures[name] = dict(library_ms_per_token=1e3 * library, runtime_ms_per_token=1e3 * runtime,
                             runtime_over_library=runtime / library, warm_floor_ms=1e3 * warm,
                             max_logit_difference=rounds[-1][2])
        rows.append([name, f"{1e3 * library:.3f}", f"{1e3 * runtime:.3f}", f"{runtime / library:.2f}x",
                     f"{1e3 * warm:.3f}", f"{rounds[-1][2]:.1e}"])
    print(common.table(["model", "library ms/token", "ONNX Runtime ms/token", "runtime / library",
                        "warm floor ms", "max |logit diff|"], rows))
    common.finish(args, figures)


if __name__ == "__main__":
    main()
